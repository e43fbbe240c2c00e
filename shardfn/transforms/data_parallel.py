"""`data_parallel`: gradient averaging over a data-parallel axis (the DDP baseline).

Two ways to use it, the same communication either way:

* **Pure step** (``torch.func``): ``grads = dp.reduce_grads(grads)`` averages a
  gradient tree over ``axis`` and returns a new tree (with ``donate=True`` it
  averages in place in the tree it was given, which is then dead).
* **Autograd step**: ``with dp.overlap(params) as sync: loss.backward()`` hooks
  every parameter; as soon as all gradients of a bucket have been accumulated,
  that bucket's reduction starts while backward goes on (DDP's overlap), and
  the ``.grad`` fields are averaged **in place**. ``sync.grads()`` waits and
  returns the tree of those ``.grad`` tensors: no second copy of the gradients
  exists (16 bytes per parameter with Adam, like DDP). Buckets are formed in
  reverse tree order, the order in which backward usually produces gradients.

How a bucket is averaged: its leaves, laid end to end, are cut into ``N`` even
blocks (see :mod:`shardfn.primitives.piece_exchange`); each rank receives every
other rank's values of its own block and sums them in place (a reduce-scatter), then
sends its summed block to the others, who write it in place (an all-gather).
The messages read and write the gradient tensors themselves: no flat copy is
made. On gloo this is as fast as ``dist.all_reduce`` on a flat buffer, without
the two copies that buffer costs.

Gradients that are already reduced over the axis are refused with a ``ValueError``
naming the leaf: ``sf.shard_params``' gradients are this rank's shard of the mean over
its axis, and averaging them again would mix different ranks' shards (see
:mod:`shardfn.primitives.reduced`; no cost while no such gradient exists).

Communication per step: ``2 Psi (N-1)/N`` bytes per rank (recorded as one
``psum`` per bucket). Memory: the gradients only (in place), plus the received
values of the buckets in flight (``(N-1)/N`` of a bucket each).

Example:
    >>> dp = sf.data_parallel(mesh, "dp")
    >>> grads = dp.reduce_grads(torch.func.grad(loss)(params, local_batch))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh
from shardfn.optim.donation import writable_in_place
from shardfn.primitives import _comm, consistency, stats
from shardfn.primitives._compiled import tracing
from shardfn.primitives.buckets import (
    DEFAULT_BUCKET_BYTES,
    IN_FLIGHT,
    BucketSchedule,
    by_bytes,
    gather_tag,
    reduce_tag,
)
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
from shardfn.primitives.reduced import check_not_reduced
from shardfn.transforms.precision import Precision

__all__ = ["DataParallel", "data_parallel"]


class DataParallel(NamedTuple):
    """Gradient averaging over a mesh axis.

    Attributes:
        reduce_grads: ``reduce_grads(grads, *, weight=None) -> averaged grads``; the mean
            of the per-rank gradients, which is the full-batch gradient only for equal
            per-rank batches; ``weight`` (this rank's number of examples) makes it the
            exact weighted mean ``sum_r w_r g_r / sum_r w_r``.
        overlap: ``overlap(params, *, weight=None)`` context manager for autograd steps.
    """

    reduce_grads: Callable
    overlap: Callable


def data_parallel(mesh: Mesh, axis: AxisName = "dp", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  average: bool = True, precision: Precision | None = None,
                  donate: bool = False) -> DataParallel:
    """Average gradients over ``axis`` in buckets (DDP semantics).

    Args:
        mesh: the mesh.
        axis: the data-parallel axis (or tuple of axes).
        bucket_bytes: bytes per bucket (one reduction each).
        average: divide the sum by the axis size (mean over ranks).
        precision: its ``reduce_dtype`` (if set) is the dtype gradients are
            summed in; results come back in each gradient's own dtype.
        donate: ``reduce_grads`` may average in place in the gradient tensors it is
            given (they are dead after the call; it returns them). Without it they
            are left untouched and new tensors are returned. Leaves that cannot be
            written safely (sharing memory, ``torch.func``-wrapped, needing a dtype
            cast) are copied either way.

    Returns:
        A :class:`DataParallel`.

    Example:
        >>> dp = sf.data_parallel(mesh, "dp", bucket_bytes=2**20, donate=True)
        >>> grads = dp.reduce_grads(grads)           # the tree passed in is now dead
    """
    ax = _comm.resolve(axis, mesh)
    reduce_dtype = precision.reduce_dtype if precision is not None else None
    plans: dict = {}

    def plan(leaves: Sequence[torch.Tensor], tree) -> FlatPartition:
        key = (pytree.tree_structure(tree), tuple(x.shape for x in leaves),
               tuple(x.dtype for x in leaves))
        if key not in plans:
            itemsize = leaves[0].element_size() if leaves else 4
            if len(plans) > 16:
                plans.clear()
            plans[key] = FlatPartition.of(tree, ax.size, ax.index, max(1, bucket_bytes // itemsize))
        return plans[key]

    def reduce_grads(grads, *, weight: float | torch.Tensor | None = None):
        """Average ``grads`` over the axis (a new tree unless ``donate``).

        Args:
            grads: this rank's gradient tree (floating leaves are reduced; integer and
                bool leaves are frozen and come back unchanged).
            weight: this rank's number of examples (a number or 0-dim tensor), for
                unequal per-rank batches: the result is ``sum_r w_r g_r / sum_r w_r``,
                the full-batch gradient of a mean loss (one extra scalar all-reduce).
                None: the plain mean of the per-rank gradients, which is the full-batch
                gradient only when every rank has the same number of examples.
        """
        consistency.check_call("data_parallel.reduce_grads", ax, grads,
                               weighted=weight is not None)
        leaves, treedef = pytree.tree_flatten(grads)
        names = None
        for i, g in enumerate(leaves):
            if not isinstance(g, torch.Tensor):
                names = names or pytree.tree_paths(grads)
                raise TypeError(f"reduce_grads: gradient leaf {names[i]!r} is a "
                                f"{type(g).__name__}, expected a torch.Tensor")
        if weight is not None and not average:
            raise ValueError("reduce_grads(weight=...) gives a weighted mean; it needs "
                             "data_parallel(..., average=True)")
        # shard_params' gradients are reduced over its axis already (at every size)
        check_not_reduced("data_parallel.reduce_grads", leaves,
                          lambda: pytree.tree_paths(grads), ax)
        if ax.size == 1:
            if weight is not None:  # validated here too: the same errors at every size
                weight_share(weight, ax, _device_of(leaves))
            return grads
        live = [i for i, g in enumerate(leaves) if g.is_floating_point() or g.is_complex()]
        sub = leaves if len(live) == len(leaves) else [leaves[i] for i in live]
        if tracing():  # torch.compile: collectives it can trace, no in-place piece exchange
            if weight is not None:
                raise ValueError("data_parallel.reduce_grads(weight=...) is eager-only: its "
                                 "share is a Python number; in a compiled step scale the "
                                 "loss by the share instead")
            out = list(leaves)
            for i, g in zip(live, _average_traced(sub, ax, average, reduce_dtype, bucket_bytes),
                            strict=True):
                out[i] = g
            return pytree.tree_unflatten(treedef, out)
        part = plan(sub, grads if sub is leaves else sub)
        work = _working_copies(sub, reduce_dtype, donate)
        flats = [w.view(-1) for w in work]
        share = None if weight is None else weight_share(weight, ax, _device_of(sub))
        divide = _prescale(flats, ax, average, share)
        _average_in_place(part.plans, flats, ax, divide)
        out = list(leaves)  # frozen (non-floating) leaves come back as they are
        for w, i in zip(work, live, strict=True):
            g = leaves[i]
            out[i] = g if w is g else w.view(g.shape).to(g.dtype)
        return pytree.tree_unflatten(treedef, out)

    def overlap(params, *, weight: float | torch.Tensor | None = None) -> _Overlap:
        if weight is not None and not average:
            raise ValueError("overlap(weight=...) gives a weighted mean; it needs "
                             "data_parallel(..., average=True)")
        return _Overlap(params, ax, bucket_bytes, average, reduce_dtype, weight)

    return DataParallel(reduce_grads, overlap)


def _average_traced(leaves: Sequence[torch.Tensor], ax, average: bool,
                    reduce_dtype: torch.dtype | None, bucket_bytes: int) -> list[torch.Tensor]:
    """The eager arithmetic with traceable collectives (for ``torch.compile``): each bucket
    (consecutive leaves of one dtype, up to ``bucket_bytes``) laid end to end, prescaled as
    :func:`_prescale` does, summed by one all-reduce, divided, cut back into the leaves."""
    work = [g.detach().to(reduce_dtype or g.dtype) for g in leaves]
    buckets: list[list[int]] = []
    size = 0
    for i, w in enumerate(work):
        nbytes = w.numel() * w.element_size()
        if not buckets or w.dtype != work[buckets[-1][0]].dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    out: list[torch.Tensor] = list(leaves)
    for members in buckets:
        pre, post = divide_factors(ax.size, work[members[0]].dtype) if average else (1, None)
        flat = torch.cat([work[i].reshape(-1) for i in members])
        if pre != 1:
            flat = flat / pre
        flat = _comm.psum(flat, ax)
        if post is not None and post != 1:
            flat = flat / post
        for i, piece in zip(members, flat.split([work[i].numel() for i in members]),
                            strict=True):
            out[i] = piece.view(leaves[i].shape).to(leaves[i].dtype)
    return out


def _working_copies(leaves: Sequence[torch.Tensor], reduce_dtype: torch.dtype | None,
                    donate: bool) -> list[torch.Tensor]:
    """The contiguous tensors to average in place: the leaves themselves when donated and
    safe to write, else copies (in ``reduce_dtype`` if set)."""
    in_place = donate and writable_in_place(leaves)
    out = []
    for g in leaves:
        dtype = reduce_dtype or g.dtype
        if in_place and dtype == g.dtype and g.is_contiguous():
            out.append(g)
        else:
            out.append(g.detach().to(dtype=dtype, memory_format=torch.contiguous_format,
                                     copy=True))
    return out


def _device_of(leaves: Sequence[torch.Tensor]) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")


def _prescale(flats: Sequence[torch.Tensor], ax, average: bool, share: float | None
              ) -> int | list[float] | None:
    """Scale ``flats`` in place before their sum-reduction; what to divide the sums by after.

    With a ``share`` (weighted mean) each rank multiplies by its share and the sums are
    the result. Otherwise low-precision leaves are divided by FSDP2's ``pre`` factor now
    and by ``post`` after (a mean that fits in fp16 then does not overflow on the way);
    float32 leaves are divided by the axis size once, after the sum.

    Returns:
        None (nothing to divide), the axis size, or one divisor per leaf.
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


def _average_in_place(plans: Sequence[BucketPlan], flats: Sequence[torch.Tensor], ax,
                      divide: Any) -> None:
    """Sum (and divide) every bucket over ``ax``, in place in ``flats``."""
    scatters = []
    for b, plan in enumerate(plans):
        stats.record(ax.key, "psum", 2 * plan.nbytes(flats) * (ax.size - 1) / ax.size)
        scatters.append(start_reduce_scatter(plan, flats, ax, tag=reduce_tag(b), what="psum"))
    gathers = []
    for b, (plan, exchange) in enumerate(zip(plans, scatters, strict=True)):
        gathers.append(_second_half(plan, flats, exchange, ax, divide, tag=gather_tag(b)))
    for exchange in gathers:
        exchange.wait()


def _second_half(plan: BucketPlan, flats: Sequence[torch.Tensor], exchange: Exchange, ax,
                 divide: Any, tag: int) -> Exchange:
    """Finish a bucket's reduce-scatter in place and start its all-gather.

    ``divide``: None, one divisor for every sum, or a list with one per leaf."""
    own = [flats[leaf][lo:hi] for leaf, lo, hi in plan.blocks[ax.index]]
    if isinstance(divide, list):
        divide = piece_divisors(plan, ax.index, divide)
    finish_reduce_scatter(plan, flats, exchange, ax, own, divide)
    return start_all_gather(plan, own, flats, ax, tag=tag, what="psum")


class _Overlap(GradHooks):
    """Hooks that average gradient buckets in place as backward produces them.

    A bucket is launched (prescaled, its reduce-scatter started) once all its gradients
    are there; settling it (finishing the sum, starting its all-gather) waits until the
    next bucket is launched, so one reduce-scatter and the all-gathers are in flight.
    """

    def __init__(self, params, ax, bucket_bytes: int, average: bool,
                 reduce_dtype: torch.dtype | None, weight: float | torch.Tensor | None = None):
        super().__init__(params)
        self.ax, self.average, self.reduce_dtype = ax, average, reduce_dtype
        self.weight = weight
        self.members = by_bytes(self.leaves, bucket_bytes)
        self.plans = [BucketPlan.of([(i, 0, self.leaves[i].numel()) for i in m], ax.size)
                      for m in self.members]
        # buckets are launched in index order, the same on every rank; settling a bucket
        # starts its all-gather, so one fewer reduce-scatter stays unsettled
        self.schedule = BucketSchedule(self.members, range(len(self.members)), IN_FLIGHT - 1,
                                       self._launch, self._settle)
        self.scatters: dict[int, Exchange] = {}
        self.gathers: dict[int, Exchange] = {}

    def __enter__(self) -> _Overlap:
        self._drain()  # a block whose grads() was never called
        self.schedule.start()
        self.flats: list[torch.Tensor | None] = [None] * len(self.leaves)
        self.divides: dict[int, Any] = {}
        self.share = None  # this rank's weight / total weight (one scalar psum, before backward)
        if self.weight is not None:
            self.share = weight_share(self.weight, self.ax, _device_of(self.leaves))
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
        check_not_reduced("data_parallel.overlap", [self.leaves[i].grad for i in members],
                          lambda: [self.names[i] for i in members], self.ax)
        for i in self.members[b]:
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
        # scaled in place before the sum: the .grad is averaged in place anyway
        self.divides[b] = _prescale([self.flats[i] for i in self.members[b]], self.ax,
                                    self.average, self.share)
        if isinstance(self.divides[b], list):  # per member: index by leaf number
            posts = dict(zip(self.members[b], self.divides[b], strict=True))
            self.divides[b] = [posts.get(i, 1.0) for i in range(len(self.leaves))]
        plan = self.plans[b]
        stats.record(self.ax.key, "psum",
                     2 * plan.nbytes(self.flats) * (self.ax.size - 1) / self.ax.size)
        self.scatters[b] = start_reduce_scatter(plan, self.flats, self.ax, tag=reduce_tag(b),
                                                what="psum")

    def _settle(self, b: int) -> None:
        if b not in self.scatters:  # an axis of size 1: nothing was sent
            return
        exchange = self.scatters.pop(b)
        self.gathers[b] = _second_half(self.plans[b], self.flats, exchange, self.ax,
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
