"""Which gradient tensors are already reduced over which mesh axis.

`shard_params` averages every gradient over its axis in backward and hands back this
rank's *shard* of the mean. Averaging such a tree again over the same axis
(``sf.data_parallel(...).reduce_grads``, ``sf.shard_opt_state(...).update``) mixes
different ranks' shards and gives a wrong number without an error. The transform
that produced the reduced gradients marks their storages here (:func:`mark_reduced`);
the gradient reductions look each leaf up before they reduce (:func:`check_not_reduced`)
and refuse a leaf already reduced over an overlapping axis.

The mark is the tensor's storage, held by a weak reference: ``torch.func.grad``,
``torch.autograd.grad`` and ``.grad`` accumulation all hand back the very tensor the
backward returned (or accumulate into it in place), so the mark survives each of them
and is dropped when the gradient is freed. A new tensor computed from a marked one
(``g * 2``, a clipped tree) is not marked: the check catches the direct mistake, not
every derived value.

Cost: nothing while no tensor is marked (a process that never ran `shard_params`);
otherwise one storage look-up per leaf (about a microsecond).

Example:
    >>> mark_reduced(shard_grads.values(), plan.all_ax)             # in shard_params' backward
    >>> check_not_reduced("data_parallel.reduce_grads", leaves, names, ax)   # raises
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from shardfn._torch_internals import unwrap_functorch
from shardfn.primitives._comm import Axis

__all__ = ["ReducedOver", "carry_marks", "check_not_reduced", "mark_reduced", "marks_of",
           "overlaps", "reduced_over"]


class ReducedOver(NamedTuple):
    """The axis a marked gradient was reduced over, and by what."""

    names: tuple[str, ...]
    ranks: frozenset[int]
    by: str


_LOCK = threading.Lock()
# storage address -> (weak reference keeping the address from being reused, axis)
_MARKS: dict[int, tuple[StorageWeakRef, ReducedOver]] = {}
_prune_above = 256


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (under any functorch wrapper), or None without one."""
    try:
        return unwrap_functorch(t).untyped_storage()._cdata
    except (NotImplementedError, RuntimeError, TypeError, AttributeError):
        return None  # sparse, meta subclasses, wrappers without storage: never marked


def mark_reduced(tensors: Iterable[torch.Tensor], ax: Axis, by: str) -> None:
    """Record that ``tensors`` hold values already reduced (summed or averaged) over ``ax``.

    Args:
        tensors: the reduced gradients (their storages are marked while they live).
        ax: the axis (or product of axes) they were reduced over.
        by: what reduced them, for the error message (e.g. ``"sf.shard_params"``).
    """
    over = ReducedOver(ax.names, frozenset(ax.ranks), by)
    for t in tensors:
        _mark(t, over)


def _mark(t: torch.Tensor, over: ReducedOver) -> None:
    global _prune_above
    try:
        storage = unwrap_functorch(t).untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError, AttributeError):
        return  # no storage to mark (see _storage_key)
    with _LOCK:
        _MARKS[storage._cdata] = (StorageWeakRef(storage), over)
        if len(_MARKS) > _prune_above:  # drop the freed ones (amortised: the bound doubles)
            for key in [k for k, (ref, _) in _MARKS.items() if ref.expired()]:
                del _MARKS[key]
            _prune_above = max(256, 2 * len(_MARKS))


def marks_of(tensors: Iterable[object]) -> list[ReducedOver | None]:
    """The mark of each of ``tensors`` (None where unmarked or not a tensor)."""
    if not _MARKS:
        return []
    return [reduced_over(t) if isinstance(t, torch.Tensor) else None for t in tensors]


def carry_marks(marks: Sequence[ReducedOver | None], outs: Sequence[object]) -> None:
    """Mark each of ``outs`` with the mark at its position (from :func:`marks_of`): a sum
    or mean over micro-batches of gradients reduced over an axis is reduced over it too."""
    for over, out in zip(marks, outs, strict=False):
        if over is not None and isinstance(out, torch.Tensor):
            _mark(out, over)


def reduced_over(t: torch.Tensor) -> ReducedOver | None:
    """The axis ``t``'s storage was marked as reduced over, or None."""
    if not _MARKS:
        return None
    key = _storage_key(t)
    # no lock: readers never mutate, and a marked address is not reused while its weak
    # reference is held (a stale entry of a freed storage matches no live tensor)
    entry = _MARKS.get(key) if key is not None else None
    return None if entry is None else entry[1]


def overlaps(over: ReducedOver, ax: Axis) -> bool:
    """Whether reducing over ``ax`` mixes ranks ``over`` already reduced over (two axes of
    size 1 overlap when they share a name: the same mistake, caught at every size)."""
    common = over.ranks & frozenset(ax.ranks)
    if len(common) > 1:
        return True
    return len(over.ranks) == 1 and ax.size == 1 and bool(set(over.names) & set(ax.names))


def check_not_reduced(what: str, leaves: Sequence[object], names: Callable[[], Sequence[str]],
                      ax: Axis) -> None:
    """Refuse to reduce over ``ax`` a leaf already reduced over an overlapping axis.

    Args:
        what: the reduction, for the message (``"data_parallel.reduce_grads"``).
        leaves: the gradient leaves about to be reduced.
        names: returns the leaves' paths (called only to build the message).
        ax: the axis about to be reduced over.

    Raises:
        ValueError: naming the first such leaf, both axes and what to do instead.
    """
    if not _MARKS:
        return
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        over = reduced_over(leaf)
        if over is None or not overlaps(over, ax):
            continue
        done = "+".join(over.names)
        raise ValueError(
            f"{what}: gradient leaf {names()[i]!r} is already reduced over axis {done!r} "
            f"(it is a shard of the averaged gradient that {over.by} returns: its backward "
            f"reduce-scatters over its axis); reducing it again over axis {ax.key!r} would "
            f"average different ranks' shards together. Use {over.by}'s gradients directly "
            f"(they are the mean over {done!r} already, e.g. with sf.optim on the shards); "
            f"reduce only over axes it does not cover (such as a replica axis it was not given)"
        )
