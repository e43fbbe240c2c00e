"""The autocast state of a forward, captured so that recomputation can replay it.

``torch.utils.checkpoint`` records whether autocast was on (and with which
dtype and cache setting) for the device of the inputs and for CPU when the
forward ran, and recomputes under the same state; remat and ``shard_params``
do the same with :func:`capture` and :meth:`AutocastState.replay`.

Example:
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     state = capture()
    >>> with state.replay():
    ...     torch.is_autocast_enabled("cpu")
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

__all__ = ["AutocastState", "capture"]


class _DeviceAutocast(NamedTuple):
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


class AutocastState(NamedTuple):
    """Autocast settings per device type at the time of :func:`capture`."""

    devices: tuple[_DeviceAutocast, ...]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body under exactly the captured autocast settings."""
        with contextlib.ExitStack() as stack:
            for d in self.devices:
                stack.enter_context(torch.autocast(
                    d.device_type, dtype=d.dtype, enabled=d.enabled, cache_enabled=d.cache_enabled
                ))
            yield

    @property
    def any_enabled(self) -> bool:
        """Whether autocast was on for any device type."""
        return any(d.enabled for d in self.devices)


def _device_types() -> tuple[str, ...]:
    types = ["cpu"]
    if torch.cuda.is_available():
        types.append("cuda")
    return tuple(types)


def capture() -> AutocastState:
    """The autocast settings now in force, for CPU and (if present) CUDA.

    Returns:
        An :class:`AutocastState` to :meth:`~AutocastState.replay` later.
    """
    return AutocastState(tuple(
        _DeviceAutocast(
            t,
            torch.is_autocast_enabled(t),
            torch.get_autocast_dtype(t),
            torch.is_autocast_cache_enabled(),
        )
        for t in _device_types()
    ))
