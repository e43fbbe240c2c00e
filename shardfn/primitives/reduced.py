"""What a gradient tensor already is over the mesh: which axes it is sharded and reduced over.

`shard_params` averages every gradient over its axis in backward and hands back this
rank's *shard* of the mean. Such a tree is two things a plain tree of tensors does not
say: **reduced** over the axis (averaging it again, ``sf.data_parallel(...).reduce_grads``
or ``sf.shard_opt_state(...).update``, mixes different ranks' shards) and **sharded**
over it (a norm, a checkpoint or a comparison that takes the local tensor for the whole
one sees one rank's rows only). Both mistakes give a wrong number without an error.

The transform that produces such values records, per tensor, a :class:`ValueKind`
(:func:`mark_reduced`); the consumers look each leaf up and refuse what contradicts it:

* a reduction over an axis the value is already reduced over
  (:func:`check_not_reduced`: ``data_parallel``, ``shard_opt_state``);
* a layout that does not name an axis the value is sharded over
  (:func:`check_layouts`: ``clip_by_global_norm`` / ``global_norm`` / ``clip_grads``
  without ``specs=model.specs``, ``sf.checkpoint.save`` with a replicated layout,
  ``sf.testing.gather_with`` with a spec that does not gather it).

The mark is the tensor's storage, held by a weak reference: ``torch.func.grad``,
``torch.autograd.grad`` and ``.grad`` accumulation all hand back the very tensor the
backward returned (or accumulate into it in place), so the mark survives each of them
(a view such as ``g[1:]`` shares it) and is dropped when the gradient is freed. A new
tensor computed from a marked one (``g * 2``, ``g.clone()``, an unscaled or clipped
tree, ``torch.cat``) is **not** marked: the checks catch the direct mistake, not every
derived value. ``sf.accumulate_grads`` carries the marks to its mean
(:func:`carry_marks`).

Cost: nothing while no tensor is marked (a process that never ran `shard_params`);
otherwise one storage look-up per leaf (see docs/correctness.md, "Round 3").

Example:
    >>> mark_reduced(shard_grads.values(), plan.all_ax, "sf.shard_params", sharded=plan.ax)
    >>> check_not_reduced("data_parallel.reduce_grads", leaves, names, ax)   # raises
    >>> check_layouts("clip_by_global_norm", leaves, [()] * len(leaves), names,
    ...               "pass specs=model.specs")                              # raises
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from shardfn._torch_internals import unwrap_functorch
from shardfn.primitives import _compiled
from shardfn.primitives._comm import Axis

__all__ = ["GIVE_LAYOUT", "ReducedOver", "ValueKind", "carry_marks", "check_layouts",
           "check_not_reduced", "mark_held", "mark_reduced", "marks_of", "missing_axes", "overlaps",
           "reduced_over", "value_kind"]


class ValueKind(NamedTuple):
    """What a marked tensor is: the mesh axes it is reduced over and those it is a shard over.

    Attributes:
        reduced: the axes (names) its values are summed or averaged over already.
        ranks: the global ranks of that reduction's group.
        by: what produced it, for messages (``"sf.shard_params"``).
        sharded: the axes it is this rank's shard over (``()``: the whole tensor, the
            same on every rank of ``reduced``); None: a shard over some of ``reduced``,
            not said which (``mark_reduced``'s default for a tensor of one dim or more).
    """

    reduced: tuple[str, ...]
    ranks: frozenset[int]
    by: str
    sharded: tuple[str, ...] | None = None
    fix: str = ""  # what to do instead, when the producer knows better than the consumer


#: The name before issue #23 (a gradient reduced over an axis); the same record.
ReducedOver = ValueKind

_LOCK = threading.Lock()
# storage address -> (weak reference keeping the address from being reused, kind)
_MARKS: dict[int, tuple[StorageWeakRef, ValueKind]] = {}
_prune_above = 256


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (under any functorch wrapper), or None without one."""
    try:
        return unwrap_functorch(t).untyped_storage()._cdata
    except (NotImplementedError, RuntimeError, TypeError, AttributeError):
        return None  # sparse, meta subclasses, wrappers without storage: never marked


def mark_reduced(tensors: Iterable[torch.Tensor], ax: Axis, by: str, *,
                 sharded: Axis | Sequence[str] | None = None) -> None:
    """Record that ``tensors`` hold values reduced (summed or averaged) over ``ax``.

    Args:
        tensors: the reduced gradients (their storages are marked while they live).
        ax: the axis (or product of axes) they were reduced over.
        by: what reduced them, for the error message (e.g. ``"sf.shard_params"``).
        sharded: the axes each tensor is this rank's shard over (an ``Axis`` or names;
            ``()``: not sharded). None, the default, keeps ``shard_params``' meaning:
            a 0-dim tensor is not sharded, any other is a shard over (some of) ``ax``
            (its shard axis, and with HSDP not its replica axis: say ``sharded=plan.ax``
            to be exact).

    Example:
        >>> mark_reduced(out.values(), plan.all_ax, "sf.shard_params", sharded=plan.ax)
    """
    names = sharded.names if isinstance(sharded, Axis) else (
        None if sharded is None else tuple(sharded))
    whole = ValueKind(ax.names, frozenset(ax.ranks), by, ())
    kind = ValueKind(ax.names, frozenset(ax.ranks), by, names)
    for t in tensors:
        _mark(t, whole if names is None and t.dim() == 0 else kind)


def mark_held(tensors: Iterable[torch.Tensor], axis: str, by: str, fix: str) -> None:
    """Record that ``tensors`` are leaves only this rank's position on ``axis`` holds (a
    pipeline stage's gradients: the other pp ranks hold other leaves), on top of any mark
    they carry (a ``shard_params`` stage's shards stay shards over its axis too).

    Args:
        tensors: the gradients.
        axis: the mesh axis whose ranks hold different leaves (``"pp"``).
        by: what produced them (``"sf.pipeline_stages"``).
        fix: what a consumer that takes them for the whole tree should do instead.

    Example:
        >>> mark_held(grads.values(), "pp", "sf.pipeline_stages", "clip under sharded_over")
    """
    for t in tensors:
        kind = value_kind(t)
        if kind is None:
            _mark(t, ValueKind((), frozenset(), by, (axis,), fix))
        else:
            held = kind.sharded if kind.sharded is not None else kind.reduced
            _mark(t, kind._replace(sharded=(*held, axis), fix=fix))


def _mark(t: torch.Tensor, kind: ValueKind) -> None:
    global _prune_above
    try:
        storage = unwrap_functorch(t).untyped_storage()
    except (NotImplementedError, RuntimeError, TypeError, AttributeError):
        return  # no storage to mark (see _storage_key)
    with _LOCK:
        _MARKS[storage._cdata] = (StorageWeakRef(storage), kind)
        if len(_MARKS) > _prune_above:  # drop the freed ones (amortised: the bound doubles)
            for key in [k for k, (ref, _) in _MARKS.items() if ref.expired()]:
                del _MARKS[key]
            _prune_above = max(256, 2 * len(_MARKS))


def marks_of(tensors: Iterable[object]) -> list[ValueKind | None]:
    """The kind of each of ``tensors`` (None where unmarked or not a tensor); ``[]`` while
    nothing is marked."""
    if not _MARKS:
        return []
    return [value_kind(t) if isinstance(t, torch.Tensor) else None for t in tensors]


def carry_marks(marks: Sequence[ValueKind | None], outs: Sequence[object]) -> None:
    """Mark each of ``outs`` with the kind at its position (from :func:`marks_of`): a sum
    or mean over micro-batches of shards reduced over an axis is such a shard too."""
    for kind, out in zip(marks, outs, strict=False):
        if kind is not None and isinstance(out, torch.Tensor):
            _mark(out, kind)


def value_kind(t: torch.Tensor) -> ValueKind | None:
    """What ``t``'s storage was marked as, or None."""
    if not _MARKS:
        return None
    key = _storage_key(t)
    # no lock: readers never mutate, and a marked address is not reused while its weak
    # reference is held (a stale entry of a freed storage matches no live tensor)
    entry = _MARKS.get(key) if key is not None else None
    return None if entry is None else entry[1]


#: The name before issue #23.
reduced_over = value_kind


def overlaps(kind: ValueKind, ax: Axis) -> bool:
    """Whether reducing over ``ax`` mixes ranks ``kind`` already reduced over (two axes of
    size 1 overlap when they share a name: the same mistake, caught at every size)."""
    common = kind.ranks & frozenset(ax.ranks)
    if len(common) > 1:
        return True
    return len(kind.ranks) == 1 and ax.size == 1 and bool(set(kind.reduced) & set(ax.names))


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

    Not checked in code that ``torch.compile`` traces (the marks are Python-side state
    on eager tensors): the refusal is an eager check.
    """
    if _compiled.tracing() or not _MARKS:
        return
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        kind = value_kind(leaf)
        if kind is None or not overlaps(kind, ax):
            continue
        done = "+".join(kind.reduced)
        raise ValueError(
            f"{what}: gradient leaf {names()[i]!r} is already reduced over axis {done!r} "
            f"(it is a shard of the averaged gradient that {kind.by} returns: its backward "
            f"reduce-scatters over its axis); reducing it again over axis {ax.key!r} would "
            f"average different ranks' shards together. Use {kind.by}'s gradients directly "
            f"(they are the mean over {done!r} already, e.g. with sf.optim on the shards); "
            f"reduce only over axes it does not cover (such as a replica axis it was not given)"
        )


def missing_axes(kind: ValueKind, axes: Iterable[str]) -> tuple[str, ...]:
    """The axes ``kind`` is a shard over that a layout naming ``axes`` leaves out (``()``:
    the layout fits; an unsaid ``sharded`` needs at least one of ``kind.reduced``)."""
    axes = set(axes)
    if kind.sharded is None:
        return () if axes & set(kind.reduced) else kind.reduced
    return tuple(a for a in kind.sharded if a not in axes)


#: What :func:`check_layouts` tells to do by default.
GIVE_LAYOUT = ("Give it the layout of the model that made it: model.specs (sf.checkpoint: "
               "layouts=model or model.specs; sf.gather and sf.testing.gather_with: model.specs).")


def check_layouts(what: str, leaves: Sequence[object], axes: Sequence[Iterable[str]],
                  names: Callable[[], Sequence[str]], fix: str = GIVE_LAYOUT) -> None:
    """Refuse a leaf handled as sharded over ``axes`` that is a shard over another axis too.

    A tensor marked as this rank's shard over mesh axis ``dp`` (``shard_params``'
    gradients) read as a whole tensor (a norm without specs, a replicated checkpoint
    entry, a gather that does not gather it) stands for one rank's rows only: a wrong
    number, silently. Checked at every axis size (on one rank the values would be right
    by accident; the same code on two is wrong).

    Args:
        what: the consumer, for the message (``"clip_by_global_norm"``).
        leaves: the tensors (other leaves are skipped).
        axes: per leaf, the mesh axes its layout names (``()``: replicated).
        names: returns the leaves' paths (called only to build the message).
        fix: what to do instead (default :data:`GIVE_LAYOUT`).

    Raises:
        ValueError: naming the first such leaf, the axes its layout leaves out, what
            produced it and ``fix``.
    """
    if not _MARKS:
        return
    for i, (leaf, leaf_axes) in enumerate(zip(leaves, axes, strict=True)):
        kind = value_kind(leaf) if isinstance(leaf, torch.Tensor) else None
        if kind is None:
            continue
        leaf_axes = tuple(leaf_axes)
        missing = missing_axes(kind, leaf_axes)
        if not missing:
            continue
        over = "+".join(missing)
        part = " (or part of it)" if kind.sharded is None and len(missing) > 1 else ""
        said = f"a layout over {leaf_axes}" if leaf_axes else "a replicated layout (no axes)"
        raise ValueError(
            f"{what}: leaf {names()[i]!r} is this rank's shard over mesh axis {over!r}{part} "
            f"(a gradient shard that {kind.by} returns), but it is handled with {said}, "
            f"which does not name {over!r}: each rank would take its own shard for the whole "
            f"tensor. {kind.fix or fix}")
