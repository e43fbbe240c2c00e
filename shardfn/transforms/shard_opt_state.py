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
2. The wrapped optimizer updates that part. Its masks, labels and per-group
   hyper-parameters see a tree of the usual structure whose leaves are the
   1-D pieces this rank owns; ``clip_by_global_norm`` inside it is told that
   every leaf is sharded over ``axis`` and computes the exact global norm. It
   may write its updates into those pieces (they are the wrapper's own buffers).
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
from shardfn.mesh import AxisName, Mesh
from shardfn.optim.base import GradientTransformation
from shardfn.optim.clipping import sharded_over
from shardfn.optim.donation import donated, writable_in_place
from shardfn.primitives import _comm, stats
from shardfn.primitives.flat import (
    Exchange,
    FlatPartition,
    finish_reduce_scatter,
    start_all_gather,
    start_reduce_scatter,
)
from shardfn.primitives.grad_hooks import GradHooks
from shardfn.transforms.precision import Precision

__all__ = ["ReducedGrads", "ShardedOptState", "ShardedOptimizer", "shard_opt_state"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
_IN_FLIGHT = 2  # buckets whose reduce-scatter may be outstanding in backward before we wait


class ShardedOptState(NamedTuple):
    """State of a sharded optimizer.

    Attributes:
        inner: the wrapped optimizer's state over this rank's part of the parameters.
        partition: int64 ``[axis size, axis index, total elements, tree fingerprint]``:
            which partition ``inner`` belongs to (checked on every update).
    """

    inner: Any
    partition: torch.Tensor


class ReducedGrads(NamedTuple):
    """This rank's averaged gradient part, already reduce-scattered (``update`` skips the
    reduction when it gets one).

    Attributes:
        local: a tree with the parameters' structure of 1-D pieces this rank owns.
    """

    local: Any


class ShardedOptimizer(NamedTuple):
    """A :class:`GradientTransformation` with ZeRO partitioning, plus state conversions.

    Attributes:
        init: ``init(params) -> ShardedOptState``.
        update: ``update(local_grads, state, params) -> (full updates, state)``.
        gather_state: ``gather_state(state, params)`` -> the full, unsharded inner state
            (identical on every rank), e.g. to inspect or save it.
        shard_state: ``shard_state(full_inner_state, params)`` -> this rank's
            ``ShardedOptState``, e.g. to load a state saved at another world size.
        reduce_grads: ``reduce_grads(local_grads, params)`` -> this rank's averaged
            gradient part (a tree of 1-D pieces).
        partition: ``partition(params) -> FlatPartition``.
        overlap: ``overlap(params)``: a context manager whose hooks reduce-scatter
            gradients during ``backward()``; its ``grads()`` returns the
            :class:`ReducedGrads`. With ``shard_grads=True`` (ZeRO-2) it frees every
            ``.grad`` once its buckets are reduced; otherwise (ZeRO-1) ``.grad`` stays.
    """

    init: Callable
    update: Callable
    gather_state: Callable
    shard_state: Callable
    reduce_grads: Callable
    partition: Callable
    overlap: Callable


def shard_opt_state(
    opt: GradientTransformation,
    mesh: Mesh,
    axis: AxisName = "dp",
    *,
    shard_grads: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    average: bool = True,
    precision: Precision | None = None,
    donate: bool = False,
) -> ShardedOptimizer:
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

    Example:
        >>> opt = sf.shard_opt_state(sf.optim.adam(1e-3), mesh, "dp", shard_grads=True)
    """
    ax = _comm.resolve(axis, mesh)
    reduce_dtype = precision.reduce_dtype if precision is not None else None
    partitions: dict = {}

    def partition(params) -> FlatPartition:
        leaves, treedef = pytree.tree_flatten(params)
        key = (treedef, tuple(tuple(x.shape) for x in leaves),
               leaves[0].dtype if leaves else None)
        if key not in partitions:
            itemsize = leaves[0].element_size() if leaves else 4
            if len(partitions) > 16:
                partitions.clear()
            partitions[key] = FlatPartition.of(params, ax.size, ax.index,
                                               max(1, bucket_bytes // itemsize))
        return partitions[key]

    def record(part: FlatPartition) -> torch.Tensor:
        return torch.tensor([ax.size, ax.index, part.total, _fingerprint(part)], dtype=torch.int64)

    def init(params) -> ShardedOptState:
        part = partition(params)
        _check_same_tree_on_all_ranks(part, ax)
        return ShardedOptState(opt.init(part.local(params)), record(part))

    def local_grad_leaves(grads, params, part: FlatPartition) -> list[torch.Tensor]:
        pytree.tree_map(lambda g, p: None, grads, params)  # structure check, names leaves
        param_leaves, grad_leaves = pytree.tree_leaves(params), pytree.tree_leaves(grads)
        part._check(grad_leaves)
        return _reduce_scatter(part, grad_leaves, param_leaves, ax, average, reduce_dtype)

    def reduce_grads(grads, params):
        part = partition(params)
        return pytree.tree_unflatten(part.treedef, local_grad_leaves(grads, params, part))

    @torch.no_grad()  # not differentiable (plain torch.distributed); params may be leaves
    def update(grads, state: ShardedOptState, params):
        if params is None:
            raise ValueError("shard_opt_state's update needs params (to lay out the partition)")
        part = partition(params)
        _check_partition(state, record(part))
        if isinstance(grads, ReducedGrads):
            local_grads, ours = grads.local, False
        else:
            local_grads, ours = reduce_grads(grads, params), True
        # the local gradients made here are ours to overwrite; the state only if donated
        with sharded_over(axis, mesh), donated(updates=ours or donate, state=donate):
            local_updates, inner = opt.update(local_grads, state.inner, part.local(params))
        param_leaves = pytree.tree_leaves(params)
        into = None
        if donate and not isinstance(grads, ReducedGrads):
            into = pytree.tree_leaves(grads)
        full = _all_gather(part, pytree.tree_leaves(local_updates), param_leaves, ax, into)
        return pytree.tree_unflatten(part.treedef, full), ShardedOptState(inner, state.partition)

    def gather_state(state: ShardedOptState, params):
        part = partition(params)
        _check_partition(state, record(part))
        param_leaves = pytree.tree_leaves(params)

        def gather(local):
            local_leaves = pytree.tree_leaves(local)
            like = [torch.empty(p.shape, dtype=x.dtype, device=x.device)
                    for p, x in zip(param_leaves, local_leaves, strict=True)]
            return pytree.tree_unflatten(part.treedef,
                                         _all_gather(part, local_leaves, like, ax, None))

        return _map_state(state.inner, params, part, gather)

    def shard_state(full_inner, params) -> ShardedOptState:
        part = partition(params)
        return ShardedOptState(_map_state(full_inner, params, part, part.local), record(part))

    def overlap(params) -> _ZeroOverlap:
        return _ZeroOverlap(params, partition(params), ax, average, reduce_dtype,
                            free_grads=shard_grads)

    return ShardedOptimizer(init, update, gather_state, shard_state, reduce_grads, partition,
                            overlap)


def _reduce_scatter(part: FlatPartition, grad_leaves: list[torch.Tensor],
                    param_leaves: list[torch.Tensor], ax, average: bool,
                    reduce_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """This rank's averaged part of every gradient leaf (new 1-D tensors, parameter dtype)."""
    flats = []
    for g in grad_leaves:
        g = g.detach()
        if reduce_dtype is not None and g.dtype != reduce_dtype or not g.is_contiguous():
            g = g.to(dtype=reduce_dtype or g.dtype, memory_format=torch.contiguous_format)
        flats.append(g.view(-1))
    if ax.size == 1:
        return [f.to(p.dtype, copy=True) for f, p in zip(flats, param_leaves, strict=True)]
    local = [torch.empty(n, dtype=p.dtype, device=p.device)
             for n, p in zip(part.local_sizes, param_leaves, strict=True)]
    exchanges = []
    with stats.collective_scope(ax.describe("psum_scatter (flat buckets)")):
        for b, plan in enumerate(part.plans):
            stats.record(ax.key, "psum_scatter", plan.nbytes(flats) * (ax.size - 1) / ax.size)
            exchanges.append(start_reduce_scatter(plan, flats, ax, tag=2 * b))
        for b, (plan, exchange) in enumerate(zip(part.plans, exchanges, strict=True)):
            finish_reduce_scatter(plan, flats, exchange, ax, part.local_views(local, b),
                                  ax.size if average else None)
    return local


def _all_gather(part: FlatPartition, local_leaves: list[torch.Tensor],
                param_leaves: list[torch.Tensor], ax,
                into: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """The full leaves (shapes and dtypes of ``param_leaves``) from every rank's local parts.

    Written into ``into`` (donated tensors) where they can be written safely and
    have the right shape and dtype, else into new tensors.
    """
    usable = into is not None and writable_in_place(into)
    into = [t if usable and t.is_contiguous() and t.shape == p.shape and t.dtype == p.dtype
            else torch.empty(p.shape, dtype=p.dtype, device=p.device)
            for t, p in zip(into or param_leaves, param_leaves, strict=True)]
    if ax.size == 1:
        for dst, x in zip(into, local_leaves, strict=True):
            dst.view(-1).copy_(x)
        return into
    dst_flats = [t.view(-1) for t in into]
    exchanges = []
    for b, plan in enumerate(part.plans):
        own = []
        for (leaf, lo, hi), at in zip(plan.blocks[ax.index], part.local_slots[b], strict=True):
            piece = dst_flats[leaf][lo:hi]
            piece.copy_(local_leaves[leaf][at:at + hi - lo])
            own.append(piece)
        stats.record(ax.key, "all_gather", plan.nbytes(dst_flats) * (ax.size - 1) / ax.size)
        exchanges.append(start_all_gather(plan, own, dst_flats, ax, tag=2 * b + 1))
    with stats.collective_scope(ax.describe("all_gather (flat buckets)")):
        for exchange in exchanges:
            exchange.wait()
    return into


class _ZeroOverlap(GradHooks):
    """Backward hooks that reduce-scatter buckets as their gradients arrive (ZeRO-1/2)."""

    def __init__(self, params, part: FlatPartition, ax, average: bool,
                 reduce_dtype: torch.dtype | None, free_grads: bool):
        super().__init__(params)
        self.part, self.ax, self.average = part, ax, average
        self.reduce_dtype, self.free_grads = reduce_dtype, free_grads
        self.members = [sorted({leaf for pieces in plan.blocks for leaf, _, _ in pieces})
                        for plan in part.plans]
        self.buckets_of = {i: [b for b, m in enumerate(self.members) if i in m]
                           for i in range(len(self.leaves))}
        self.exchanges: dict[int, Exchange] = {}

    def __enter__(self) -> _ZeroOverlap:
        self._drain()  # a block whose grads() was never called
        self.pending = [len(m) for m in self.members]
        self.unfinished = {i: len(bs) for i, bs in self.buckets_of.items()}
        self.flats: list[torch.Tensor | None] = [None] * len(self.leaves)
        self.local = [torch.empty(n, dtype=p.dtype, device=p.device)
                      for n, p in zip(self.part.local_sizes, self.leaves, strict=True)]
        # backward produces the last leaves first: launch buckets from the last, in a fixed
        # order on every rank
        self.order = list(reversed(range(len(self.members))))
        self.unfinished_buckets: list[int] = []  # launched, not yet summed, oldest first
        self._register()
        return self

    def _drain(self) -> None:
        for exchange in self.exchanges.values():
            exchange.wait()
        self.exchanges = {}

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        grad = param.grad
        if self.reduce_dtype not in (None, grad.dtype) or not grad.is_contiguous():
            grad = grad.to(dtype=self.reduce_dtype or grad.dtype,
                           memory_format=torch.contiguous_format)
            if self.free_grads:
                param.grad = None  # the copy is what gets sent
        self.flats[i] = grad.view(-1)
        for b in self.buckets_of[i]:
            self.pending[b] -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self.order and self.pending[self.order[0]] == 0:
            b = self.order.pop(0)
            if self.ax.size > 1:
                plan = self.part.plans[b]
                stats.record(self.ax.key, "psum_scatter",
                             plan.nbytes(self.flats) * (self.ax.size - 1) / self.ax.size)
                self.exchanges[b] = start_reduce_scatter(plan, self.flats, self.ax, tag=2 * b)
            self.unfinished_buckets.append(b)
            # an older bucket has had a bucket's worth of backward to arrive: finish it,
            # which lets ZeRO-2 free the gradients it held
            if len(self.unfinished_buckets) > _IN_FLIGHT:
                self._finish(self.unfinished_buckets.pop(0))

    def _finish(self, b: int) -> None:
        views = self.part.local_views(self.local, b)
        if self.ax.size == 1:
            for (leaf, lo, hi), view in zip(self.part.plans[b].blocks[0], views, strict=True):
                view.copy_(self.flats[leaf][lo:hi])
        else:
            finish_reduce_scatter(self.part.plans[b], self.flats, self.exchanges.pop(b), self.ax,
                                  views, self.ax.size if self.average else None)
        for i in self.members[b]:
            self.unfinished[i] -= 1
            if self.unfinished[i] == 0:
                self.flats[i] = None
                if self.free_grads:
                    self.leaves[i].grad = None

    def grads(self) -> ReducedGrads:
        """Wait for every bucket; this rank's averaged gradient part (new tensors)."""
        self._check_all_arrived()
        for i, leaf in enumerate(self.leaves):  # leaves backward did not reach this time
            if not self.seen[i]:
                self.seen[i] = True
                self.flats[i] = leaf.grad.detach().to(
                    dtype=self.reduce_dtype or leaf.grad.dtype,
                    memory_format=torch.contiguous_format).view(-1)
                for b in self.buckets_of[i]:
                    self.pending[b] -= 1
        self._launch_ready()
        while self.unfinished_buckets:
            self._finish(self.unfinished_buckets.pop(0))
        local = pytree.tree_unflatten(self.part.treedef, self.local)
        self.local = []
        return ReducedGrads(local)


def _map_state(state, params, part: FlatPartition, fn):
    """Apply ``fn`` to every sub-tree of ``state`` shaped like the parameter tree."""
    param_def = pytree.tree_structure(params)

    def is_param_like(x):
        try:
            return pytree.tree_structure(x) == param_def and not isinstance(x, torch.Tensor)
        except Exception:  # noqa: BLE001 - optree raises various errors on odd nodes
            return False

    return pytree.tree_map(
        lambda x: fn(x) if is_param_like(x) else x, state, is_leaf=is_param_like
    )


def _fingerprint(part: FlatPartition) -> int:
    text = repr((part.names, part.shapes, str(part.dtype)))
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


def _check_partition(state, expected: torch.Tensor) -> None:
    if not isinstance(state, ShardedOptState):
        raise TypeError(f"expected a ShardedOptState from this optimizer's init, got "
                        f"{type(state).__name__}")
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
