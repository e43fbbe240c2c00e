"""What a pipeline message carries: one tensor or a tuple/list of them, and what it declares.

Example:
    >>> declared_of_value((torch.zeros(2, 3), None))
    (Declared(shape=(2, 3), dtype=torch.float32), None)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["MAX_ENTRIES", "Declared", "DeclaredValue", "declared_entries", "declared_of_value",
           "entries_of"]

_TENSOR, _TUPLE, _LIST = 0, 1, 2  # what a message's value is: one tensor, a tuple, a list
MAX_ENTRIES = 8  # tensors in one message (a stage's tuple output)


class Declared(NamedTuple):
    """A message's shape and dtype, known to both sides before it is sent."""

    shape: tuple[int, ...]
    dtype: torch.dtype


#: what a message may declare: one tensor, or per entry of a tuple (None: no payload there)
DeclaredValue = Declared | tuple[Declared | None, ...]


def entries_of(value: Any) -> tuple[int, list[torch.Tensor | None]]:
    """``(container, entries)`` of a message value: one tensor (``_TENSOR``), or a tuple /
    list of tensors and Nones (``_TUPLE`` / ``_LIST``).

    Raises:
        TypeError: anything else (a dict, a nested tuple, a number).
        ValueError: more than ``MAX_ENTRIES`` entries.
    """
    if isinstance(value, torch.Tensor):
        return _TENSOR, [value]
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        bad = [j for j, e in enumerate(value) if e is not None and not isinstance(e, torch.Tensor)]
        if bad:
            raise TypeError(f"pipeline messages carry a tensor or a tuple/list of tensors (and "
                            f"None); entry {bad[0]} is a {type(value[bad[0]]).__name__}")
        if len(value) > MAX_ENTRIES:
            raise ValueError(f"pipeline messages carry at most {MAX_ENTRIES} tensors, got a "
                             f"{type(value).__name__} of {len(value)}")
        return (_TUPLE if isinstance(value, tuple) else _LIST), list(value)
    raise TypeError("pipeline messages carry a tensor or a tuple/list of tensors (and None), "
                    f"got a {type(value).__name__}")


def declared_of_value(value: Any) -> DeclaredValue:
    """The :data:`DeclaredValue` that ``value`` (a tensor or tuple/list of them) meets."""
    container, entries = entries_of(value)
    found = tuple(None if e is None else Declared(tuple(e.shape), e.dtype) for e in entries)
    return found[0] if container == _TENSOR else found


def declared_entries(declared: DeclaredValue | None) -> list[Declared | None]:
    """The per-entry payloads ``declared`` announces (one for a single tensor)."""
    if declared is None:
        return []
    return [declared] if isinstance(declared, Declared) else list(declared)
