"""Packed message buffers a pipeline model keeps from one step to the next.

Example:
    >>> from types import SimpleNamespace
    >>> pool = MessageBuffers()
    >>> make = lambda: SimpleNamespace(buffer=torch.empty(64, dtype=torch.uint8))
    >>> a = pool.get(("recv", ("act", 0, 0), 1), make)
    >>> a is pool.get(("recv", ("act", 0, 0), 1), make)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardfn.transforms.pipeline.kinds import MessageKind

__all__ = ["POOLED_KINDS", "MessageBuffers"]

#: message kinds whose values are used up within the call (a stage's input, an output
#: gradient), so their packed buffers can be kept for the next call
POOLED_KINDS = (MessageKind.ACT, MessageKind.GRAD)


class MessageBuffers:
    """Packed message buffers kept from one pipeline call to the next, as torch's
    ``PipelineStage`` keeps its receive buffers: the same message of the next call
    (same key, peer and size) reuses its buffer instead of touching fresh memory.

    Only activations and output gradients are kept (:data:`POOLED_KINDS`): their
    values are used up within the call (a stage input's graph is freed by the step's
    last backward, a gradient is consumed by it). A call's sends are all waited, and
    its receives all done, before it returns, so the next call never writes a buffer
    still in flight. A step returns nothing that aliases a kept buffer
    (:meth:`unalias`). After a failed call the buffers are dropped (:meth:`clear`).

    Example:
        >>> from types import SimpleNamespace
        >>> pool = MessageBuffers()
        >>> make = lambda: SimpleNamespace(buffer=torch.empty(64, dtype=torch.uint8))
        >>> slot = ("send", ("grad", 1, 0), 0)
        >>> pool.get(slot, make) is pool.get(slot, make)
        True
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, Any] = {}

    def get(self, slot: tuple, make: Callable[[], Any]) -> Any:
        """The kept buffer of message ``slot`` (direction, key, peer, payloads, device),
        made by ``make()`` on first use (an object with a uint8 ``.buffer``)."""
        found = self.buffers.get(slot)
        if found is None:
            found = self.buffers[slot] = make()
        return found

    def unalias(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` with a copy of each one whose memory is a kept buffer's (a gradient
        autograd passed through unchanged from a received one, say)."""
        kept = {b.buffer.untyped_storage().data_ptr() for b in self.buffers.values()}
        return {n: t.clone() if isinstance(t, torch.Tensor) and
                t.untyped_storage().data_ptr() in kept else t for n, t in tensors.items()}

    def clear(self) -> None:
        """Drop every kept buffer (after a failed call: nothing of it is reused)."""
        self.buffers.clear()

    def __len__(self) -> int:
        return len(self.buffers)
