"""The staging copy of an async save, into CPU buffers kept for the next async save.

An async save must copy the state before it returns (the caller may change or
donate its tensors right after). The copy goes into one CPU buffer per tensor
leaf; the buffers are kept, and the next async save whose tensors have the
same shapes and dtypes copies into them again: its blocking part is then a
copy into memory already allocated and touched, with no allocation (a fresh
copy, ``x.to("cpu", copy=True)``, also pays for allocating and first touching
its memory). The buffers are free to reuse then: every save first waits for
the pending one (:func:`~shardfn.checkpoint.save.wait_pending`). They hold one
copy of the local state in CPU memory between saves; :func:`release_staging`
frees them.

Example:
    >>> copy = snapshot(state)       # values at the call, in (reused) CPU buffers
    >>> release_staging()            # give the memory back
"""

from __future__ import annotations

import torch

from shardfn import pytree

__all__ = ["release_staging", "snapshot"]

_KEPT: list[tuple[tuple, list[torch.Tensor]]] = []  # [(signature, buffers)], at most one


def snapshot(state):
    """``state`` with each tensor replaced by a CPU copy of its value now (objects kept).

    The copies are the kept buffers when the tensors' shapes and dtypes are those of the
    last call; otherwise new buffers, kept instead. Only call it when no save is pending.
    """
    leaves, treedef = pytree.tree_flatten(state)
    tensors = [x.detach() for x in leaves if isinstance(x, torch.Tensor)]
    signature = tuple((tuple(x.shape), x.dtype) for x in tensors)
    if not _KEPT or _KEPT[0][0] != signature:
        _KEPT.clear()  # the old buffers go first
        _KEPT.append((signature, [torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda)
                                  for x in tensors]))
    buffers = _KEPT[0][1]
    on_cpu = [i for i, x in enumerate(tensors) if x.device.type == "cpu"]
    if on_cpu:  # one call for all CPU tensors; others (GPU) copy one by one
        torch._foreach_copy_([buffers[i] for i in on_cpu], [tensors[i] for i in on_cpu])
    for buffer, x in zip(buffers, tensors, strict=True):
        if x.device.type != "cpu":
            buffer.copy_(x)
    copies = iter(buffers)
    return pytree.tree_unflatten(treedef, [next(copies) if isinstance(x, torch.Tensor) else x
                                           for x in leaves])


def release_staging() -> None:
    """Free the CPU buffers kept for the next async save's staging copy.

    Example:
        >>> sf.checkpoint.release_staging()
    """
    _KEPT.clear()
