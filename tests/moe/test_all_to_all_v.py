"""The variable-split all-to-all: rows arrive where the splits say, the gradient goes back
the reverse way (under torch.func.grad, vjp, vmap and autograd), bytes are counted, and bad
splits are refused with the axis named."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn.primitives.all_to_all_v import all_to_all_v

# SENDS[i][j]: rows rank i sends to rank j (zeros included, uneven)
SENDS = [[2, 0, 3], [1, 1, 0], [0, 4, 2]]


def _rows(rank: int) -> torch.Tensor:
    """Rank i's rows: row r is (100 i + r) in both columns, so each row says where it began."""
    start = torch.arange(sum(SENDS[rank]), dtype=torch.float32) + 100 * rank
    return torch.stack([start, start], dim=1)


def _expected(rank: int) -> torch.Tensor:
    blocks = []
    for src in range(3):
        begin = sum(SENDS[src][:rank])
        blocks.append(_rows(src)[begin:begin + SENDS[src][rank]])
    return torch.cat(blocks)


def _on_rank():
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = sf.Mesh({"ep": 3})
    sends, receives = SENDS[rank], [SENDS[src][rank] for src in range(3)]
    x = _rows(rank)
    weight = torch.arange(sum(receives) * 2, dtype=torch.float32).reshape(-1, 2) + rank

    def f(x):
        return (all_to_all_v(x, "ep", sends, receives, mesh=mesh) * weight).sum()

    sf.reset_comm_stats()
    out = all_to_all_v(x, "ep", sends, receives, mesh=mesh)
    sent_bytes = sf.comm_stats().by_op[("ep", "all_to_all_v")]
    grad = torch.func.grad(f)(x)
    _, pull = torch.func.vjp(f, x)
    live = x.clone().requires_grad_()
    f(live).backward()
    batched = torch.func.vmap(lambda b: all_to_all_v(b, "ep", sends, receives, mesh=mesh),
                              in_dims=1, out_dims=1)(torch.stack([x, 2 * x], dim=1))
    return out, sent_bytes, weight, grad, pull(torch.tensor(1.0))[0], live.grad, batched


def test_rows_arrive_and_gradients_return(worlds):
    results = worlds(3).run(_on_rank)
    weights = [r[2] for r in results]
    for rank, (out, sent_bytes, _, grad, vjp_grad, autograd_grad, batched) in enumerate(results):
        torch.testing.assert_close(out, _expected(rank))
        others = sum(n for j, n in enumerate(SENDS[rank]) if j != rank)
        assert sent_bytes == others * 2 * 4
        # the gradient of row r is the weight it met on the rank it was sent to
        expected = []
        for dst in range(3):
            begin = sum(SENDS[src][dst] for src in range(rank))
            expected.append(weights[dst][begin:begin + SENDS[rank][dst]])
        expected = torch.cat(expected)
        for got in (grad, vjp_grad, autograd_grad):
            torch.testing.assert_close(got, expected)
        torch.testing.assert_close(batched, torch.stack([out, 2 * out], dim=1))


def test_bad_splits_are_refused():
    mesh = sf.Mesh({"ep": 1})
    x = torch.ones(3, 2)
    with pytest.raises(ValueError, match="in_splits must hold 1 non-negative row counts"):
        all_to_all_v(x, "ep", [1, 2], [3], mesh=mesh)
    with pytest.raises(ValueError, match=r"in_splits \[2\] sum to 2, but x has 3 rows"):
        all_to_all_v(x, "ep", [2], [2], mesh=mesh)
    with pytest.raises(ValueError, match="out_splits"):
        all_to_all_v(x, "ep", [3], [2], mesh=mesh)
    with pytest.raises(ValueError, match="at least one dim"):
        all_to_all_v(torch.tensor(1.0), "ep", [1], [1], mesh=mesh)
    assert all_to_all_v(x, "ep", [3], [3], mesh=mesh) is x
