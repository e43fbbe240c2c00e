"""`data_parallel`: gradient averaging over a data-parallel axis (the DDP baseline).

Three ways to use it, the same communication every way:

* **Pure step** (``torch.func``): ``grads = dp.reduce_grads(grads)`` averages a
  gradient tree over ``axis`` and returns a new tree (with ``donate=True`` it
  averages in place in the tree it was given, which is then dead).
* **Pure step, overlapped**: ``grads, loss = dp.grad_and_value(loss_fn)(params,
  batch)`` is ``sf.grad_and_value`` followed by ``reduce_grads``, bitwise, but
  each bucket's reduction starts while the backward goes on (DDP's overlap; see
  :mod:`shardfn.transforms._dp_grad`). Inside ``vmap``/``grad``/``torch.compile``
  it is that composition.
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
from shardfn.primitives.buckets import DEFAULT_BUCKET_BYTES, gather_tag, reduce_tag
from shardfn.primitives.flat import FlatPartition, leaf_divide_factors, weight_share
from shardfn.primitives.piece_exchange import (
    BucketPlan,
    finish_reduce_scatter,
    start_all_gather,
    start_reduce_scatter,
)
from shardfn.primitives.reduce_scaling import divide_factors
from shardfn.primitives.reduced import check_not_reduced
from shardfn.transforms._dp_grad import (
    BucketLayout,
    Overlap,
    Weight,
    device_of,
    overlapped_grad_and_value,
    prescale,
    second_half,
)
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
        grad_and_value: ``grad_and_value(fn, argnums=0, has_aux=False, *, weight=None)``:
            ``sf.grad_and_value(fn, argnums, has_aux)`` whose gradients come back averaged
            (``reduce_grads``, bitwise), the reduction overlapped with the backward.
    """

    reduce_grads: Callable
    overlap: Callable
    grad_and_value: Callable


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
                weight_share(weight, ax, device_of(leaves))
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
        share = None if weight is None else weight_share(weight, ax, device_of(sub))
        if _fresh_output(sub, reduce_dtype, donate, average, share, ax):
            # the sums written straight into new tensors: no copy of the gradients first
            src = [g.detach().contiguous().view(-1) for g in sub]
            flats = [torch.empty_like(f) for f in src]
            _average(part.plans, src, flats, ax, ax.size if average else None)
            work = [f.view(g.shape) for f, g in zip(flats, sub, strict=True)]
        else:
            work = _working_copies(sub, reduce_dtype, donate)
            flats = [w.view(-1) for w in work]
            divide = prescale(flats, ax, average, share)
            _average(part.plans, flats, flats, ax, divide)
        out = list(leaves)  # frozen (non-floating) leaves come back as they are
        for w, i in zip(work, live, strict=True):
            g = leaves[i]
            out[i] = g if w is g else w.view(g.shape).to(g.dtype)
        return pytree.tree_unflatten(treedef, out)

    def overlap(params, *, weight: float | torch.Tensor | None = None) -> Overlap:
        if weight is not None and not average:
            raise ValueError("overlap(weight=...) gives a weighted mean; it needs "
                             "data_parallel(..., average=True)")
        return Overlap(params, ax, lambda leaves: BucketLayout.whole_leaves(
            leaves, bucket_bytes, ax.size), average, reduce_dtype, weight)

    def grad_and_value(fn: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False,
                       *, weight: Weight = None) -> Callable:
        """``sf.grad_and_value(fn, argnums, has_aux)`` then ``reduce_grads``, overlapped.

        Outside any functorch transform and ``torch.compile`` the gradient is a first-order
        autograd backward of fresh leaves (made for the call, dropped after it) with a hook
        on each: every bucket of ``reduce_grads``' plan starts its reduction as soon as
        backward has produced it, and is averaged in place in the fresh gradients. The
        results are bitwise ``reduce_grads(sf.grad_and_value(fn, argnums, has_aux)(...),
        weight=...)``; inside ``vmap``/``grad``/``torch.compile`` it is that composition.

        Args:
            fn: returns a scalar loss (or ``(loss, aux)`` with ``has_aux``).
            argnums: the positional argument(s) to differentiate (trees of float tensors).
            has_aux: ``fn`` returns ``(loss, aux)``.
            weight: this rank's number of examples, as in ``reduce_grads``: a number, a
                0-dim tensor, or a function of the call's arguments returning one
                (``lambda params, batch: len(batch)``); None: the plain mean.

        Returns:
            ``step(*args, **kwargs) -> (averaged grads, loss)`` (``(grads, (loss, aux))``
            with ``has_aux``); the loss is this rank's own.

        Example:
            >>> grads, loss = dp.grad_and_value(loss_fn)(params, local_batch)
        """
        return overlapped_grad_and_value(fn, argnums, has_aux, weight=weight, ax=ax,
                                         average=average, reduce_dtype=reduce_dtype,
                                         partition=plan, reduce_grads=reduce_grads)

    return DataParallel(reduce_grads, overlap, grad_and_value)


def _average_traced(leaves: Sequence[torch.Tensor], ax, average: bool,
                    reduce_dtype: torch.dtype | None, bucket_bytes: int) -> list[torch.Tensor]:
    """The eager arithmetic with traceable collectives (for ``torch.compile``): each bucket
    (consecutive leaves of one dtype, up to ``bucket_bytes``) laid end to end, prescaled as
    :func:`~shardfn.transforms._dp_grad.prescale` does, summed by one all-reduce, divided,
    cut back into the leaves.

    Every bucket's all-reduce is issued before the first wait (``_comm.psum_start``), the
    last bucket first, so inductor's scheduler issues each one as soon as its gradients
    exist, between the backward's matmuls, and waits only before the update reads the
    sums: the reductions run while the rest of the backward does (docs/compile.md,
    "Overlap"). Inductor keeps the collectives in the graph's order (each bucket's sum is
    its own: the order changes no value). With psum (issue and wait back to back) each
    wait came right after its issue and the next collective after that wait."""
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
    issued = []
    for members in reversed(buckets):  # DDP's order: the backward makes the last ones first
        pre, post = divide_factors(ax.size, work[members[0]].dtype) if average else (1, None)
        flat = torch.cat([work[i].reshape(-1) for i in members])
        if pre != 1:
            flat = flat / pre
        issued.append((members, post, _comm.psum_start(flat, ax)))
    out: list[torch.Tensor] = list(leaves)
    for members, post, pending in issued:
        flat = _comm.wait(pending)
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


def _fresh_output(leaves: Sequence[torch.Tensor], reduce_dtype: torch.dtype | None,
                  donate: bool, average: bool, share: float | None, ax) -> bool:
    """Whether the averages can be written straight into new tensors: not averaged in place
    (not donated), and nothing to do before the sum (no weight share, no ``pre`` division
    of low-precision leaves, no dtype cast)."""
    if donate and writable_in_place(leaves):
        return False
    dtypes = [g.dtype for g in leaves]
    return (share is None and all(reduce_dtype in (None, d) for d in dtypes)
            and (not average or leaf_divide_factors(dtypes, ax.size) is None))


def _average(plans: Sequence[BucketPlan], src: Sequence[torch.Tensor],
             dst: Sequence[torch.Tensor], ax, divide: Any) -> None:
    """Sum (and divide) every bucket over ``ax``: read from ``src``, written into ``dst``
    (``dst is src``: in place; else new tensors: this rank's block is summed into them and
    the others' blocks are received into them, ``src`` is left as it was)."""
    in_place = dst is src
    scatters, owns = [], []
    for b, plan in enumerate(plans):
        stats.record(ax.key, "psum", 2 * plan.nbytes(src) * (ax.size - 1) / ax.size)
        own = None if in_place else [dst[leaf][lo:hi] for leaf, lo, hi in plan.blocks[ax.index]]
        owns.append(own)
        scatters.append(start_reduce_scatter(plan, src, ax, tag=reduce_tag(b), what="psum",
                                             outs=own))
    gathers = []
    for b, (plan, exchange, own) in enumerate(zip(plans, scatters, owns, strict=True)):
        if in_place:
            gathers.append(second_half(plan, src, exchange, ax, divide, tag=gather_tag(b)))
        else:  # first received value + own == own + it: the same sums as in place
            finish_reduce_scatter(plan, src, exchange, ax, own, divide)
            gathers.append(start_all_gather(plan, own, dst, ax, tag=gather_tag(b), what="psum"))
    for exchange in gathers:
        exchange.wait()
