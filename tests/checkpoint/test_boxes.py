"""The chunk geometry against a direct reference (hypothesis): every element once, in place.

For random shapes, flat ranges of a block-sharded (padded) tensor, and mesh
sizes, the chunks :func:`piece_chunks` and :func:`block_boxes` give cover exactly
the real elements the rank holds, each once, at the right global place: writing
every chunk's view into a global tensor rebuilds the reference, and padding
never lands in it.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.checkpoint._boxes import block_boxes, box_chunks, flat_range_rects, piece_chunks


def _paste(chunks, local, shape):
    out = torch.full(shape, -1, dtype=torch.int64)
    for c in chunks:
        region = out[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))]
        assert (region == -1).all(), "two chunks overlap"
        region.copy_(c.view(local))
    return out


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, data=st.data())
def test_flat_range_rects_tile_the_range(shape, data):
    n = math.prod(shape)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    covered = []
    for offsets, sizes, flat in flat_range_rects(a, b, shape):
        idx = torch.arange(n).reshape(shape)[tuple(slice(o, o + s) for o, s
                                                   in zip(offsets, sizes, strict=True))]
        assert idx.reshape(-1).tolist() == list(range(flat, flat + idx.numel()))
        covered += idx.reshape(-1).tolist()
    assert covered == list(range(a, b))


@settings(max_examples=60, deadline=None)
@given(shape=shapes.filter(lambda s: len(s) >= 1), data=st.data())
def test_pieces_of_a_padded_shard_land_in_place(shape, data):
    ranks = data.draw(st.integers(1, 4))
    index = data.draw(st.integers(0, ranks - 1))
    full = torch.arange(math.prod(shape)).reshape(shape)
    block = math.ceil(shape[0] / ranks)
    start = min(index * block, shape[0])
    local = torch.full((block, *shape[1:]), -7, dtype=torch.int64)  # -7: padding
    real = min(block, shape[0] - start)
    local[:real] = full[start:start + real]
    boxes = block_boxes(shape, [(ranks, index)])
    want = torch.full(shape, -1, dtype=torch.int64)
    want[start:start + real] = full[start:start + real]
    assert torch.equal(_paste(box_chunks(boxes), local, shape), want)
    n = local.numel()
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=4)))
    ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    piece = torch.cat([local.reshape(-1)[a:b] for a, b in ranges]) if ranges else local[:0]
    got = _paste(piece_chunks(ranges, local.shape, boxes), piece, shape)
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in ranges:
        mask[a:b] = True
    want = torch.full(shape, -1, dtype=torch.int64)
    held = local.reshape(-1).clone()
    held[~mask] = -1
    held = held.reshape(local.shape)[:real]
    want[start:start + real] = held
    assert (got != -7).all(), "padding reached the checkpoint"
    assert torch.equal(got, want)
