"""Flat partitions: a tree of tensors laid end to end and split evenly over an axis.

This is how ZeRO lays out what it shards. The leaves (flattened, in tree
order) form one flat vector of ``T`` elements, cut into buckets of at most
``bucket_numel`` elements. Each bucket is padded to a multiple of the axis size
``N`` and split evenly: rank ``i`` owns the ``i``-th ``1/N`` of every bucket.
Ownership is balanced to within ``N - 1`` padding elements per bucket whatever
the leaf sizes (unlike a greedy whole-tensor assignment, where one large tensor
leaves ranks uneven), and each bucket is one contiguous reduce-scatter /
all-gather.

A rank's part of the tree is itself a tree with the same structure: each leaf
is the 1-D concatenation of the pieces of that leaf the rank owns (possibly
empty). Optimizer transforms, masks and labels written for the full tree apply
unchanged to it.

Two ways to move the buckets:

* The ``reduce_scatter`` / ``all_gather`` / ``all_reduce`` methods run the
  ``_c10d_functional`` collectives on padded flat buffers (:meth:`flatten`
  copies the tree in, :meth:`unflatten` out); all buckets are issued before any
  is waited on.
* The *piece exchange* (:class:`BucketPlan`, :func:`start_reduce_scatter`,
  :func:`start_all_gather`) moves the same blocks with point-to-point sends and
  receives that read from and write to the leaves themselves, one message per
  piece of a leaf inside a block: no flat copy of the tree is ever made, and
  padding is never sent. This is what ``data_parallel`` and ``shard_opt_state``
  use. On gloo it is also faster than the collectives (torch 2.13, 2 CPU ranks,
  65 MiB: reduce-scatter 23 ms against 67 ms for ``reduce_scatter_tensor``,
  all-gather 13 ms against 40 ms for ``all_gather_into_tensor``), which copy
  through internal buffers. These calls use plain ``torch.distributed`` and are
  not differentiable: they are for gradient and optimizer paths outside any
  autograd graph.

Example:
    >>> part = FlatPartition.of({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, 1, 0)
    >>> part.local({"w": torch.ones(3, 2), "b": torch.ones(3)})["w"].shape
    torch.Size([6])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardfn import pytree
from shardfn._torch_internals import c10d_functional as _ops
from shardfn.primitives import _comm, stats
from shardfn.primitives._comm import Axis
from shardfn.primitives._poster import Posting, submit
from shardfn.primitives.reduce_scaling import divide_factors

__all__ = [
    "BucketPlan",
    "Exchange",
    "FlatPartition",
    "all_reduce_async",
    "leaf_divide_factors",
    "piece_divisors",
    "finish_reduce_scatter",
    "start_all_gather",
    "start_reduce_scatter",
    "weight_share",
]

Piece = tuple[int, int, int]
"""``(leaf, lo, hi)``: the flattened elements ``[lo, hi)`` of leaf number ``leaf``."""


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """One bucket: segments of leaves laid end to end, split into ``size`` even blocks.

    Block ``j`` (owned by axis index ``j``) is the elements ``[j * block, (j + 1) * block)``
    of the bucket; the last blocks are short (or empty) when the length is not a
    multiple of ``size``, which is the padding the flat buffers carry.

    Attributes:
        size: ranks on the axis ``N``.
        length: real elements in the bucket.
        block: elements per block, ``ceil(length / N)`` (at least 1).
        blocks: ``blocks[j]``: the pieces of leaves block ``j`` covers, in bucket order.
    """

    size: int
    length: int
    block: int
    blocks: tuple[tuple[Piece, ...], ...]

    @staticmethod
    def of(segments: Sequence[Piece], size: int) -> BucketPlan:
        """Plan a bucket made of ``segments`` (in order) over ``size`` ranks.

        Args:
            segments: ``(leaf, lo, hi)`` ranges laid end to end.
            size: ranks on the axis.

        Example:
            >>> BucketPlan.of([(0, 0, 3), (1, 0, 2)], 2).blocks
            (((0, 0, 3),), ((1, 0, 2),))
        """
        length = sum(hi - lo for _, lo, hi in segments)
        block = max(1, math.ceil(length / size))
        blocks = []
        for j in range(size):
            start, stop = min(j * block, length), min((j + 1) * block, length)
            pieces, at = [], 0
            for leaf, lo, hi in segments:
                a, b = max(start, at), min(stop, at + hi - lo)
                if a < b:
                    pieces.append((leaf, lo + a - at, lo + b - at))
                at += hi - lo
            blocks.append(tuple(pieces))
        return BucketPlan(size, length, block, tuple(blocks))

    def nbytes(self, flats: Sequence[torch.Tensor]) -> int:
        """Bytes of the bucket's real elements, reading the leaves' dtypes from ``flats``."""
        return sum((hi - lo) * flats[leaf].element_size()
                   for pieces in self.blocks for leaf, lo, hi in pieces)


@dataclasses.dataclass(frozen=True)
class FlatPartition:
    """Where every leaf of a tree lies in the flat vector, and what this rank owns.

    Attributes:
        names: dotted leaf names in tree order.
        shapes: leaf shapes.
        offsets: start of each leaf in the (unpadded) flat vector.
        total: number of real elements ``T``.
        size: ranks on the axis ``N``.
        index: this rank's index ``i``.
        buckets: ``(start, stop)`` of each bucket in the unpadded flat vector.
        treedef: the tree structure.
        dtype: the dtype of the flat buffers (that of the first leaf).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int
    size: int
    index: int
    buckets: tuple[tuple[int, int], ...]
    treedef: object
    dtype: torch.dtype

    @staticmethod
    def of(tree, size: int, index: int, bucket_numel: int | None = None) -> FlatPartition:
        """Plan the flat partition of ``tree`` over ``size`` ranks, seen from ``index``.

        Args:
            tree: a pytree of tensors (only shapes and the first dtype are used).
            size: number of ranks on the axis.
            index: this rank's index on the axis.
            bucket_numel: most real elements per bucket (None: one bucket).

        Returns:
            The plan.
        """
        names, leaves, treedef = pytree.tree_flatten_with_path(tree)
        shapes = tuple(tuple(x.shape) for x in leaves)
        sizes = [math.prod(s) for s in shapes]
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        total = sum(sizes)
        step = max(1, bucket_numel or total or 1)
        buckets = tuple((s, min(s + step, total)) for s in range(0, total, step)) or ((0, 0),)
        dtype = leaves[0].dtype if leaves else torch.float32
        return FlatPartition(tuple(names), shapes, offsets, total, size, index, buckets, treedef,
                             dtype)

    # ---- ownership -----------------------------------------------------------------
    def block(self, bucket: int) -> int:
        """Elements per rank in ``bucket`` (``ceil(len / N)``, at least 1)."""
        start, stop = self.buckets[bucket]
        return max(1, math.ceil((stop - start) / self.size))

    @property
    def chunk(self) -> int:
        """Elements in this rank's flat chunk, padding included (same on every rank)."""
        return sum(self.block(b) for b in range(len(self.buckets)))

    def owned(self, index: int | None = None) -> list[tuple[int, int]]:
        """Per bucket, the ``[start, stop)`` of real flat elements rank ``index`` owns."""
        i = self.index if index is None else index
        out = []
        for b, (start, stop) in enumerate(self.buckets):
            k = self.block(b)
            lo, hi = min(start + i * k, stop), min(start + (i + 1) * k, stop)
            out.append((lo, hi))
        return out

    def pieces(self, index: int | None = None) -> list[list[tuple[int, int]]]:
        """For each leaf, the ``[start, stop)`` ranges of its flattened elements owned."""
        owned = self.owned(index)
        out = []
        for offset, shape in zip(self.offsets, self.shapes, strict=True):
            end = offset + math.prod(shape)
            mine = []
            for lo, hi in owned:
                a, b = max(lo, offset), min(hi, end)
                if a < b:
                    mine.append((a - offset, b - offset))
            out.append(mine)
        return out

    def local_numel(self) -> int:
        """Real (unpadded) elements this rank owns."""
        return sum(hi - lo for lo, hi in self.owned())

    # ---- piece geometry (cached) ------------------------------------------------------
    @functools.cached_property
    def plans(self) -> tuple[BucketPlan, ...]:
        """Every bucket's :class:`BucketPlan` (the same blocks as :meth:`owned`)."""
        sizes = [math.prod(s) for s in self.shapes]
        plans = []
        for start, stop in self.buckets:
            segments = []
            for leaf, (offset, n) in enumerate(zip(self.offsets, sizes, strict=True)):
                a, b = max(start, offset), min(stop, offset + n)
                if a < b:
                    segments.append((leaf, a - offset, b - offset))
            plans.append(BucketPlan.of(segments, self.size))
        return tuple(plans)

    @functools.cached_property
    def local_sizes(self) -> tuple[int, ...]:
        """Elements of every leaf's local part (what :meth:`local` returns)."""
        return tuple(sum(b - a for a, b in ranges) for ranges in self.pieces())

    @functools.cached_property
    def local_slots(self) -> tuple[tuple[int, ...], ...]:
        """``local_slots[b][p]``: where this rank's piece ``p`` of bucket ``b`` starts in its
        leaf's local part."""
        filled = [0] * len(self.shapes)
        slots = []
        for plan in self.plans:
            mine = []
            for leaf, lo, hi in plan.blocks[self.index]:
                mine.append(filled[leaf])
                filled[leaf] += hi - lo
            slots.append(tuple(mine))
        return tuple(slots)

    def local_views(self, local_leaves: Sequence[torch.Tensor], bucket: int) -> list[torch.Tensor]:
        """Views of this rank's pieces of ``bucket`` inside the local leaves (1-D each)."""
        plan = self.plans[bucket]
        return [local_leaves[leaf][at:at + hi - lo] for (leaf, lo, hi), at
                in zip(plan.blocks[self.index], self.local_slots[bucket], strict=True)]

    def local(self, tree):
        """This rank's 1-D part of every leaf of the full ``tree``."""
        leaves = pytree.tree_leaves(tree)
        self._check(leaves)
        out = []
        for x, ranges in zip(leaves, self.pieces(), strict=True):
            flat = x.reshape(-1)
            if len(ranges) == 1:
                out.append(flat[ranges[0][0]:ranges[0][1]])
            elif not ranges:
                out.append(flat[:0])
            else:
                out.append(torch.cat([flat[a:b] for a, b in ranges]))
        return pytree.tree_unflatten(self.treedef, out)

    # ---- flat buffers --------------------------------------------------------------
    def flatten(self, tree, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The padded flat vector (``N * chunk`` elements) of the full ``tree``.

        Args:
            tree: a tree with the planned structure and shapes.
            dtype: the buffer's dtype (default: the plan's).
        """
        dtype = dtype or self.dtype
        leaves = pytree.tree_leaves(tree)
        self._check(leaves)
        real = torch.cat([x.reshape(-1).to(dtype) for x in leaves]) if leaves else \
            torch.zeros(0, dtype=dtype)
        parts = []
        for b, (start, stop) in enumerate(self.buckets):
            parts.append(real[start:stop])
            pad = self.size * self.block(b) - (stop - start)
            if pad:
                parts.append(real.new_zeros(pad))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def unflatten(self, flat: torch.Tensor):
        """Inverse of :meth:`flatten` (padding dropped)."""
        parts, at = [], 0
        for b, (start, stop) in enumerate(self.buckets):
            parts.append(flat[at:at + stop - start])
            at += self.size * self.block(b)
        real = torch.cat(parts) if len(parts) > 1 else parts[0]
        leaves = [real[o:o + math.prod(s)].view(s)
                  for o, s in zip(self.offsets, self.shapes, strict=True)]
        return pytree.tree_unflatten(self.treedef, leaves)

    def flatten_local(self, tree) -> torch.Tensor:
        """This rank's padded chunk from its local part (as :meth:`local` returns)."""
        leaves = pytree.tree_leaves(tree)
        real = torch.cat([x.reshape(-1).to(self.dtype) for x in leaves]) if leaves else \
            torch.zeros(0, dtype=self.dtype)
        parts, at = [], 0
        for b, (lo, hi) in enumerate(self.owned()):
            parts.append(real[at:at + hi - lo])
            at += hi - lo
            pad = self.block(b) - (hi - lo)
            if pad:
                parts.append(real.new_zeros(pad))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def unflatten_local(self, chunk: torch.Tensor):
        """Split this rank's padded chunk back into its local part (a tree of 1-D pieces)."""
        parts, at = [], 0
        for b, (lo, hi) in enumerate(self.owned()):
            parts.append(chunk[at:at + hi - lo])
            at += self.block(b)
        real = torch.cat(parts) if len(parts) > 1 else parts[0]
        out, at = [], 0
        for ranges in self.pieces():
            n = sum(b - a for a, b in ranges)
            out.append(real[at:at + n])
            at += n
        return pytree.tree_unflatten(self.treedef, out)

    # ---- bucketed collectives ----------------------------------------------------------
    def reduce_scatter(self, flat: torch.Tensor, ax: Axis) -> torch.Tensor:
        """Sum the padded ``flat`` over the axis; return this rank's chunk of the sum."""
        if ax.size == 1:
            return flat.clone()
        handles, at = [], 0
        with stats.collective_scope(ax.describe("psum_scatter (flat buckets)")):
            for b in range(len(self.buckets)):
                n = self.size * self.block(b)
                block = flat[at:at + n]
                at += n
                stats.record(ax.key, "psum_scatter", _bytes(block) * (ax.size - 1) / ax.size)
                handles.append(_ops.reduce_scatter_tensor(block, "sum", ax.size, ax.group_name))
            outs = [_ops.wait_tensor(h) for h in handles]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def all_gather(self, chunk: torch.Tensor, ax: Axis) -> torch.Tensor:
        """Gather every rank's chunk into the padded flat vector."""
        if ax.size == 1:
            return chunk.clone()
        handles, at = [], 0
        with stats.collective_scope(ax.describe("all_gather (flat buckets)")):
            for b in range(len(self.buckets)):
                block = chunk[at:at + self.block(b)]
                at += self.block(b)
                stats.record(ax.key, "all_gather", _bytes(block) * (ax.size - 1))
                handles.append(_ops.all_gather_into_tensor(block, ax.size, ax.group_name))
            outs = [_ops.wait_tensor(h) for h in handles]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def all_reduce(self, flat: torch.Tensor, ax: Axis) -> torch.Tensor:
        """Sum the padded ``flat`` over the axis, bucket by bucket (plan with ``size=1``)."""
        if ax.size == 1:
            return flat.clone()
        handles, at = [], 0
        with stats.collective_scope(ax.describe("psum (flat buckets)")):
            for b in range(len(self.buckets)):
                n = self.size * self.block(b)
                handles.append(all_reduce_async(flat[at:at + n], ax))
                at += n
            outs = [_ops.wait_tensor(h) for h in handles]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _check(self, leaves) -> None:
        shapes = tuple(tuple(x.shape) for x in leaves)
        if shapes != self.shapes:
            for name, got, want in zip(self.names, shapes, self.shapes, strict=False):
                if got != want:
                    raise ValueError(f"leaf {name!r} has shape {got}, the partition was planned "
                                     f"for {want}")
            raise ValueError(f"tree has {len(shapes)} leaves, the partition was planned for "
                             f"{len(self.shapes)} ({list(self.names)[:10]})")


def all_reduce_async(block: torch.Tensor, ax: Axis) -> torch.Tensor:
    """Issue a sum all-reduce of ``block`` over ``ax``; pass the result to ``wait_tensor``."""
    stats.record(ax.key, "psum", 2 * _bytes(block) * (ax.size - 1) / ax.size)
    return _ops.all_reduce(block.contiguous(), "sum", ax.group_name)


def leaf_divide_factors(dtypes: Sequence[torch.dtype], count: int
                        ) -> tuple[list[float], list[float]] | None:
    """Per leaf, FSDP2's ``(pre, post)`` divisors for a mean over ``count`` ranks.

    A low-precision (fp16/bf16) leaf is divided by ``pre`` before its sum-reduction and
    by ``post`` after it, so that a mean that fits in the dtype does not overflow on the
    way (see :mod:`shardfn.primitives.reduce_scaling`).

    Args:
        dtypes: the dtype each leaf is reduced in.
        count: ranks whose values are summed.

    Returns:
        ``(pres, posts)``, one entry per leaf, or None when no leaf needs a ``pre``
        division (float32/float64 only): then one division by ``count`` after the sum
        is what to do, as before.

    Example:
        >>> leaf_divide_factors([torch.float32, torch.float16], 2)
        ([1.0, 2.0], [2.0, 1.0])
    """
    factors = [divide_factors(count, dtype) for dtype in dtypes]
    if all(pre == 1 for pre, _ in factors):
        return None
    return [pre for pre, _ in factors], [post for _, post in factors]


def piece_divisors(plan: BucketPlan, index: int, posts: Sequence[float]) -> list[float]:
    """The ``post`` divisor of every piece of block ``index`` (for ``finish_reduce_scatter``)."""
    return [posts[leaf] for leaf, _, _ in plan.blocks[index]]


def weight_share(weight: float | torch.Tensor, ax, device: torch.device) -> float:
    """This rank's ``weight / sum of every rank's weight`` over ``ax`` (one scalar psum).

    Args:
        weight: this rank's number of examples: a finite number >= 0, or a 0-dim tensor.
        ax: the resolved axis.
        device: where the psum runs (the gradients' device).

    Returns:
        The share as a Python float (the same sum on every rank).

    Raises:
        ValueError: on every rank, naming the ranks whose weight is negative, not finite or
            not a scalar, or when all weights are zero.

    Example:
        >>> weight_share(3, ax, torch.device("cpu"))   # ranks with 3 and 5 examples: 0.375
    """
    bad = 0.0
    try:
        value = float(weight.detach().reshape(())) if isinstance(weight, torch.Tensor) \
            else float(weight)
        if isinstance(weight, bool) or not math.isfinite(value) or value < 0:
            raise ValueError
    except (TypeError, ValueError, RuntimeError):
        value, bad = 0.0, 1.0
    mine = torch.zeros(2 * ax.size, dtype=torch.float64, device=device)
    mine[ax.index], mine[ax.size + ax.index] = value, bad
    everyone = _comm.psum(mine, ax).cpu() if ax.size > 1 else mine.cpu()
    weights, bads = everyone[:ax.size].tolist(), everyone[ax.size:].tolist()
    wrong = [i for i, b in enumerate(bads) if b]
    if wrong:
        raise ValueError(f"weight= must be a finite number >= 0 (this rank's number of examples) "
                         f"on every rank of axis {ax.key!r}; axis indices {wrong} gave something "
                         f"else (this rank, index {ax.index}, gave {weight!r})")
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError(f"weight=: every rank of axis {ax.key!r} gave weight 0 (no examples): "
                         f"the weighted mean is undefined")
    return value / total


def _bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _device(leaves) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")


# ---- piece exchange: p2p collectives that read and write the leaves in place ------------


class Exchange:
    """The sends and receives of one bucket's collective, in flight.

    Every exchange must be waited on, on every rank, even after an error: on
    gloo a receive left pending (its work dropped unwaited) takes a later
    message with the same tag, and the next exchange hangs or reads wrong data.

    Attributes:
        received: for a reduce-scatter, ``received[p]``: the other ranks' values of this
            rank's piece ``p``, one tensor per other rank in axis-index order (empty for
            an all-gather).
    """

    def __init__(self, works: list | Posting, received: list[list[torch.Tensor]],
                 description: str):
        self.works = works  # or a background Posting of them
        self.received = received
        self.description = description

    def wait(self) -> None:
        """Block until every send and receive of this bucket is done."""
        if self.works:
            with stats.collective_scope(self.description):
                works = self.works.wait() if isinstance(self.works, Posting) else self.works
                for work in works:
                    work.wait()
            self.works = []


def _ring(ax: Axis) -> list[int]:
    """The other axis indices, starting after this rank's (spreads the first messages)."""
    return [(ax.index + step) % ax.size for step in range(1, ax.size)]


def _post(ops: list, description: str, received: list[list[torch.Tensor]],
          background: bool = False) -> Exchange:
    if background and ops:
        return Exchange(submit(ops), received, description)
    works = dist.batch_isend_irecv(ops) if ops else []
    return Exchange([w for w in works if w is not None], received, description)


def start_reduce_scatter(plan: BucketPlan, flats: Sequence[torch.Tensor], ax: Axis, *,
                         tag: int = 0, what: str = "psum_scatter",
                         outs: Sequence[torch.Tensor] | None = None,
                         background: bool = False) -> Exchange:
    """Start the reduce-scatter of one bucket: send every other rank its block, read from
    ``flats``, and receive their values of this rank's block.

    Nothing is summed yet: :func:`finish_reduce_scatter` does that once the
    exchange has arrived. Records nothing in the comm stats (the caller does).

    Args:
        plan: the bucket.
        flats: every leaf as a contiguous 1-D tensor (indexed by leaf number).
        ax: the axis (size > 1).
        tag: message tag (distinct per bucket in flight on gloo).
        what: name for hang reports.
        outs: the tensors :func:`finish_reduce_scatter` will write (one per piece of this
            rank's block, not aliasing ``flats``): the first other rank's values are then
            received straight into them, saving a buffer.
        background: post from the background thread (:mod:`._poster`): the caller does
            not stall while the connection is busy with an earlier message.

    Returns:
        The :class:`Exchange` in flight.
    """
    ops = []  # receives first: on gloo that is about 20% faster than sends first
    mine = plan.blocks[ax.index]
    received: list[list[torch.Tensor]] = [[] for _ in mine]
    for j in range(ax.size):
        if j == ax.index:
            continue
        for p, (leaf, lo, hi) in enumerate(mine):
            if outs is not None and not received[p]:
                buf = outs[p]
            else:
                buf = torch.empty(hi - lo, dtype=flats[leaf].dtype, device=flats[leaf].device)
            received[p].append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, group=ax.group, group_peer=j, tag=tag))
    for j in _ring(ax):
        for leaf, lo, hi in plan.blocks[j]:
            ops.append(dist.P2POp(dist.isend, flats[leaf][lo:hi], group=ax.group, group_peer=j,
                                  tag=tag))
    return _post(ops, ax.describe(f"{what} (piece exchange)"), received, background)


def finish_reduce_scatter(plan: BucketPlan, flats: Sequence[torch.Tensor], exchange: Exchange,
                          ax: Axis, outs: Sequence[torch.Tensor],
                          divide_by: float | Sequence[float | None] | None) -> None:
    """Wait for a reduce-scatter and write this rank's summed pieces into ``outs``.

    Each piece is summed as this rank's own values plus the others' in
    axis-index order (with 2 ranks: the same sum whichever rank owns it).

    Args:
        plan: the bucket.
        flats: the leaves the exchange read from (this rank's own values).
        exchange: from :func:`start_reduce_scatter`.
        ax: the axis.
        outs: one 1-D tensor per piece of this rank's block (may be the piece of ``flats``
            itself: the sum is then written in place).
        divide_by: divide the sums by this (the mean over ranks), or None; or one divisor
            (or None) per piece of this rank's block, for buckets whose leaves need different
            ones (the ``post`` factors of :func:`~shardfn.primitives.reduce_scaling.divide_factors`
            for low-precision leaves that were divided by ``pre`` before the exchange).
    """
    exchange.wait()
    per_piece = isinstance(divide_by, (list, tuple))
    for p, ((leaf, lo, hi), out) in enumerate(zip(plan.blocks[ax.index], outs, strict=True)):
        others = exchange.received[p]
        if others[0] is out:  # received in place: a + b == b + a, the same sum
            out.add_(flats[leaf][lo:hi])
        else:
            torch.add(flats[leaf][lo:hi], others[0], out=out)
        for term in others[1:]:
            out.add_(term)
        divisor = divide_by[p] if per_piece else divide_by
        if divisor is not None and divisor != 1:
            out.div_(divisor)
    exchange.received = []


def start_all_gather(plan: BucketPlan, own: Sequence[torch.Tensor],
                     dst_flats: Sequence[torch.Tensor], ax: Axis, *, tag: int = 1,
                     what: str = "all_gather", background: bool = False) -> Exchange:
    """Start the all-gather of one bucket: send this rank's pieces to every other rank and
    receive theirs straight into ``dst_flats``.

    This rank's own pieces are not copied into ``dst_flats`` (the caller does it,
    or they are already there).

    Args:
        plan: the bucket.
        own: the values of this rank's pieces (``plan.blocks[ax.index]``), 1-D each.
        dst_flats: every destination leaf as a contiguous 1-D tensor.
        ax: the axis (size > 1).
        tag: message tag (distinct per bucket in flight on gloo).
        what: name for hang reports.
        background: post from the background thread (see :func:`start_reduce_scatter`).

    Returns:
        The :class:`Exchange` in flight; the destination pieces are valid after ``wait()``.
    """
    ops = []  # receives first (see start_reduce_scatter)
    for j in range(ax.size):
        if j == ax.index:
            continue
        for leaf, lo, hi in plan.blocks[j]:
            ops.append(dist.P2POp(dist.irecv, dst_flats[leaf][lo:hi], group=ax.group,
                                  group_peer=j, tag=tag))
    for j in _ring(ax):
        for value in own:
            ops.append(dist.P2POp(dist.isend, value, group=ax.group, group_peer=j, tag=tag))
    return _post(ops, ax.describe(f"{what} (piece exchange)"), [], background)
