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
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh
from shardfn.optim.base import GradientTransformation
from shardfn.optim.clipping import sharded_over
from shardfn.optim.donation import donated, writable_in_place
from shardfn.primitives import _comm, consistency, stats
from shardfn.primitives.flat import (
    BucketPlan,
    Exchange,
    FlatPartition,
    finish_reduce_scatter,
    leaf_divide_factors,
    piece_divisors,
    start_all_gather,
    start_reduce_scatter,
    weight_share,
)
from shardfn.primitives.grad_hooks import GradHooks
from shardfn.primitives.reduce_scaling import divide_factors
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
    """

    init: Callable
    update: Callable
    gather_state: Callable
    shard_state: Callable
    reduce_grads: Callable
    partition: Callable
    overlap: Callable
    all_finite: Callable | None = None


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
        _check_same_tree_on_all_ranks(part, ax)  # first: names the leaf whose shape differs
        consistency.check_replicated("shard_opt_state.init params", ax, params)
        return ShardedOptState(opt.init(part.local(params)), record(part))

    def local_grad_leaves(grads, params, part: FlatPartition, weight) -> list[torch.Tensor]:
        pytree.tree_map(lambda g, p: None, grads, params)  # structure check, names leaves
        param_leaves, grad_leaves = pytree.tree_leaves(params), pytree.tree_leaves(grads)
        part._check(grad_leaves)
        share = None
        if weight is not None:
            if not average:
                raise ValueError("shard_opt_state: weight= gives a weighted mean; it needs "
                                 "average=True")
            share = weight_share(weight, ax, param_leaves[0].device if param_leaves
                                 else torch.device("cpu"))
        return _reduce_scatter(part, grad_leaves, param_leaves, ax, average, reduce_dtype, share)

    def reduce_grads(grads, params, *, weight: float | torch.Tensor | None = None):
        part = partition(params)
        return pytree.tree_unflatten(part.treedef,
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
        _check_partition(state, record(part))
        if reduced:
            if weight is not None:
                raise ValueError("shard_opt_state: these gradients were reduced by overlap(); "
                                 "pass weight= to overlap(params, weight=...) instead")
            local_grads, ours = grads.local, False
        else:
            local_grads = pytree.tree_unflatten(
                part.treedef, local_grad_leaves(grads, params, part, weight))
            ours = True
        # the local gradients made here are ours to overwrite; the state only if donated
        with sharded_over(axis, mesh), donated(updates=ours or donate, state=donate):
            local_updates, inner = opt.update(local_grads, state.inner, part.local(params),
                                              **inner_kwargs)
        param_leaves = pytree.tree_leaves(params)
        into = None
        if donate and not reduced:
            into = pytree.tree_leaves(grads)
        full = _all_gather(part, pytree.tree_leaves(local_updates), param_leaves, ax, into)
        return pytree.tree_unflatten(part.treedef, full), ShardedOptState(inner, state.partition)

    def gather_state(state: ShardedOptState, params):
        part = partition(params)
        _check_partition(state, record(part))
        return _reshard_state(opt, state.inner, params, part, ax, gather=True)

    def shard_state(full_inner, params) -> ShardedOptState:
        part = partition(params)
        return ShardedOptState(_reshard_state(opt, full_inner, params, part, ax, gather=False),
                               record(part))

    def overlap(params, *, weight: float | torch.Tensor | None = None) -> _ZeroOverlap:
        if weight is not None and not average:
            raise ValueError("shard_opt_state: weight= gives a weighted mean; it needs "
                             "average=True")
        return _ZeroOverlap(params, partition(params), ax, average, reduce_dtype,
                            free_grads=shard_grads, weight=weight)

    def all_finite(grads) -> bool:
        from shardfn.transforms.loss_scale import all_finite as finite_over

        return finite_over(grads, axes=ax.names if len(ax.names) > 1 else ax.names[0],
                           mesh=mesh)

    return ShardedOptimizer(init, update, gather_state, shard_state, reduce_grads, partition,
                            overlap, all_finite)


def _frozen(leaves: list[torch.Tensor]) -> frozenset[int]:
    """Leaf numbers of the non-floating leaves (integer buffers): never reduced nor stepped."""
    return frozenset(i for i, x in enumerate(leaves)
                     if not (x.is_floating_point() or x.is_complex()))


def _without(plan: BucketPlan, frozen: frozenset[int]) -> BucketPlan:
    """``plan`` with the pieces of ``frozen`` leaves left out (nothing sent for them)."""
    if not frozen:
        return plan
    return BucketPlan(plan.size, plan.length, plan.block,
                      tuple(tuple(p for p in pieces if p[0] not in frozen)
                            for pieces in plan.blocks))


def _live_views(part: FlatPartition, local: list[torch.Tensor], b: int,
                frozen: frozenset[int]) -> list[torch.Tensor]:
    views = part.local_views(local, b)
    if not frozen:
        return views
    return [v for (leaf, _, _), v in zip(part.plans[b].blocks[part.index], views, strict=True)
            if leaf not in frozen]


def _divisors(plan: BucketPlan, index: int, divide: Any) -> Any:
    """One divisor for every piece, or a per-leaf list turned into one per piece."""
    return piece_divisors(plan, index, divide) if isinstance(divide, list) else divide


def _reduce_scatter(part: FlatPartition, grad_leaves: list[torch.Tensor],
                    param_leaves: list[torch.Tensor], ax, average: bool,
                    reduce_dtype: torch.dtype | None,
                    share: float | None = None) -> list[torch.Tensor]:
    """This rank's averaged part of every gradient leaf (new 1-D tensors, parameter dtype).

    Low-precision leaves are divided by FSDP2's ``pre`` factor before the exchange and by
    ``post`` after it; with a weight ``share`` every leaf is multiplied by it before and
    summed. Non-floating leaves are not reduced: their parts are zeros.
    """
    frozen = _frozen(param_leaves)
    flats, ours = [], []
    for g in grad_leaves:
        g = g.detach()
        copied = False
        if reduce_dtype is not None and g.dtype != reduce_dtype or not g.is_contiguous():
            g = g.to(dtype=reduce_dtype or g.dtype).contiguous()  # .to alone may alias
            copied = True
        flats.append(g.view(-1))
        ours.append(copied)
    if ax.size == 1:
        return [torch.zeros(f.shape, dtype=p.dtype, device=p.device) if i in frozen
                else f.to(p.dtype, copy=True)
                for i, (f, p) in enumerate(zip(flats, param_leaves, strict=True))]
    divide: Any = ax.size if average else None
    if share is not None:
        divide = None
        if share != 1.0:
            flats = [f if i in frozen else f.mul_(share) if ours[i] else f * share
                     for i, f in enumerate(flats)]
    elif average:
        factors = leaf_divide_factors([f.dtype for f in flats], ax.size)
        if factors is not None:  # fp16/bf16 leaves: divide before the sum too, as FSDP2 does
            pres, divide = factors
            flats = [f if pre == 1 or i in frozen else f.div_(pre) if ours[i] else f / pre
                     for i, (f, pre) in enumerate(zip(flats, pres, strict=True))]
    local = [(torch.zeros if i in frozen else torch.empty)(n, dtype=p.dtype, device=p.device)
             for i, (n, p) in enumerate(zip(part.local_sizes, param_leaves, strict=True))]
    plans = [_without(plan, frozen) for plan in part.plans]
    exchanges = []
    with stats.collective_scope(ax.describe("psum_scatter (flat buckets)")):
        for b, plan in enumerate(plans):
            stats.record(ax.key, "psum_scatter", plan.nbytes(flats) * (ax.size - 1) / ax.size)
            exchanges.append(start_reduce_scatter(plan, flats, ax, tag=2 * b))
        for b, (plan, exchange) in enumerate(zip(plans, exchanges, strict=True)):
            finish_reduce_scatter(plan, flats, exchange, ax, _live_views(part, local, b, frozen),
                                  _divisors(plan, ax.index, divide))
    return local


def _all_gather(part: FlatPartition, local_leaves: list[torch.Tensor],
                param_leaves: list[torch.Tensor], ax,
                into: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """The full leaves (shapes and dtypes of ``param_leaves``) from every rank's local parts.

    Written into ``into`` (donated tensors) where they can be written safely and
    have the right shape and dtype, else into new tensors.
    """
    frozen = _frozen(param_leaves)  # zero updates, nothing sent
    usable = into is not None and writable_in_place(into)
    into = [torch.zeros(p.shape, dtype=p.dtype, device=p.device) if i in frozen
            else t if usable and t.is_contiguous() and t.shape == p.shape and t.dtype == p.dtype
            else torch.empty(p.shape, dtype=p.dtype, device=p.device)
            for i, (t, p) in enumerate(zip(into or param_leaves, param_leaves, strict=True))]
    if ax.size == 1:
        for i, (dst, x) in enumerate(zip(into, local_leaves, strict=True)):
            if i not in frozen:
                dst.view(-1).copy_(x)
        return into
    dst_flats = [t.view(-1) for t in into]
    exchanges = []
    for b, full_plan in enumerate(part.plans):
        plan = _without(full_plan, frozen)
        own = []
        for (leaf, lo, hi), at in zip(full_plan.blocks[ax.index], part.local_slots[b],
                                      strict=True):
            if leaf in frozen:
                continue
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
                 reduce_dtype: torch.dtype | None, free_grads: bool,
                 weight: float | torch.Tensor | None = None):
        super().__init__(params)
        self.part, self.ax, self.average, self.weight = part, ax, average, weight
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
        # what each leaf's sum is divided by after the exchange (set as gradients arrive)
        self.divide: list[Any] = [self.ax.size if self.average else None] * len(self.leaves)
        self.share = None  # this rank's weight / total weight (one scalar psum, before backward)
        if self.weight is not None:
            device = self.leaves[0].device if self.leaves else torch.device("cpu")
            self.share = weight_share(self.weight, self.ax, device)
        self._register()
        return self

    def _drain(self) -> None:
        for exchange in self.exchanges.values():
            exchange.wait()
        self.exchanges = {}

    def _send_buffer(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Leaf ``i``'s gradient as the 1-D tensor to send: ``.grad`` itself when it can be,
        else a copy (another dtype or layout; pre-divided for fp16/bf16; weighted)."""
        out = grad.detach()
        if self.reduce_dtype not in (None, out.dtype) or not out.is_contiguous():
            out = out.to(dtype=self.reduce_dtype or out.dtype).contiguous()  # may alias
        if self.ax.size > 1:
            if self.share is not None:
                self.divide[i] = None
                if self.share != 1.0:
                    out = out * self.share  # a copy: ZeRO-1 leaves .grad as autograd wrote it
            elif self.average:
                pre, post = divide_factors(self.ax.size, out.dtype)
                if pre != 1:  # fp16/bf16: divide before the sum too, as FSDP2 does
                    out, self.divide[i] = out / pre, post
        return out.view(-1)

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        grad = param.grad
        self.flats[i] = self._send_buffer(i, grad)
        if self.free_grads and self.flats[i].data_ptr() != grad.data_ptr():
            param.grad = None  # the copy is what gets sent
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
            plan = self.part.plans[b]
            divide = [self.divide[leaf] for leaf, _, _ in plan.blocks[self.ax.index]]
            if all(d == divide[0] for d in divide):
                divide = divide[0] if divide else None
            finish_reduce_scatter(plan, self.flats, self.exchanges.pop(b), self.ax, views, divide)
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
                self.flats[i] = self._send_buffer(i, leaf.grad)
                for b in self.buckets_of[i]:
                    self.pending[b] -= 1
        self._launch_ready()
        while self.unfinished_buckets:
            self._finish(self.unfinished_buckets.pop(0))
        local = pytree.tree_unflatten(self.part.treedef, self.local)
        self.local = []
        return ReducedGrads(local)


_PROBE = 1_000_000_007  # probe leaf i has 1-D shape (_PROBE + i,): no real state has it


def _state_roles(opt: GradientTransformation, params, part: FlatPartition):
    """Which leaves of ``opt``'s state belong to which parameter leaf.

    ``opt.init`` runs on *probe* parameters: meta tensors (no memory) with the
    parameters' dtypes, leaf ``i`` of 1-D shape ``(_PROBE + i,)`` (1-D like the local
    pieces the sharded optimizer sees). A state leaf of that shape is leaf ``i``'s
    per-parameter state (a moment, a momentum buffer; under ``masked`` and
    ``multi_transform`` too, and for a bare tensor as params); a plain tensor not
    made from the probe (a step count) is global, the same on every rank.

    Returns:
        ``(treedef, roles, paths)``: the state's structure; per state leaf, the parameter
        leaf number or None (global); the leaves' dotted paths.

    Raises:
        ValueError: naming the state path of a leaf made from the parameters that is not
            an elementwise copy of one (it cannot be resharded), or when init cannot run
            on shape-only parameters.
    """
    leaves = pytree.tree_leaves(params)
    probe = pytree.tree_unflatten(part.treedef, [
        torch.empty(_PROBE + i, dtype=x.dtype, device="meta") for i, x in enumerate(leaves)])
    try:
        probe_state = opt.init(probe)
    except Exception as err:  # noqa: BLE001 - any failure means: cannot tell, say so
        raise ValueError(
            "shard_opt_state: gather_state/shard_state run the wrapped optimizer's init on "
            "shape-only (meta) parameters to find which state leaves belong to which "
            f"parameter, and it failed: {type(err).__name__}: {err}") from err
    paths, state_leaves, treedef = _flatten_with_names(probe_state)
    roles: list[int | None] = []
    for path, x in zip(paths, state_leaves, strict=True):
        if not isinstance(x, torch.Tensor) or not x.is_meta:
            roles.append(None)  # global: a count, a flag, a Python value
            continue
        if x.dim() == 1 and _PROBE <= x.shape[0] < _PROBE + len(leaves):
            roles.append(x.shape[0] - _PROBE)
            continue
        raise ValueError(
            f"shard_opt_state: optimizer state leaf {path or '<root>'!r} (shape "
            f"{_shape_text(x.shape)} for the probe) is computed from the parameters but is "
            f"not an elementwise buffer of one parameter, so it cannot be resharded "
            f"between world sizes; gather_state/shard_state support states made of "
            f"per-parameter buffers (zeros_like(param)) and global values")
    return treedef, roles, paths


def _flatten_with_names(tree):
    """``(names, leaves, treedef)`` with NamedTuple fields by name ("1.mu.w", not "1.1.w")."""
    import optree

    accessors, leaves, treedef = optree.tree_flatten_with_accessor(
        tree, namespace=pytree.NAMESPACE)
    names = []
    for accessor in accessors:
        parts = [str(getattr(e, "field", None) or getattr(e, "entry", "")) for e in accessor]
        names.append(".".join(parts))
    return names, leaves, treedef


def _shape_text(shape) -> str:
    return str(tuple(f"P+{d - _PROBE}" if d >= _PROBE else d for d in shape))


def _reshard_state(opt: GradientTransformation, state, params, part: FlatPartition, ax,
                   gather: bool):
    """The full inner state from this rank's (``gather``), or this rank's from the full.

    Per-parameter leaves (see :func:`_state_roles`) are all-gathered into the
    parameter's shape, or cut into this rank's 1-D piece (a copy); global leaves are
    kept as they are.
    """
    treedef, roles, paths = _state_roles(opt, params, part)
    state_leaves, got_def = pytree.tree_flatten(state)
    what = "sharded" if gather else "full"
    if got_def != treedef:
        raise ValueError(f"shard_opt_state: the {what} optimizer state does not have the "
                         f"structure of the wrapped optimizer's init ({got_def} vs {treedef})")
    for path, x, role in zip(paths, state_leaves, roles, strict=True):
        if role is None:
            continue
        want = (part.local_sizes[role],) if gather else part.shapes[role]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(want):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"shard_opt_state: {what} optimizer state leaf {path!r} (the state of "
                f"parameter {part.names[role]!r}) has shape {got}, expected {tuple(want)}"
                + (" (this rank's piece: was the state made for this partition?)" if gather
                   else " (the parameter's shape)"))
    out = list(state_leaves)
    items = [(k, role) for k, role in enumerate(roles) if role is not None]
    if gather:
        full = _gather_pieces(part, [(role, state_leaves[k]) for k, role in items], ax)
        for (k, _), x in zip(items, full, strict=True):
            out[k] = x
    else:
        pieces = part.pieces()
        for k, role in items:
            flat = state_leaves[k].detach().reshape(-1)
            out[k] = torch.cat([flat[a:b] for a, b in pieces[role]]) if pieces[role] \
                else flat[:0].clone()
    return pytree.tree_unflatten(treedef, out)


def _gather_pieces(part: FlatPartition, items: list[tuple[int, torch.Tensor]], ax
                   ) -> list[torch.Tensor]:
    """Full tensors (parameter shapes) from every rank's 1-D pieces of the given leaves.

    ``items``: ``(parameter leaf number, this rank's piece)``, the same list on every rank.
    One all-gather of the pieces' bytes per device (any dtypes together).
    """
    if ax.size == 1:
        return [x.reshape(part.shapes[i]).clone() for i, x in items]
    out: list[torch.Tensor | None] = [None] * len(items)
    by_device: dict[torch.device, list[int]] = {}
    for k, (_, x) in enumerate(items):
        by_device.setdefault(x.device, []).append(k)
    pieces = [part.pieces(j) for j in range(ax.size)]
    for device, ks in sorted(by_device.items(), key=lambda kv: str(kv[0])):
        sizes = [sum(items[k][1].element_size() * sum(b - a for a, b in pieces[j][items[k][0]])
                     for k in ks) for j in range(ax.size)]
        mine = [items[k][1].detach().contiguous().view(torch.uint8) for k in ks]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        if mine:
            joined = torch.cat(mine)
            buf[:joined.numel()].copy_(joined)
        everyone = [torch.empty_like(buf) for _ in range(ax.size)]
        with stats.collective_scope(ax.describe("all_gather (optimizer state)")):
            dist.all_gather(everyone, buf, group=ax.group)
        for k in ks:
            i, x = items[k]
            out[k] = torch.empty(math.prod(part.shapes[i]), dtype=x.dtype, device=device)
        for j in range(ax.size):
            at = 0
            for k in ks:
                i, x = items[k]
                full = out[k]
                for a, b in pieces[j][i]:
                    n = (b - a) * x.element_size()
                    full[a:b] = everyone[j][at:at + n].clone().view(x.dtype)  # aligned
                    at += n
    return [x.view(part.shapes[i]) for x, (i, _) in zip(out, items, strict=True)]


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
