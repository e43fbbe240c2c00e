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

All buckets' collectives are issued before any is waited on, so they overlap.

Example:
    >>> part = FlatPartition.of({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, 1, 0)
    >>> part.local({"w": torch.ones(3, 2), "b": torch.ones(3)})["w"].shape
    torch.Size([6])
"""

from __future__ import annotations

import dataclasses
import math

import torch

from shardfn import pytree
from shardfn.primitives import stats
from shardfn.primitives._comm import Axis

__all__ = ["FlatPartition", "all_reduce_async"]

_ops = torch.ops._c10d_functional


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

    def reduce_scatter_bucket(self, block: torch.Tensor, ax: Axis) -> torch.Tensor:
        """Issue the reduce-scatter of one padded bucket; pass the result to :meth:`wait`."""
        if ax.size == 1:
            return block.clone()
        stats.record(ax.key, "psum_scatter", _bytes(block) * (ax.size - 1) / ax.size)
        return _ops.reduce_scatter_tensor(block.contiguous(), "sum", ax.size, ax.group_name)

    def wait(self, handle: torch.Tensor) -> torch.Tensor:
        """Wait for a collective issued by this class (a no-op for a 1-rank axis)."""
        return _ops.wait_tensor(handle) if self.size > 1 else handle

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


def _bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _device(leaves) -> torch.device:
    return leaves[0].device if leaves else torch.device("cpu")
