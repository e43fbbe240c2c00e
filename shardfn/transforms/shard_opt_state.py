"""`shard_opt_state`: ZeRO-1 / ZeRO-2 (FairScale OSS + ShardedDataParallel) as a wrapper.

``shard_opt_state(opt, mesh, axis="dp")`` turns any :class:`GradientTransformation`
into one whose state covers only this rank's part of the parameters:

1. ``update`` takes each rank's *local* gradient (the gradient of the loss on
   its own micro-batch, not yet averaged) and **reduce-scatters** it over
   ``axis`` in buckets, so each rank receives the averaged gradient of just the
   part it owns (see :mod:`shardfn.primitives.flat`: buckets are split evenly,
   so ranks are balanced to within padding, even when one tensor is larger than
   all others together). The messages are read straight from the gradient
   tensors: no flat copy of the tree is made.
2. The wrapped optimizer updates that part. It sees a tree of the usual
   structure whose leaves are the 1-D pieces this rank owns; its callable masks
   and labels are called with the full parameters (so ``p.ndim >= 2`` selects
   as unsharded); ``clip_by_global_norm`` inside it is told that every leaf is
   sharded over ``axis`` and computes the exact global norm. It may write its
   updates into those pieces (they are the wrapper's own buffers).
   ``sf.optim.chain``/``masked``/``multi_transform`` over a ShardedOptimizer
   move inside it: ``chain(clip, shard_opt_state(opt))`` is
   ``shard_opt_state(chain(clip, opt))``.
3. The updates are **all-gathered** straight into full-size update tensors
   (new ones; with ``donate=True`` the gradient tensors passed in), so every
   rank returns the full updates for ``apply_updates``, exactly as the
   unsharded optimizer would.

ZeRO-1 versus ZeRO-2. In a pure step (``torch.func.grad`` returns the whole
local gradient tree) both are the same: the same two collectives, and a rank
never holds the full *reduced* gradient. For autograd steps, ``overlap(params)``
hooks every parameter: each bucket is reduce-scattered as soon as backward has
produced its gradients, while backward goes on, and
``update(sync.grads(), state, params)`` then skips the reduction. With
``shard_grads=True`` (ZeRO-2, FairScale ShardedDataParallel) every ``.grad``
is freed once its buckets are reduced (a ``.grad`` is the send buffer of its
buckets, so it lives until they arrive: at most the last two buckets' worth
during backward), so a rank keeps only its reduced gradient part, ``1/N``.
Without it (ZeRO-1, FairScale OSS) the ``.grad`` fields stay as autograd wrote
them.

Donation (``donate=True``): ``update``'s ``grads`` and ``state`` are dead after
the call; the wrapped optimizer updates its state in place (as
``sf.optim.donating`` does) and the full updates are written into the gradient
tensors. Pair it with ``apply_updates(..., donate=True)``: then a step
allocates nothing of the size of the model.

Memory per rank: optimizer state ``K * T / N`` for an optimizer with ``K``
state tensors per parameter (Adam: ``K = 2``), plus padding.
Communication per step: reduce-scatter + all-gather = ``2 Psi (N-1)/N`` bytes
(``Psi`` = parameter bytes), the same as one all-reduce.

Example:
    >>> opt = sf.shard_opt_state(sf.optim.adamw(1e-3), mesh, axis="dp")
    >>> state = opt.init(params)
    >>> grads = torch.func.grad(loss)(params, local_batch)   # no pmean needed
    >>> updates, state = opt.update(grads, state, params)
    >>> params = sf.optim.apply_updates(params, updates)

    ZeRO-2 with autograd (``params`` are leaf tensors that require grad):

    >>> opt = sf.shard_opt_state(sf.optim.adamw(1e-3), mesh, "dp", shard_grads=True,
    ...                          donate=True)
    >>> with opt.overlap(params) as sync:
    ...     loss_fn(params, local_batch).backward()
    >>> updates, state = opt.update(sync.grads(), state, params)
    >>> sf.optim.apply_updates(params, updates, donate=True)     # in place
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shardfn import pytree
from shardfn._torch_internals import assert_async
from shardfn.mesh import AxisName, Mesh, get_mesh
from shardfn.optim._compose import is_sharded, wants_full_leaves
from shardfn.optim._tree import full_tree
from shardfn.optim.base import GradientTransformation
from shardfn.optim.clipping import sharded_over
from shardfn.optim.donation import donated
from shardfn.primitives import _comm, consistency
from shardfn.primitives._compiled import tracing
from shardfn.primitives.buckets import DEFAULT_BUCKET_BYTES
from shardfn.primitives.flat import FlatPartition, weight_share
from shardfn.primitives.reduced import check_not_reduced
from shardfn.transforms._opt_state_exchange import (
    ReducedGrads,
    ZeroOverlap,
    all_gather_updates,
    reduce_scatter_grads,
)
from shardfn.transforms._opt_state_reshard import reshard_state
from shardfn.transforms.precision import Precision

__all__ = ["ReducedGrads", "ShardedOptState", "ShardedOptimizer", "shard_opt_state"]

_all_gather = all_gather_updates  # the name benchmarks/bench_dp.py times alone


class ShardedOptState(NamedTuple):
    """State of a sharded optimizer.

    Attributes:
        inner: the wrapped optimizer's state over this rank's part of the parameters.
        partition: int64 ``[axis size, axis index, total elements, tree fingerprint]``:
            which partition ``inner`` belongs to (checked on every update).
    """

    inner: Any
    partition: torch.Tensor


class ShardedOptimizer(NamedTuple):
    """A :class:`GradientTransformation` with ZeRO partitioning, plus state conversions.

    Attributes:
        init: ``init(params) -> ShardedOptState``.
        update: ``update(local_grads, state, params, *, weight=None, **inner_kwargs) ->
            (full updates, state)``; ``weight``: this rank's number of examples, for an
            exact weighted mean over unequal per-rank batches (see ``reduce_grads``);
            other keywords go to the wrapped optimizer's ``update``.
        gather_state: ``gather_state(state, params)`` -> the full, unsharded inner state
            (identical on every rank), e.g. to inspect or save it.
        shard_state: ``shard_state(full_inner_state, params)`` -> this rank's
            ``ShardedOptState``, e.g. to load a state saved at another world size.
        reduce_grads: ``reduce_grads(local_grads, params, *, weight=None)`` -> this rank's
            averaged gradient part (a tree of 1-D pieces). Without ``weight`` the mean of
            the per-rank gradients (the full-batch gradient only for equal per-rank
            batches); with it ``sum_r w_r g_r / sum_r w_r``. fp16/bf16 gradients are
            divided before and after the sum (FSDP2's factors); integer leaves are not
            reduced (zeros).
        partition: ``partition(params) -> FlatPartition``.
        overlap: ``overlap(params, *, weight=None)``: a context manager whose hooks
            reduce-scatter
            gradients during ``backward()``; its ``grads()`` returns the
            :class:`ReducedGrads`. With ``shard_grads=True`` (ZeRO-2) it frees every
            ``.grad`` once its buckets are reduced; otherwise (ZeRO-1) ``.grad`` stays.
        all_finite: ``all_finite(grads) -> bool``: whether every rank's gradients over the
            axis are finite (the same answer on every rank); ``skip_nonfinite`` wrapped
            around this optimizer uses it as its default check.
        inner: the wrapped optimizer (``opt``), e.g. for checkpoint layouts.
        axes: the mesh axis names it shards over.
        sharding: a comparable record of its mesh, axes and options (two sharded
            optimizers compose only when theirs are equal).
        rewrap: ``rewrap(other_opt)`` -> ``shard_opt_state(other_opt, ...)`` with this
            one's mesh, axes and options; ``chain``, ``masked`` and ``multi_transform``
            over a ShardedOptimizer use it to shard the whole composition
            (``chain(clip, shard_opt_state(opt))`` is ``shard_opt_state(chain(clip, opt))``).
    """

    init: Callable
    update: Callable
    gather_state: Callable
    shard_state: Callable
    reduce_grads: Callable
    partition: Callable
    overlap: Callable
    all_finite: Callable | None = None
    inner: GradientTransformation | None = None
    axes: tuple[str, ...] = ()
    sharding: tuple = ()
    rewrap: Callable | None = None


def shard_opt_state(opt: GradientTransformation, mesh: Mesh, axis: AxisName = "dp", *,
                    shard_grads: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    average: bool = True, precision: Precision | None = None,
                    donate: bool = False) -> ShardedOptimizer:
    """Shard ``opt``'s state (and the gradient reduction) over ``axis`` (ZeRO-1/2).

    Args:
        opt: any pure optimizer from :mod:`shardfn.optim`.
        mesh: the mesh.
        axis: the data-parallel axis (or tuple of axes) to shard over.
        shard_grads: ZeRO-2: ``overlap`` frees every ``.grad`` once its buckets are
            reduced (see module doc); nothing changes in a pure step.
        bucket_bytes: bytes per reduce-scatter / all-gather bucket (over all ranks).
        average: divide the summed gradients by the axis size (data-parallel mean).
        precision: its ``reduce_dtype`` (if set) is the dtype gradients are
            reduce-scattered in; the optimizer gets them in the parameters' dtype.
        donate: ``update``'s ``grads`` and ``state`` are dead after the call: the
            wrapped optimizer updates its state in place and the full updates are
            written into the gradient tensors (returned as the updates). Without it
            neither is touched. Bitwise the same results either way.

    Returns:
        A :class:`ShardedOptimizer`; its ``init``/``update`` replace ``opt``'s.

    Raises:
        TypeError: if ``opt`` is not an optimizer.
        ValueError: for ``opt`` already sharded over one of the same axes (it would shard
            twice), or sharded over other axes with other options.

    ``opt`` may itself be a ShardedOptimizer over *other* axes with the same options:
    ``shard_opt_state(shard_opt_state(opt, mesh, "b"), mesh, "a")`` is
    ``shard_opt_state(opt, mesh, ("a", "b"))``. ``sf.optim.chain``, ``masked`` and
    ``multi_transform`` over a ShardedOptimizer shard the whole composition (see
    docs/optim.md).

    Example:
        >>> opt = sf.shard_opt_state(sf.optim.adam(1e-3), mesh, "dp", shard_grads=True)
        >>> opt = sf.optim.chain(sf.optim.clip_by_global_norm(1.0), opt)  # clip on the pieces
    """
    ax = _comm.resolve(axis, mesh)
    mesh = get_mesh(mesh)  # the current one for None: rewrap keeps it
    options = dict(shard_grads=shard_grads, bucket_bytes=bucket_bytes, average=average,
                   precision=precision, donate=donate)
    sharding = (mesh, ax.names, tuple(options.items()))
    if is_sharded(opt):
        return _nested(opt, mesh, axis, ax.names, sharding, options)
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"shard_opt_state expects a GradientTransformation (sf.optim.*), got "
                        f"{type(opt).__name__}")
    if wants_full_leaves(opt):
        raise ValueError(f"shard_opt_state over {axis!r}: the optimizer needs whole leaves "
                         "(marked by needs_full_leaves) but would see this rank's 1-D pieces; "
                         "leave it unsharded (or shard its state another way)")
    reduce_dtype = precision.reduce_dtype if precision is not None else None
    partitions: dict = {}
    fingerprints: dict[int, int] = {}  # id(partition) -> its tree fingerprint
    planned: list[FlatPartition] = []

    def partition(params) -> FlatPartition:
        if tracing():
            return _traced_partition(planned, params)
        leaves, treedef = pytree.tree_flatten(params)
        key = (treedef, tuple(tuple(x.shape) for x in leaves),
               leaves[0].dtype if leaves else None)
        if key not in partitions:
            itemsize = leaves[0].element_size() if leaves else 4
            if len(partitions) > 16:
                partitions.clear()
                planned.clear()
                fingerprints.clear()
            part = FlatPartition.of(params, ax.size, ax.index, max(1, bucket_bytes // itemsize))
            fingerprints[id(part)] = _fingerprint(part)  # hashlib: not in traced code
            part.plans, part.local_sizes, part.local_slots  # noqa: B018 - cached now, eagerly
            partitions[key] = part
            planned.append(part)  # what traced code searches (a treedef's hash is untraceable)
        return partitions[key]

    def record(part: FlatPartition) -> torch.Tensor:
        return torch.tensor([ax.size, ax.index, part.total, fingerprints[id(part)]],
                            dtype=torch.int64)

    def init(params) -> ShardedOptState:
        part = partition(params)
        _check_same_tree_on_all_ranks(part, ax)  # first: names the leaf whose shape differs
        consistency.check_replicated("shard_opt_state.init params", ax, params)
        with full_tree(params):
            return ShardedOptState(opt.init(part.local(params)), record(part))

    def local_grad_leaves(grads, params, part: FlatPartition, weight) -> list[torch.Tensor]:
        pytree.tree_map(lambda g, p: None, grads, params)  # structure check, names leaves
        param_leaves, grad_leaves = pytree.tree_leaves(params), pytree.tree_leaves(grads)
        check_not_reduced("shard_opt_state", grad_leaves, lambda: pytree.tree_paths(grads), ax)
        part._check(grad_leaves)
        share = None
        if weight is not None and tracing():
            raise ValueError("shard_opt_state: update(weight=...) is eager-only (its share is a "
                             "Python number); in a compiled step scale the loss by the share")
        if weight is not None:
            if not average:
                raise ValueError("shard_opt_state: weight= gives a weighted mean; it needs "
                                 "average=True")
            share = weight_share(weight, ax, param_leaves[0].device if param_leaves
                                 else torch.device("cpu"))
        return reduce_scatter_grads(part, grad_leaves, param_leaves, ax, average, reduce_dtype,
                                    share)

    def reduce_grads(grads, params, *, weight: float | torch.Tensor | None = None):
        part = partition(params)
        return pytree.tree_unflatten(_structure(part, params),
                                     local_grad_leaves(grads, params, part, weight))

    @torch.no_grad()  # not differentiable (plain torch.distributed); params may be leaves
    def update(grads, state: ShardedOptState, params, *,
               weight: float | torch.Tensor | None = None, **inner_kwargs):
        if params is None:
            raise ValueError("shard_opt_state's update needs params (to lay out the partition)")
        reduced = isinstance(grads, ReducedGrads)
        # already reduced pieces differ in shape between ranks: compare the params' tree then
        consistency.check_call("shard_opt_state.update", ax, params if reduced else grads,
                               reduced=reduced, weighted=weight is not None)
        part = partition(params)
        treedef = _structure(part, params)
        _check_partition(state, record(part))
        if reduced:
            if weight is not None:
                raise ValueError("shard_opt_state: these gradients were reduced by overlap(); "
                                 "pass weight= to overlap(params, weight=...) instead")
            local_grads, ours = grads.local, False
        else:
            local_grads = pytree.tree_unflatten(
                treedef, local_grad_leaves(grads, params, part, weight))
            ours = True
        # the local gradients made here are ours to overwrite; the state only if donated
        with sharded_over(axis, mesh), donated(updates=ours or donate, state=donate), \
                full_tree(params):
            local_updates, inner = opt.update(local_grads, state.inner, part.local(params),
                                              **inner_kwargs)
        param_leaves = pytree.tree_leaves(params)
        into = None
        if donate and not reduced:
            into = pytree.tree_leaves(grads)
        full = all_gather_updates(part, pytree.tree_leaves(local_updates), param_leaves, ax, into)
        return pytree.tree_unflatten(treedef, full), ShardedOptState(inner, state.partition)

    def gather_state(state: ShardedOptState, params):
        part = partition(params)
        _check_partition(state, record(part))
        return reshard_state(opt, state.inner, params, part, ax, gather=True)

    def shard_state(full_inner, params) -> ShardedOptState:
        part = partition(params)
        return ShardedOptState(reshard_state(opt, full_inner, params, part, ax, gather=False),
                               record(part))

    def overlap(params, *, weight: float | torch.Tensor | None = None) -> ZeroOverlap:
        if weight is not None and not average:
            raise ValueError("shard_opt_state: weight= gives a weighted mean; it needs "
                             "average=True")
        return ZeroOverlap(params, partition(params), ax, average, reduce_dtype,
                            free_grads=shard_grads, weight=weight)

    def all_finite(grads) -> bool:
        from shardfn.transforms.loss_scale import all_finite as finite_over

        return finite_over(grads, axes=ax.names if len(ax.names) > 1 else ax.names[0],
                           mesh=mesh)

    def rewrap(other: GradientTransformation) -> ShardedOptimizer:
        return shard_opt_state(other, mesh, axis, **options)

    return ShardedOptimizer(init, update, gather_state, shard_state, reduce_grads, partition,
                            overlap, all_finite, opt, ax.names, sharding, rewrap)


def _nested(opt: ShardedOptimizer, mesh: Mesh, axis: AxisName, names: tuple[str, ...],
            sharding: tuple, options: dict) -> ShardedOptimizer:
    """``shard_opt_state(opt)`` for an ``opt`` that is sharded already: one sharding over
    both axis sets when they are disjoint and the rest agrees, else refused."""
    twice = sorted(set(names) & set(opt.axes))
    if twice:
        raise ValueError(
            f"shard_opt_state over {axis!r}: the optimizer is already shard_opt_state over "
            f"{opt.axes}, so axes {twice} would be sharded twice (each rank's pieces cut "
            f"again and averaged twice). Valid order: shard once, around the plain optimizer: "
            f"shard_opt_state(opt, mesh, {axis!r}); compositions go inside or around it "
            f"(chain(clip, shard_opt_state(opt, ...)) is shard_opt_state(chain(clip, opt), ...))")
    if opt.sharding[0] != sharding[0] or opt.sharding[2] != sharding[2]:
        raise ValueError(
            f"shard_opt_state over {axis!r}: the optimizer is shard_opt_state over {opt.axes} "
            f"with another mesh or other options ({dict(opt.sharding[2])} vs {options}); "
            f"shard once over both axes: shard_opt_state(opt, mesh, {names + opt.axes!r})")
    return shard_opt_state(opt.inner, mesh, names + opt.axes, **options)


def _structure(part: FlatPartition, params):
    """``params``' treedef: the partition's, or in traced code one dynamo made (it cannot use
    a treedef made outside the trace)."""
    return pytree.tree_structure(params) if tracing() else part.treedef


def _traced_partition(known, params) -> FlatPartition:
    """The partition made eagerly (by ``init``) for ``params``, found without hashing the
    treedef (dynamo cannot trace its hash): by leaf names, shapes and dtype."""
    names, leaves, _ = pytree.tree_flatten_with_path(params)
    shapes = tuple(tuple(x.shape) for x in leaves)
    dtype = leaves[0].dtype if leaves else torch.float32
    for part in known:
        if part.names == tuple(names) and part.shapes == shapes and part.dtype == dtype:
            return part
    raise ValueError("shard_opt_state under torch.compile: no partition was planned for these "
                     "parameters (leaf names, shapes and dtype). Call opt.init(params) (or "
                     "run a step) eagerly first: a partition is planned outside traced code")


def _fingerprint(part: FlatPartition) -> int:
    text = repr((part.names, part.shapes, str(part.dtype)))
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


def _check_partition(state, expected: torch.Tensor) -> None:
    if not isinstance(state, ShardedOptState):
        raise TypeError(f"expected a ShardedOptState from this optimizer's init, got "
                        f"{type(state).__name__}")
    if tracing():  # torch.compile: the same check without reading the values into Python
        assert_async((state.partition == expected).all(),
                     "shard_opt_state: the optimizer state belongs to another partitioning "
                     "(axis size, index, elements or tree fingerprint differ); use "
                     "gather_state/shard_state to move a state between partitionings")
        return
    got = state.partition.tolist()
    want = expected.tolist()
    if got != want:
        raise ValueError(
            f"optimizer state belongs to another partitioning: it was made for axis size "
            f"{got[0]}, index {got[1]}, {got[2]} elements (tree fingerprint {got[3]}), this "
            f"rank has axis size {want[0]}, index {want[1]}, {want[2]} elements (fingerprint "
            f"{want[3]}). Use gather_state/shard_state to move a state between partitionings."
        )


def _check_same_tree_on_all_ranks(part: FlatPartition, ax) -> None:
    if ax.size == 1:
        return
    mine = torch.tensor([_fingerprint(part)], dtype=torch.int64)
    everyone = _comm.all_gather(mine, ax, 0).tolist()
    if len(set(everyone)) == 1:
        return
    trees = [None] * ax.size
    dist.all_gather_object(trees, list(zip(part.names, part.shapes, strict=True)), group=ax.group)
    first = dict(trees[0])
    for index, tree in enumerate(trees):
        tree = dict(tree)
        diff = sorted(set(tree.items()) ^ set(first.items()))
        if diff:
            name = diff[0][0]
            raise ValueError(
                f"the parameter tree differs between ranks of axis {ax.key!r}: leaf {name!r} "
                f"is {first.get(name, 'missing')} on index 0 but {tree.get(name, 'missing')} "
                f"on index {index} (global rank {ax.ranks[index]})"
            )
