"""Stage outputs that are tuples: the pipeline equals ``sf.functional(nn.Sequential(*units))``.

The units pass tuples as nn.Sequential does (the next unit gets the tuple as its
one argument): ``(hidden, int mask)``, ``(hidden, unused aux, constant)``, and a
head returning ``(out, aux)`` that the loss reads. Every boundary can be a stage
boundary (the balance is drawn), for every schedule, on 2 and 4 ranks: the loss,
the gradients (zeros for the parameters only the unused aux depends on) and
``apply`` (a tuple, each entry concatenated over the micro-batches) equal the
single-process model's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.functional import functional
from shardfn.transforms.pipeline import pipeline_stages
from tests.transforms.pipeline._pipeline_models import (
    ALL_SCHEDULES,
    batch,
    schedule_status,
    virtual_for,
)

D = 8


class Pair(nn.Module):
    """x -> (tanh(x), int64 mask of x > 0): an integer tensor travels with the hidden."""

    def forward(self, x):
        return torch.tanh(x), (x > 0).to(torch.int64)


class Masked(nn.Module):
    """(h, mask) -> (lin(h) * mask, aux (unused later, requires grad), a constant)."""

    def __init__(self):
        super().__init__()
        self.lin, self.aux = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, pair):
        h, mask = pair
        return self.lin(h) * mask.to(h.dtype), self.aux(h), torch.full_like(h, 0.5)


class TakeFirst(nn.Module):
    """(a, aux, c) -> a * c: aux is not used, so nothing flows back through it."""

    def forward(self, triple):
        a, _, c = triple
        return a * c


class Head(nn.Module):
    """h -> (out, per-row aux): the last stage's tuple output goes to the loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 3)

    def forward(self, h):
        return self.lin(h), h.pow(2).mean(dim=1, keepdim=True)


def tuple_units() -> list[nn.Module]:
    return [nn.Linear(4, D), Pair(), Masked(), TakeFirst(), nn.Linear(D, D), Head()]


def tuple_loss(out, target):
    prediction, aux = out
    return ((prediction - target) ** 2).mean() + 0.1 * aux.mean()


def tuple_reference(seed: int, x: torch.Tensor, y: torch.Tensor):
    model = functional(nn.Sequential(*tuple_units()))
    params = model.init(seed)
    trainable, rest = model.split_trainable(params)
    grads, loss = torch.func.grad_and_value(
        lambda t: tuple_loss(model.apply({**rest, **t}, x), y))(trainable)
    return loss, grads, model.apply(params, x)


def _on_rank(case: dict):
    pp = pipeline_stages(tuple_units(), sf.Mesh({"pp": case["p"]}), balance=case["balance"],
                         schedule=case["schedule"], microbatches=case["m"],
                         loss_fn=tuple_loss, virtual=case["v"], shapes=case.get("shapes"))
    params = pp.init(case["seed"])
    x, y = batch(case["rows"])
    loss, grads = pp.value_and_grad(params, x, y)
    loss2, grads2 = pp.value_and_grad(params, x, y)  # with the shapes step 1 inferred
    return {"loss": loss, "grads": grads, "loss2": loss2, "grads2": grads2,
            "out": pp.apply(params, x)}


def _balances(n_units: int, n_stages: int):
    cuts = st.lists(st.integers(1, n_units - 1), min_size=n_stages - 1,
                    max_size=n_stages - 1, unique=True).map(sorted)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *c], [*c, n_units], strict=True)])


def _check(results, loss, grads, out):
    for got in results:
        assert_close(got["loss"], loss)
        assert_close(got["loss2"], loss)
        for name, grad in got["grads"].items():
            assert_close(grad, grads[name])
            assert_close(got["grads2"][name], grads[name])
        assert isinstance(got["out"], tuple) and len(got["out"]) == 2
        assert_close(got["out"], out)
    every = {n for got in results for n in got["grads"]}
    assert every == set(grads)


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
@settings(max_examples=3, deadline=None)
@given(data=st.data(), p=st.sampled_from([2, 4]), m=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_tuple_outputs_equal_unsplit(worlds, schedule, data, p, m, seed):
    v = virtual_for(schedule)
    status = schedule_status(schedule, p, m, v)
    if status == "missing":
        pytest.skip(f"make_schedule has no {schedule!r} yet")
    if status is not None or p * v > len(tuple_units()):
        return
    balance = data.draw(_balances(len(tuple_units()), p * v), label="balance")
    rows = data.draw(st.integers(m, 2 * m + 2), label="rows")
    case = {"p": p, "m": m, "v": v, "schedule": schedule, "balance": balance, "seed": seed,
            "rows": rows}
    loss, grads, out = tuple_reference(seed, *batch(rows))
    assert grads["2.aux.weight"].abs().sum() == 0  # only the unused aux depends on it
    _check(worlds(p).run(_on_rank, case), loss, grads, out)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_declared_tuple_shapes(worlds, schedule):
    """shapes= with a tuple of (shape, dtype) entries per boundary: the same numbers."""
    if schedule_status(schedule, 2, 4, 2) is not None:
        pytest.skip(f"make_schedule has no {schedule!r} with 2 virtual stages yet")
    # stages: [Linear, Pair] -> (h, mask) | [Masked] -> 3-tuple | [TakeFirst] | [Linear, Head]
    rows = 2
    shapes = [((rows, D), ((rows, D), torch.int64)),
              ((rows, D), (rows, D), sf.ShapeDtype(torch.Size([rows, D]), torch.float32)),
              (rows, D)]
    case = {"p": 2, "m": 4, "v": 2, "schedule": schedule, "balance": [2, 1, 1, 2], "seed": 3,
            "rows": 4 * rows, "shapes": shapes}
    loss, grads, out = tuple_reference(3, *batch(4 * rows))
    _check(worlds(2).run(_on_rank, case), loss, grads, out)


def test_tuple_of_one_rank_equals_unsplit():
    """One process, one stage per boundary handed over locally (virtual stages)."""
    case = {"p": 1, "m": 2, "v": 3, "schedule": "gpipe", "balance": [2, 1, 3], "seed": 5,
            "rows": 5}
    loss, grads, out = tuple_reference(5, *batch(5))
    _check([_on_rank(case)], loss, grads, out)


@pytest.mark.parametrize("balance", [[3, 3], [4, 2]])
def test_split_backward_with_a_tuple_inside_a_stage(worlds, balance):
    """zb-h1 splits backward per unit; a tuple between two units of one stage keeps that
    stage's W whole (one piece), so the units before the tuple still get gradients."""
    if schedule_status("zb-h1", 2, 3, 1) == "missing":
        pytest.skip("make_schedule has no 'zb-h1' yet")
    case = {"p": 2, "m": 3, "v": 1, "schedule": "zb-h1", "balance": balance, "seed": 11,
            "rows": 7}
    loss, grads, out = tuple_reference(11, *batch(7))
    _check(worlds(2).run(_on_rank, case), loss, grads, out)
