"""``data_parallel``'s gradients averaged while backward runs: the autograd hooks and the pure step.

Two users of one mechanism, :class:`Overlap` (a post-accumulate-grad hook on every
leaf; a bucket's reduction starts as soon as backward has produced every gradient
it holds, and is averaged in place in those gradients):

* ``with dp.overlap(params) as sync: loss.backward()`` on the user's own leaves,
  buckets of whole leaves in reverse tree order (:meth:`BucketLayout.whole_leaves`);
* ``dp.grad_and_value(fn)(params, batch)`` (:func:`overlapped_grad_and_value`), the
  pure step: ``sf.grad_and_value`` followed by ``dp.reduce_grads`` with the
  reduction overlapped with the backward, as DDP does. It differentiates fresh
  leaves made for the call (nothing is kept between calls) and uses
  ``reduce_grads``' own bucket plan (:meth:`BucketLayout.of_partition`, launched
  last bucket first), so every element is summed by the same rank in the same
  order: the result is bitwise ``reduce_grads(sf.grad_and_value(fn)(...))``.
  Inside ``vmap``/``grad``/``torch.compile`` it is exactly that composition.

Bucket arithmetic shared with ``reduce_grads``: :func:`prescale` (scale before the
sum, say what to divide by after) and :func:`second_half` (finish a bucket's
reduce-scatter, start its all-gather).

Example:
    >>> dp = sf.data_parallel(mesh, "dp")
    >>> grads, loss = dp.grad_and_value(loss_fn)(params, local_batch)   # averaged grads
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn._functional_grad import (
    check_argnums,
    detached_inputs,
    engine_usable,
    grad_and_value,
    results,
    split_output,
)
from shardfn.primitives import consistency, stats
from shardfn.primitives._comm import Axis
from shardfn.primitives.buckets import IN_FLIGHT, BucketSchedule, by_bytes, gather_tag, reduce_tag
from shardfn.primitives.flat import FlatPartition, leaf_divide_factors, piece_divisors, weight_share
from shardfn.primitives.grad_hooks import GradHooks
from shardfn.primitives.piece_exchange import (
    BucketPlan,
    Exchange,
    finish_reduce_scatter,
    start_all_gather,
    start_reduce_scatter,
)
from shardfn.primitives.reduced import check_not_reduced

__all__ = ["BucketLayout", "Overlap", "device_of", "overlapped_grad_and_value", "prescale",
           "second_half"]

Weight = float | torch.Tensor | Callable[..., float | torch.Tensor] | None


def device_of(leaves: Sequence[torch.Tensor]) -> torch.device:
    """The device of the first leaf (cpu for none)."""
    return leaves[0].device if leaves else torch.device("cpu")


def prescale(flats: Sequence[torch.Tensor], ax: Axis, average: bool, share: float | None
             ) -> int | list[float] | None:
    """Scale ``flats`` in place before their sum-reduction; what to divide the sums by after.

    With a ``share`` (weighted mean) each rank multiplies by its share and the sums are
    the result. Otherwise low-precision leaves are divided by FSDP2's ``pre`` factor now
    and by ``post`` after (a mean that fits in fp16 then does not overflow on the way);
    float32 leaves are divided by the axis size once, after the sum. Elementwise: the
    same values whether ``flats`` are whole leaves or pieces of them.

    Returns:
        None (nothing to divide), the axis size, or one divisor per entry of ``flats``.
    """
    if share is not None:
        if share != 1.0 and flats:
            torch._foreach_mul_(list(flats), share)
        return None
    if not average:
        return None
    factors = leaf_divide_factors([f.dtype for f in flats], ax.size)
    if factors is None:
        return ax.size
    pres, posts = factors
    for f, pre in zip(flats, pres, strict=True):
        if pre != 1:
            f.div_(pre)
    return posts


def second_half(plan: BucketPlan, flats: Sequence[torch.Tensor], exchange: Exchange, ax: Axis,
                divide: Any, tag: int) -> Exchange:
    """Finish a bucket's reduce-scatter in place and start its all-gather.

    ``divide``: None, one divisor for every sum, or a list with one per leaf."""
    own = [flats[leaf][lo:hi] for leaf, lo, hi in plan.blocks[ax.index]]
    if isinstance(divide, list):
        divide = piece_divisors(plan, ax.index, divide)
    finish_reduce_scatter(plan, flats, exchange, ax, own, divide)
    return start_all_gather(plan, own, flats, ax, tag=tag, what="psum")


class BucketLayout(NamedTuple):
    """How an overlapped reduction cuts the leaves into buckets, and in which order it
    launches them (the same on every rank, so the point-to-point messages pair up).

    Attributes:
        plans: ``plans[b]``: bucket ``b``'s pieces of leaves and their blocks.
        members: ``members[b]``: the leaves with elements in bucket ``b``.
        order: the launch order of the buckets.
    """

    plans: Sequence[BucketPlan]
    members: list[list[int]]
    order: list[int]

    @staticmethod
    def whole_leaves(leaves: Sequence[torch.Tensor], bucket_bytes: int, size: int
                     ) -> BucketLayout:
        """Whole leaves in buckets of at most ``bucket_bytes``, reverse tree order (``overlap``)."""
        members = by_bytes(leaves, bucket_bytes)
        plans = [BucketPlan.of([(i, 0, leaves[i].numel()) for i in m], size) for m in members]
        return BucketLayout(plans, members, list(range(len(members))))

    @staticmethod
    def of_partition(partition: FlatPartition) -> BucketLayout:
        """``reduce_grads``' buckets (tree order, leaves cut at bucket edges), last first."""
        members = [sorted({leaf for block in plan.blocks for leaf, _, _ in block})
                   for plan in partition.plans]
        return BucketLayout(partition.plans, members, list(reversed(range(len(members)))))


class Overlap(GradHooks):
    """Hooks that average gradient buckets in place as backward produces them.

    A bucket is launched (prescaled, its reduce-scatter started) once all its gradients
    are there; settling it (finishing the sum, starting its all-gather) waits until the
    next bucket is launched, so one reduce-scatter and the all-gathers are in flight.

    Args:
        params: the leaves (tree) whose ``.grad`` are averaged.
        ax: the resolved axis.
        layout: ``layout(leaves) -> BucketLayout``.
        average, reduce_dtype, weight: as ``data_parallel`` / ``overlap``.
        what: the caller's name, for errors.
    """

    def __init__(self, params, ax: Axis, layout: Callable[[list[torch.Tensor]], BucketLayout],
                 average: bool, reduce_dtype: torch.dtype | None,
                 weight: float | torch.Tensor | None = None,
                 what: str = "data_parallel.overlap"):
        super().__init__(params)
        self.ax, self.average, self.reduce_dtype, self.what = ax, average, reduce_dtype, what
        self.weight = weight
        self.plans, self.members, order = layout(self.leaves)
        # settling a bucket starts its all-gather, so one fewer reduce-scatter stays unsettled
        self.schedule = BucketSchedule(self.members, order, IN_FLIGHT - 1,
                                       self._launch, self._settle)
        self.scatters: dict[int, Exchange] = {}
        self.gathers: dict[int, Exchange] = {}

    def __enter__(self) -> Overlap:
        self._drain()  # a block whose grads() was never called
        self.schedule.start()
        self.flats: list[torch.Tensor | None] = [None] * len(self.leaves)
        self.divides: dict[int, Any] = {}
        self.share = None  # this rank's weight / total weight (one scalar psum, before backward)
        if self.weight is not None:
            self.share = weight_share(self.weight, self.ax, device_of(self.leaves))
        self._register()
        return self

    def _drain(self) -> None:
        for exchanges in (self.scatters, self.gathers):
            for exchange in exchanges.values():
                exchange.wait()
            exchanges.clear()

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        self.schedule.arrived(i)

    def _launch(self, b: int) -> None:
        members = self.members[b]  # shard_params' .grad is reduced already: refused
        check_not_reduced(self.what, [self.leaves[i].grad for i in members],
                          lambda: [self.names[i] for i in members], self.ax)
        for i in members:
            if self.flats[i] is not None:  # a leaf cut across buckets: made at the first
                continue
            grad = self.leaves[i].grad
            if (self.ax.size > 1 and self.reduce_dtype not in (None, grad.dtype)
                    or not grad.is_contiguous()):
                # a copy (.to alone would alias a transposed .grad: its suggested memory
                # format is contiguous); averaged in it, copied back in grads()
                dtype = self.reduce_dtype if self.ax.size > 1 else None
                grad = grad.to(dtype=dtype or grad.dtype).contiguous()
            self.flats[i] = grad.view(-1)
        if self.ax.size == 1:
            return
        plan = self.plans[b]
        pieces = [piece for block in plan.blocks for piece in block]
        # scaled in place before the sum (the gradients are averaged in place anyway)
        divide = prescale([self.flats[leaf][lo:hi] for leaf, lo, hi in pieces], self.ax,
                          self.average, self.share)
        if isinstance(divide, list):  # per piece: index by leaf number (one dtype per leaf)
            posts = {leaf: post for (leaf, _, _), post in zip(pieces, divide, strict=True)}
            divide = [posts.get(i, 1.0) for i in range(len(self.leaves))]
        self.divides[b] = divide
        stats.record(self.ax.key, "psum",
                     2 * plan.nbytes(self.flats) * (self.ax.size - 1) / self.ax.size)
        self.scatters[b] = start_reduce_scatter(plan, self.flats, self.ax, tag=reduce_tag(b),
                                                what="psum")

    def _settle(self, b: int) -> None:
        if b not in self.scatters:  # an axis of size 1: nothing was sent
            return
        exchange = self.scatters.pop(b)
        self.gathers[b] = second_half(self.plans[b], self.flats, exchange, self.ax,
                                      self.divides.pop(b), tag=gather_tag(b))

    def grads(self):
        """Wait for every bucket; the tree of the averaged ``.grad`` tensors (averaged in
        place: the same tensors as the ``.grad`` fields, not copies)."""
        self._check_all_arrived()
        for i in range(len(self.leaves)):  # leaves backward did not reach this time
            if not self.seen[i]:
                self.seen[i] = True
                self.schedule.arrived(i)
        self.schedule.finish()
        for b in sorted(self.gathers):
            self.gathers.pop(b).wait()
        out = []
        for leaf, flat in zip(self.leaves, self.flats, strict=True):
            grad = leaf.grad
            if flat is not None and flat.data_ptr() != grad.data_ptr():
                grad.copy_(flat.view(grad.shape))  # it was reduced in another dtype or layout
            out.append(grad)
        self.flats = [None] * len(self.leaves)
        return pytree.tree_unflatten(self.treedef, out)


def overlapped_grad_and_value(fn: Callable, argnums: int | tuple[int, ...], has_aux: bool, *,
                              weight: Weight, ax: Axis, average: bool,
                              reduce_dtype: torch.dtype | None,
                              partition: Callable[[list[torch.Tensor], Any], FlatPartition],
                              reduce_grads: Callable) -> Callable:
    """``reduce_grads(sf.grad_and_value(fn, argnums, has_aux)(...))`` with the reduction
    overlapped with the backward (see the module docstring; ``DataParallel.grad_and_value``
    documents the arguments).

    Args:
        fn, argnums, has_aux: as ``sf.grad_and_value``.
        weight: this rank's number of examples (a number, a 0-dim tensor, or a function of
            the call's arguments returning one), or None.
        ax, average, reduce_dtype: ``data_parallel``'s configuration.
        partition: ``partition(leaves, tree) -> FlatPartition``: ``reduce_grads``' bucket plan.
        reduce_grads: ``data_parallel``'s ``reduce_grads`` (the composition's second half).

    Returns:
        A function with ``sf.grad_and_value``'s results, the gradients averaged over ``ax``.
    """
    plain = grad_and_value(fn, argnums=argnums, has_aux=has_aux)
    check_argnums(argnums)
    if weight is not None and not average:
        raise ValueError("grad_and_value(weight=...) gives a weighted mean; it needs "
                         "data_parallel(..., average=True)")

    def call(*args: Any, **kwargs: Any):
        w = weight(*args, **kwargs) if callable(weight) else weight
        if ax.size == 1 or not engine_usable():  # torch.func (or nothing to overlap)
            grads, out = plain(*args, **kwargs)
            return reduce_grads(grads, weight=w), out
        args, inputs, specs = detached_inputs(args, argnums)
        nums = check_argnums(argnums)
        params = args[nums[0]] if isinstance(argnums, int) else tuple(args[n] for n in nums)
        consistency.check_call("data_parallel.grad_and_value", ax, params, weighted=w is not None)
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        value, aux = split_output(out, has_aux)

        def layout(leaves: list[torch.Tensor]) -> BucketLayout:
            return BucketLayout.of_partition(partition(leaves, params))

        with Overlap(params, ax, layout, average, reduce_dtype, w,
                     "data_parallel.grad_and_value") as hooks:
            if value.requires_grad:
                torch.autograd.backward(value, inputs=inputs)
            for leaf in inputs:  # not reached by the backward: zeros, as torch.func gives
                if leaf.grad is None:
                    leaf.grad = torch.zeros_like(leaf)
            hooks.grads()  # the .grad of every input, averaged in place
        return results([leaf.grad for leaf in inputs], specs, argnums, value, aux, has_aux)

    return call
