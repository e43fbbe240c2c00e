"""Split backward at the operation level (``_weight_grad``), and ZB-H1 with it.

* One process: ``backward_input`` then ``backward_weights`` give the gradients of one
  ``torch.autograd.grad`` of everything; ``W`` runs no node of the input-gradient path
  (counted with an ``autograd.Function`` inside a residual block's inner path); a
  weight used twice, an unused parameter, and the graphs that do not split.
* Distributed: ``zb-h1`` loss and gradients equal the unsplit model on the full batch
  (2 and 4 ranks, random micro-batch counts and widths) for residual blocks with a
  weight tied inside a unit, an unused parameter, token ids into stage 0, and remat.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.pipeline import pipeline_stages
from shardfn.transforms.pipeline._weight_grad import (
    backward_input,
    backward_weights,
    plan_split,
)
from tests.transforms.pipeline._pipeline_models import reference


class _Count(torch.autograd.Function):
    """Identity whose backward counts its calls (``_Count.calls``)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Count.calls += 1
        return grad


def _block(p: dict[str, torch.Tensor], x: torch.Tensor, d: int, tied: bool) -> torch.Tensor:
    """x + fc2(count(gelu(fc1(norm(count(x)))))), then tanh(h @ w3), w3 = fc1's weight if
    ``tied`` (a weight used at two places of the input path)."""
    f = nn.functional
    h = f.layer_norm(_Count.apply(x), (d,), p["ln"])
    h = _Count.apply(f.gelu(f.linear(h, p["w1"], p["b1"])))
    h = x + f.linear(h, p["w2"])
    return torch.tanh(h @ p["w1" if tied else "w3"])


def _leaves(d: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (d, d), "b1": (d,), "w2": (d, d), "ln": (d,), "w3": (d, d),
              "unused": (3,)}
    return {n: torch.randn(*s, generator=gen).requires_grad_() for n, s in shapes.items()}


@settings(max_examples=6, deadline=None)
@given(d=st.integers(2, 16), rows=st.integers(1, 6), seed=st.integers(0, 2**16),
       tied=st.booleans())
def test_input_then_weights_equals_one_backward(d, rows, seed, tied):
    p = _leaves(d, seed)
    names = list(p)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(seed + 1),
                    requires_grad=True)
    out = _block(p, x, d, tied)
    g = torch.randn_like(out)
    want = torch.autograd.grad(out, [x, *p.values()], g, allow_unused=True)

    out = _block(p, x, d, tied)
    split = plan_split([out], [x], list(p.values()))
    assert split is not None
    groups = {tuple(names[k] for k in grp.params) for grp in split.groups}
    if tied:  # w1 used twice: one group at two intermediates
        assert groups == {("w1", "b1"), ("w2",), ("ln",)}
    else:
        assert groups == {("w1", "b1"), ("w2",), ("ln",), ("w3",)}
    _Count.calls = 0
    (gx,), captured = backward_input(split, [out], [g], [x])
    assert _Count.calls == 2  # B ran the input path once
    del out
    backward_weights(split, captured, list(p.values()))
    got = [t.grad for t in p.values()]
    # W runs no input-path node, except, for a tied weight, those between its two uses
    # (here the inner count; the clamp at the lower use keeps the values exact)
    assert _Count.calls == 2 + tied
    assert_close(gx, want[0])
    for name, mine, ref in zip(names, got, want[1:], strict=True):
        if ref is None:
            assert mine is None, name
        else:
            assert_close(mine, ref, msg=name)


def test_graphs_that_do_not_split():
    w = torch.randn(3, 3, requires_grad=True)
    ids = torch.randint(0, 3, (4,))
    assert plan_split([w[ids].sum()], [], [w]) is None  # no input gradient (token ids)
    x = torch.randn(2, 3, requires_grad=True)
    assert plan_split([w.sum(), (x @ w).sum()], [x], [w]) is None  # an output without x
    assert plan_split([torch.zeros(2)], [x], [w]) is None  # nothing requires grad


# -------------------------------------------------------------------- zb-h1 end to end
D = 8


class _Tied(nn.Module):
    """Residual block whose two linears share one weight, plus an unused parameter."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)
        self.fc2.weight = self.fc1.weight
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


def _units(n_blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [_Tied() if k % 2 else _Residual() for k in range(n_blocks)]
    return [nn.Embedding(13, D), *blocks, nn.Linear(D, 5)]


def _loss(out, target):
    return nn.functional.cross_entropy(out.reshape(-1, 5), target.reshape(-1))


def _tokens(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 13, (rows, 3), generator=gen), torch.randint(0, 5, (rows, 3),
                                                                         generator=gen)


def _check(results, grads, loss):
    seen = set()
    for got_loss, got_grads in results:
        assert_close(got_loss, loss)
        assert got_grads, "a rank with no gradients"
        for name, grad in got_grads.items():
            assert_close(grad, grads[name], msg=name)
        seen |= set(got_grads)
    assert seen == set(grads)  # every trainable leaf's gradient, on its rank


@settings(max_examples=4, deadline=None)
@given(p=st.sampled_from([2, 4]), m=st.integers(1, 5), extra=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_zb_h1_equals_unsplit(worlds, p, m, extra, seed):
    n_blocks = 2 * p - 2 + extra  # stage 0: embedding + a block, the last: a block + head
    rows = m + seed % 4
    ids, tgt = _tokens(rows, seed)
    _, loss, grads, _ = reference(_units(n_blocks), seed, ids, tgt, _loss)
    balance = [2] * (p - 1) + [n_blocks + 2 - 2 * (p - 1)]

    def on_rank():
        pp = pipeline_stages(_units(n_blocks), sf.Mesh({"pp": p}), balance=balance,
                             schedule="zb-h1", microbatches=m, loss_fn=_loss)
        return pp.value_and_grad(pp.init(seed), ids, tgt)

    results = worlds(p).run(on_rank)
    _check(results, grads, loss)
    assert any("1.unused" in g or "2.unused" in g for _, g in results)


def test_zb_h1_with_remat_equals_unsplit(worlds):
    """Remat stages are one autograd node: B runs their full backward (W is empty), but
    on stage 0, with no input gradient, B is empty and W the whole backward."""
    ids, tgt = _tokens(6, 3)
    _, loss, grads, _ = reference(_units(2), 4, ids, tgt, _loss)

    def on_rank():
        pp = pipeline_stages(_units(2), sf.Mesh({"pp": 2}), balance=[2, 2], schedule="zb-h1",
                             microbatches=3, loss_fn=_loss,
                             remat=sf.checkpoint_policies.nothing_saveable)
        return pp.value_and_grad(pp.init(4), ids, tgt)

    _check(worlds(2).run(on_rank), grads, loss)


@pytest.mark.parametrize("p", [2, 4])
def test_zb_h1_float_input_stage_splits(worlds, p):
    """Stages after the first split their backward (the W events carry real work): the
    gradients still equal the unsplit model's, over two steps on the same world."""
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, D, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    units = [_Residual() if k % 2 else _Tied() for k in range(p)]
    _, loss, grads, _ = reference(units, 1, x, y)

    def on_rank():
        pp = pipeline_stages(units, sf.Mesh({"pp": p}), balance=[1] * p, schedule="zb-h1",
                             microbatches=4, loss_fn=lambda o, t: ((o - t) ** 2).mean())
        params = pp.init(1)
        pp.value_and_grad(params, x, y)
        return pp.value_and_grad(params, x, y)

    _check(worlds(p).run(on_rank), grads, loss)
