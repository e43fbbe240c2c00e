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

The buckets move with the *piece exchange* of
:mod:`shardfn.primitives.piece_exchange`: point-to-point messages that read
from and write to the leaves themselves, so no flat copy of the tree is made
and padding is never sent. :attr:`FlatPartition.plans` gives every bucket's
:class:`~shardfn.primitives.piece_exchange.BucketPlan`.

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

from shardfn import pytree
from shardfn._torch_internals import c10d_functional as _ops
from shardfn.primitives import _comm, stats
from shardfn.primitives._comm import Axis
from shardfn.primitives.piece_exchange import BucketPlan
from shardfn.primitives.reduce_scaling import divide_factors

__all__ = ["FlatPartition", "all_reduce_async", "leaf_divide_factors", "piece_divisors",
           "weight_share"]

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
        dtype: the dtype of the first leaf (part of the tree's fingerprint).
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
        leaves, treedef = pytree.tree_flatten(tree)  # its own treedef: one made in traced code
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
        return pytree.tree_unflatten(treedef, out)

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

