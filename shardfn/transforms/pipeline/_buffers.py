"""Packed message buffers a pipeline model keeps from one step to the next.

Example:
    >>> pool = MessageBuffers()
    >>> a = pool.get("recv", ("act", 0, 0), 1, 64, torch.device("cpu"))
    >>> a is pool.get("recv", ("act", 0, 0), 1, 64, torch.device("cpu"))
    True
"""

from __future__ import annotations

import torch

__all__ = ["POOLED_KINDS", "MessageBuffers"]

Key = tuple  # ("act" | "grad" | ..., stage, microbatch)

#: message kinds whose values are used up within the call (a stage's input, an output
#: gradient), so their packed buffers can be kept for the next call
POOLED_KINDS = ("act", "grad")


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
        >>> pool = MessageBuffers()
        >>> a = pool.get("recv", ("act", 0, 0), 1, 64, torch.device("cpu"))
        >>> a is pool.get("recv", ("act", 0, 0), 1, 64, torch.device("cpu"))
        True
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, direction: str, key: Key, peer: int, nbytes: int,
            device: torch.device) -> torch.Tensor:
        """The kept uint8 buffer of ``nbytes`` for this message (made on first use)."""
        slot = (direction, key, peer, nbytes, device)
        buffer = self.buffers.get(slot)
        if buffer is None:
            buffer = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer

    def unalias(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` with a copy of each one whose memory is a kept buffer's (a gradient
        autograd passed through unchanged from a received one, say)."""
        kept = {b.untyped_storage().data_ptr() for b in self.buffers.values()}
        return {n: t.clone() if isinstance(t, torch.Tensor) and
                t.untyped_storage().data_ptr() in kept else t for n, t in tensors.items()}

    def clear(self) -> None:
        """Drop every kept buffer (after a failed call: nothing of it is reused)."""
        self.buffers.clear()

    def __len__(self) -> int:
        return len(self.buffers)
