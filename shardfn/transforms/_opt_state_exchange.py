"""``shard_opt_state``'s two exchanges over the flat partition, and its backward hooks.

* :func:`reduce_scatter_grads`: each rank's local gradient leaves in, this
  rank's averaged part of every leaf out (new 1-D tensors).
* :func:`all_gather_updates`: every rank's updated parts in, the full update
  leaves out (into donated tensors where they can be written).
* :class:`ZeroOverlap`: the hooks of ``overlap(params)``, which reduce-scatter
  each bucket as backward produces its gradients (ZeRO-1; with ``free_grads``
  ZeRO-2, which frees every ``.grad`` once its buckets are reduced).

All of them move the buckets with the piece exchange of
:mod:`shardfn.primitives.piece_exchange`, with the tags of :mod:`shardfn.primitives.buckets`;
in code that ``torch.compile`` traces the first two use one functional collective per
bucket instead (:mod:`._opt_state_traced`).
Non-floating leaves (integer buffers) are never sent: their parts are zeros.

Example:
    >>> local = reduce_scatter_grads(part, grad_leaves, param_leaves, ax, True, None)
    >>> full = all_gather_updates(part, local, param_leaves, ax, into=None)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.optim.donation import writable_in_place
from shardfn.primitives import stats
from shardfn.primitives._compiled import tracing
from shardfn.primitives.buckets import IN_FLIGHT, BucketSchedule, gather_tag, reduce_tag
from shardfn.primitives.flat import FlatPartition, leaf_divide_factors, piece_divisors, weight_share
from shardfn.primitives.grad_hooks import GradHooks
from shardfn.primitives.piece_exchange import (
    BucketPlan,
    Exchange,
    finish_reduce_scatter,
    start_all_gather,
    start_reduce_scatter,
)
from shardfn.primitives.reduce_scaling import divide_factors
from shardfn.transforms._opt_state_traced import all_gather_traced, reduce_scatter_traced

__all__ = ["ReducedGrads", "ZeroOverlap", "all_gather_updates", "reduce_scatter_grads"]


class ReducedGrads(NamedTuple):
    """This rank's averaged gradient part, already reduce-scattered (``update`` skips the
    reduction when it gets one).

    Attributes:
        local: a tree with the parameters' structure of 1-D pieces this rank owns.
    """

    local: Any


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


def reduce_scatter_grads(part: FlatPartition, grad_leaves: list[torch.Tensor],
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
    if tracing():  # torch.compile: one psum_scatter per bucket, the same arithmetic
        return reduce_scatter_traced(part, flats, frozen, param_leaves, ax, divide)
    local = [(torch.zeros if i in frozen else torch.empty)(n, dtype=p.dtype, device=p.device)
             for i, (n, p) in enumerate(zip(part.local_sizes, param_leaves, strict=True))]
    plans = [_without(plan, frozen) for plan in part.plans]
    exchanges = []
    with stats.collective_scope(ax.describe("psum_scatter (flat buckets)")):
        for b, plan in enumerate(plans):
            stats.record(ax.key, "psum_scatter", plan.nbytes(flats) * (ax.size - 1) / ax.size)
            exchanges.append(start_reduce_scatter(plan, flats, ax, tag=reduce_tag(b)))
        for b, (plan, exchange) in enumerate(zip(plans, exchanges, strict=True)):
            finish_reduce_scatter(plan, flats, exchange, ax, _live_views(part, local, b, frozen),
                                  _divisors(plan, ax.index, divide))
    return local


def all_gather_updates(part: FlatPartition, local_leaves: list[torch.Tensor],
                param_leaves: list[torch.Tensor], ax,
                into: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """The full leaves (shapes and dtypes of ``param_leaves``) from every rank's local parts.

    Written into ``into`` (donated tensors) where they can be written safely and
    have the right shape and dtype, else into new tensors.
    """
    frozen = _frozen(param_leaves)  # zero updates, nothing sent
    if tracing() and ax.size > 1:  # torch.compile: one all_gather per bucket, new tensors
        return all_gather_traced(part, local_leaves, frozen, param_leaves, ax)
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
        exchanges.append(start_all_gather(plan, own, dst_flats, ax, tag=gather_tag(b)))
    with stats.collective_scope(ax.describe("all_gather (flat buckets)")):
        for exchange in exchanges:
            exchange.wait()
    return into


class ZeroOverlap(GradHooks):
    """Backward hooks that reduce-scatter buckets as their gradients arrive (ZeRO-1/2)."""

    def __init__(self, params, part: FlatPartition, ax, average: bool,
                 reduce_dtype: torch.dtype | None, free_grads: bool,
                 weight: float | torch.Tensor | None = None):
        super().__init__(params)
        self.part, self.ax, self.average, self.weight = part, ax, average, weight
        self.reduce_dtype, self.free_grads = reduce_dtype, free_grads
        self.members = [sorted({leaf for pieces in plan.blocks for leaf, _, _ in pieces})
                        for plan in part.plans]
        # backward produces the last leaves first: launch buckets from the last, in a fixed
        # order on every rank; an older bucket is settled (summed) once it has had a
        # bucket's worth of backward to arrive, which lets ZeRO-2 free the gradients it held
        self.schedule = BucketSchedule(self.members, reversed(range(len(self.members))),
                                       IN_FLIGHT, self._launch, self._finish)
        self.exchanges: dict[int, Exchange] = {}

    def __enter__(self) -> ZeroOverlap:
        self._drain()  # a block whose grads() was never called
        self.schedule.start()
        self.unfinished = {i: len(bs) for i, bs in self.schedule.buckets_of.items()}
        self.flats: list[torch.Tensor | None] = [None] * len(self.leaves)
        self.local = [torch.empty(n, dtype=p.dtype, device=p.device)
                      for n, p in zip(self.part.local_sizes, self.leaves, strict=True)]
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
        self.schedule.arrived(i)

    def _launch(self, b: int) -> None:
        if self.ax.size > 1:
            plan = self.part.plans[b]
            stats.record(self.ax.key, "psum_scatter",
                         plan.nbytes(self.flats) * (self.ax.size - 1) / self.ax.size)
            self.exchanges[b] = start_reduce_scatter(plan, self.flats, self.ax, tag=reduce_tag(b))

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
                self.schedule.arrived(i)
        self.schedule.finish()
        local = pytree.tree_unflatten(self.part.treedef, self.local)
        self.local = []
        return ReducedGrads(local)


