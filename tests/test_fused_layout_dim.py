"""``sf.FusedLayout(axis, parts, shape, dim)``: a fused ``[q|k|v]`` split on dim 0 (Linear)
or dim 1 (GPT-2's Conv1D), against slices of the full tensor cut in the test process.

For random world sizes, shapes, parts and dims: ``sf.shard`` gives rank ``r`` block ``r`` of
every part (``q[r] | k[r] | v[r]``) side by side on ``dim``, ``sf.gather`` rebuilds the full
tensor, and its gradient is the rank's block of the upstream gradient (summed over ranks:
JAX's rule for a per-rank output); ``sf.checkpoint``'s boxes put each piece where it
belongs. Uneven fused dims are refused naming the sizes, by ``sf.shard`` and by
``sf.checkpoint.save`` (naming the leaf too).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from shardfn.checkpoint._boxes import fused_layout_boxes


@st.composite
def fused_cases(draw):
    """``(ranks, shape, dim, parts, seed)``: ``shape[dim]`` = parts x ranks x a block."""
    ranks, parts = draw(st.sampled_from([1, 2, 3, 4])), draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    dim = draw(st.integers(0, min(1, len(shape) - 1)))
    shape[dim] = parts * ranks * draw(st.integers(1, 3))
    return ranks, tuple(shape), dim, parts, draw(st.integers(0, 2**16))


def _round_trip(ranks: int, x: torch.Tensor, upstream: torch.Tensor, layout):
    import torch

    import shardfn as sf

    mesh = sf.Mesh({"tp": ranks})
    local = sf.shard(x, layout, mesh)
    grad = torch.func.grad(lambda t: (sf.gather(t, layout, mesh) * upstream).sum())(local)
    return local, sf.gather(local, layout, mesh), grad, layout.local_shape(mesh)


def _block(x: torch.Tensor, dim: int, parts: int, ranks: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard, cut by hand: block ``rank`` of each part, in part order."""
    part = x.shape[dim] // parts
    block = part // ranks
    return torch.cat([x.narrow(dim, k * part + rank * block, block) for k in range(parts)], dim)


@given(case=fused_cases())
def test_fused_layout_shards_and_gathers_on_dim_0_and_1(worlds, case):
    ranks, shape, dim, parts, seed = case
    gen = torch.Generator().manual_seed(seed)
    x, upstream = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    layout = sf.FusedLayout("tp", parts, shape, dim=dim)
    for rank, (local, full, grad, local_shape) in enumerate(
            worlds(ranks).run(_round_trip, ranks, x, upstream, layout)):
        want = _block(x, dim, parts, ranks, rank)
        assert local_shape == tuple(want.shape), (rank, local_shape)
        assert torch.equal(local, want), f"rank {rank}: shard"
        assert torch.equal(full, x), f"rank {rank}: gather"
        assert_close(grad, ranks * _block(upstream, dim, parts, ranks, rank),
                     msg=lambda m, r=rank: f"rank {r}: gradient: {m}")


class _Coords:
    """A mesh stand-in for the pure arithmetic: one axis of ``ranks`` ranks, this one ``rank``."""

    def __init__(self, ranks: int, rank: int) -> None:
        self.ranks, self.rank = ranks, rank

    def size(self, axis: str) -> int:
        return self.ranks

    def index(self, axis: str) -> int:
        return self.rank


@given(case=fused_cases())
def test_checkpoint_boxes_tile_the_tensor_where_shard_leaf_cuts_it(case):
    """``sf.checkpoint``'s chunks of a fused leaf: each box of each rank's shard holds the
    global region it claims, and the boxes of all ranks cover the tensor exactly once."""
    ranks, shape, dim, parts, seed = case
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    layout = sf.FusedLayout("tp", parts, shape, dim=dim)
    covered = torch.zeros(shape, dtype=torch.int64)
    for rank in range(ranks):
        local = layout.shard_leaf(x, _Coords(ranks, rank))
        for box in fused_layout_boxes(layout, _Coords(ranks, rank)):
            here = tuple(slice(s, s + n) for s, n in zip(box.local_start, box.sizes, strict=True))
            there = tuple(slice(s, s + n) for s, n in zip(box.global_offset, box.sizes,
                                                          strict=True))
            assert torch.equal(local[here], x[there]), (rank, box)
            covered[there] += 1
    assert torch.equal(covered, torch.ones_like(covered))


def _refusals(path: str) -> tuple[str, str]:
    import torch

    import shardfn as sf

    mesh = sf.Mesh({"tp": 2})
    layout = sf.FusedLayout("tp", 3, (2, 10), dim=1)
    messages = []
    for call in (lambda: sf.shard(torch.zeros(2, 10), layout, mesh),
                 lambda: sf.checkpoint.save(path, {"w": torch.zeros(2, 5)}, mesh, {"w": layout})):
        try:
            call()
        except (ValueError, sf.checkpoint.CheckpointError) as error:  # save: every rank's
            messages.append(str(error))
    return tuple(messages)


def test_an_uneven_fused_dim_is_refused_naming_the_numbers(worlds, tmp_path):
    for shard_message, save_message in worlds(2).run(_refusals, str(tmp_path / "ck")):
        for message in (shard_message, save_message):  # shape, dim, its size, parts x ranks
            assert "shape=(2, 10)" in message and "dim 1 (10)" in message, message
            assert "parts x size of axis 'tp' = 3 x 2 = 6" in message, message
        assert "leaf 'w'" in save_message
    with pytest.raises(ValueError, match=r"dim 2 is not a dim of shape \(6, 4\)"):
        sf.FusedLayout("tp", 3, (6, 4), dim=2)


def test_fused_columns_layout_is_deprecated_for_fused_layout_dim_1():
    with pytest.warns(DeprecationWarning, match=r"FusedLayout\(axis, parts, shape, dim=1\)"):
        old = sf.FusedColumnsLayout("tp", 3, (4, 12))
    assert isinstance(old, sf.FusedLayout) and old.dim == 1
    mesh = sf.Mesh({"tp": 1})
    x = torch.randn(4, 12)
    assert torch.equal(sf.gather(sf.shard(x, old, mesh), old, mesh), x)
