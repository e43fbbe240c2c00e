"""Where a rank's local tensor lies in the global tensor: boxes and chunks (pure geometry).

A checkpoint stores every leaf as its *global* tensor, cut into chunks that
torch.distributed.checkpoint (DCP) records with their global offsets. This
module computes, for one rank, the chunks of one leaf and how to find each of
them inside the local tensor:

* a :class:`Box` maps a hyper-rectangle of the local tensor onto one of the
  global tensor (``local_start`` -> ``global_offset``, same ``sizes``); a
  block-sharded leaf (``sf.Layout``) has one box (its padding is outside it),
  a fused tensor-parallel leaf one per part, a replicated leaf one box of its
  whole shape;
* a :class:`Chunk` is what DCP writes and reads: global ``offsets`` and
  ``sizes``, and the recipe of a *view* of the local tensor that holds it
  (:meth:`Chunk.view`), so saving reads and loading writes the local tensor in
  place, and padding never reaches the file.

A flat range of a tensor (the pieces ``shard_opt_state`` keeps of a parameter)
is not a rectangle; :func:`flat_range_rects` cuts it into at most ``2 * ndim - 1``
rectangles, each a contiguous run of the flattened tensor.

Example:
    >>> boxes = block_boxes((5, 3), ((2, 1),))   # dim 0 over 2 ranks, this is index 1
    >>> boxes
    [Box(local_start=(0, 0), global_offset=(3, 0), sizes=(2, 3))]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["Box", "Chunk", "block_boxes", "box_chunks", "flat_range_rects", "fused_boxes",
           "fused_layout_boxes", "piece_chunks", "row_split_boxes"]


class Box(NamedTuple):
    """A hyper-rectangle of the local tensor and the place it holds in the global tensor."""

    local_start: tuple[int, ...]
    global_offset: tuple[int, ...]
    sizes: tuple[int, ...]


class Chunk(NamedTuple):
    """One stored chunk of a leaf: its global place and where it is in the local tensor.

    Attributes:
        offsets: global offsets of the chunk.
        sizes: its sizes.
        flat: ``(start, stop, shape)``: first view ``local.reshape(-1)[start:stop]`` as
            ``shape`` (a flat piece), or None: index the local tensor itself.
        starts: where the chunk starts in that view (per dim).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: tuple[int, int, tuple[int, ...]] | None
    starts: tuple[int, ...]

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The chunk's data as a view of ``local`` (``local`` must be contiguous for a flat
        chunk that is written into)."""
        x = local
        if self.flat is not None:
            start, stop, shape = self.flat
            x = local.reshape(-1)[start:stop].view(shape)
        return x[tuple(slice(s, s + n) for s, n in zip(self.starts, self.sizes, strict=True))]


def block_boxes(shape: Sequence[int], split: Sequence[tuple[int, int] | None]) -> list[Box]:
    """The box of a block-sharded leaf: dim ``d`` split over ``split[d] = (ranks, index)``.

    ``sf.shard``'s rule: blocks of ``ceil(d / ranks)``, the last ones zero-padded; the
    padding lies outside the box. An empty list when this rank holds only padding.
    """
    starts, sizes = [], []
    for dim, d in enumerate(shape):
        part = split[dim] if dim < len(split) else None
        if part is None:
            starts.append(0)
            sizes.append(d)
            continue
        ranks, index = part
        block = math.ceil(d / ranks)
        start = min(index * block, d)
        starts.append(start)
        sizes.append(min(block, d - start))
    if math.prod(shape) > 0 and math.prod(sizes) == 0:
        return []
    return [Box((0,) * len(shape), tuple(starts), tuple(sizes))]


def fused_boxes(shape: Sequence[int], parts: int, ranks: int, index: int,
                dim: int = 0) -> list[Box]:
    """The boxes of a fused leaf (``sf.FusedLayout``): ``parts`` equal parts of dim ``dim``,
    each split over ``ranks``; this rank holds block ``index`` of every part, one after
    another on that dim (dim 0: ``nn.Linear``'s ``[q|k|v]`` rows, dim 1: ``Conv1D``'s columns).

    Example:
        >>> fused_boxes((2, 12), 3, 2, 1, dim=1)[1]
        Box(local_start=(0, 2), global_offset=(0, 6), sizes=(2, 2))
    """
    part_size = shape[dim] // parts
    block = part_size // ranks

    def on_dim(values: Sequence[int], value: int) -> tuple[int, ...]:
        return tuple(value if d == dim else v for d, v in enumerate(values))

    zeros = (0,) * len(shape)
    return [Box(on_dim(zeros, k * block), on_dim(zeros, k * part_size + index * block),
                on_dim(shape, block)) for k in range(parts)]


def fused_layout_boxes(layout, mesh) -> list[Box]:
    """:func:`fused_boxes` of this rank under an ``sf.FusedLayout`` on ``mesh``."""
    return fused_boxes(layout.shape, layout.parts, mesh.size(layout.axis),
                       mesh.index(layout.axis), layout.dim)


def row_split_boxes(boxes: Sequence[Box], rows: int, ranks: int, index: int) -> list[Box]:
    """The boxes of block ``index`` of dim 0 of a tensor laid out by ``boxes``, split over
    ``ranks`` by ``sf.shard``'s rule (blocks of ``ceil(rows / ranks)``, zero-padded).

    A split of a split: FSDP over dp of a tensor-parallel shard (``FsdpTpLayout``).
    ``boxes`` place the ``rows``-row tensor in the global one; the result places this
    rank's block (its rows ``[index * block, ...)``, local row 0 at the block's start).

    Example:
        >>> row_split_boxes([Box((0, 0), (4, 0), (4, 3))], 4, 2, 1)
        [Box(local_start=(0, 0), global_offset=(6, 0), sizes=(2, 3))]
    """
    block = math.ceil(rows / ranks) if rows else 0
    lo, hi = min(index * block, rows), min((index + 1) * block, rows)
    out = []
    for box in boxes:
        start, stop = max(lo, box.local_start[0]), min(hi, box.local_start[0] + box.sizes[0])
        if start >= stop:
            continue
        out.append(Box((start - lo, *box.local_start[1:]),
                       (box.global_offset[0] + start - box.local_start[0],
                        *box.global_offset[1:]),
                       (stop - start, *box.sizes[1:])))
    return out


def box_chunks(boxes: Sequence[Box]) -> list[Chunk]:
    """The chunks of a tensor leaf laid out by ``boxes`` (one chunk per box)."""
    return [Chunk(b.global_offset, b.sizes, None, b.local_start) for b in boxes]


def flat_range_rects(start: int, stop: int, shape: Sequence[int]
                     ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cut the flat range ``[start, stop)`` of a row-major tensor of ``shape`` into rectangles.

    Returns:
        ``(offsets, sizes, flat_start)`` per rectangle, in flat order; each is the
        contiguous run ``[flat_start, flat_start + prod(sizes))``.

    Example:
        >>> flat_range_rects(2, 7, (3, 3))
        [((0, 2), (1, 1), 2), ((1, 0), (1, 3), 3), ((2, 0), (1, 1), 6)]
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    row = math.prod(shape[1:])
    rest = shape[1:]
    first, last = start // row, stop // row
    out = []

    def inner(r: int, a: int, b: int) -> None:
        for offsets, sizes, flat in flat_range_rects(a, b, rest):
            out.append(((r, *offsets), (1, *sizes), r * row + flat))

    if first == last:
        inner(first, start - first * row, stop - first * row)
        return out
    if start % row:
        inner(first, start % row, row)
        first += 1
    if last > first:
        out.append(((first,) + (0,) * len(rest), (last - first, *rest), first * row))
    if stop % row:
        inner(last, 0, stop % row)
    return out


def piece_chunks(ranges: Sequence[tuple[int, int]], local_shape: Sequence[int],
                 outer: Sequence[Box]) -> list[Chunk]:
    """The chunks of a 1-D piece made of the flat ``ranges`` of a tensor of ``local_shape``.

    The piece is ``cat(flat[a:b] for a, b in ranges)`` of a tensor that is itself laid
    out in the global tensor by the boxes ``outer`` (the parameter's own layout: the
    padding of a block-sharded parameter is cut off here).
    """
    chunks = []
    at = 0
    for a, b in ranges:
        for offsets, sizes, flat in flat_range_rects(a, b, local_shape):
            run = (at + flat - a, at + flat - a + math.prod(sizes), sizes)
            for box in outer:
                lo = [max(o, s) for o, s in zip(offsets, box.local_start, strict=True)]
                hi = [min(o + n, s + m) for o, n, s, m
                      in zip(offsets, sizes, box.local_start, box.sizes, strict=True)]
                if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)) and sizes:
                    continue
                chunks.append(Chunk(
                    tuple(g + lo_ - s for g, lo_, s in zip(box.global_offset, lo, box.local_start,
                                                            strict=True)),
                    tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)), run,
                    tuple(lo_ - o for lo_, o in zip(lo, offsets, strict=True))))
        at += b - a
    return chunks
