"""pipeline_stages equals the unsplit nn.Sequential on the whole batch.

For every schedule make_schedule has (the others are skipped until they land),
on 2 and 4 pp ranks, micro-batch counts 1..8 (uneven splits and counts not
divisible by the stages included) and random balances: the loss (on every pp
rank), the gradients, init, gather and apply equal the single-process model's.
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
from tests.transforms.pipeline._pipeline_models import (
    ALL_SCHEDULES,
    batch,
    mlp_units,
    mse,
    reference,
    schedule_status,
    virtual_for,
)


def _on_rank(case: dict):
    torch.manual_seed(0)
    units = mlp_units(case["n_units"])
    pp = pipeline_stages(units, sf.Mesh({"pp": case["p"]}), "pp", balance=case["balance"],
                         schedule=case["schedule"], microbatches=case["m"], loss_fn=mse,
                         virtual=case["v"])
    params = pp.init(case["seed"])
    x, y = batch(case["batch"])
    loss, grads, report = pp.value_and_grad(params, x, y, report=True)
    loss2, grads2 = pp.value_and_grad(params, x, y)  # a second step on the same world
    return {"rank": pp.rank, "names": pp.names, "params": params, "loss": loss, "grads": grads,
            "loss2": loss2, "grads2": grads2, "full": pp.gather(params),
            "out": pp.apply(params, x), "layout": pp.layout,
            "kinds": sorted({e.kind for e in report.events}), "n_events": len(report.events)}


def _compositions(total: int, parts: int):
    """A strategy for ``parts`` positive ints summing to ``total``."""
    cuts = st.lists(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1,
                    unique=True).map(sorted)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *c], [*c, total], strict=True)])


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
@settings(max_examples=4)
@given(data=st.data(), p=st.sampled_from([2, 4]), m=st.integers(1, 8),
       extra=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_loss_and_grads_equal_unsplit(worlds, schedule, data, p, m, extra, seed):
    v = virtual_for(schedule)
    status = schedule_status(schedule, p, m, v)
    if status == "missing":
        pytest.skip(f"make_schedule has no {schedule!r} yet")
    if status is not None:  # a count this schedule does not allow: it must say so
        assert "micro" in status.lower(), status
        return
    n_stages = p * v
    n_units = n_stages + extra
    balance = data.draw(_compositions(n_units, n_stages), label="balance")
    rows = data.draw(st.integers(m, 2 * m + 3), label="batch")
    case = {"p": p, "m": m, "v": v, "schedule": schedule, "n_units": n_units,
            "balance": balance, "seed": seed, "batch": rows}
    torch.manual_seed(0)
    units = mlp_units(n_units)
    params, loss, grads, out = reference(units, seed, *batch(rows))
    results = worlds(p).run(_on_rank, case)
    seen = set()
    for got in results:
        assert_close(got["loss"], loss)
        assert_close(got["loss2"], loss)
        assert set(got["grads"]) == {n for n in got["names"] if n in grads}
        for name, grad in got["grads"].items():
            assert_close(grad, grads[name], msg=f"{name} on pp rank {got['rank']}")
            assert_close(got["grads2"][name], grads[name])
        for name in got["names"]:
            assert torch.equal(got["params"][name], params[name]), name
            assert got["layout"][name] == got["rank"]
        seen.update(got["names"])
        assert_close(got["full"], params)
        assert_close(got["out"], out)
        kinds = {"F", "B", "W"} if schedule == "zb-h1" else {"F", "B"}
        assert set(got["kinds"]) == kinds
    assert seen == set(params)  # every leaf on exactly the rank the layout says


def test_one_rank_and_virtual_stages_equal_unsplit(worlds):
    """p = 1 with virtual stages: every hand-off is local, no message at all."""
    torch.manual_seed(0)
    units = mlp_units(5)
    _, loss, grads, _ = reference(units, 3, *batch(6))

    def on_rank():
        torch.manual_seed(0)
        pp = pipeline_stages(mlp_units(5), sf.Mesh({"pp": 1}), balance=[2, 1, 2],
                             schedule="gpipe", microbatches=4, loss_fn=mse, virtual=3)
        return pp.value_and_grad(pp.init(3), *batch(6))

    (got_loss, got_grads), = worlds(1).run(on_rank)
    assert_close(got_loss, loss)
    assert_close(got_grads, grads)


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.frozen = nn.Parameter(torch.ones(6), requires_grad=False)

    def forward(self, ids):
        return self.ln(self.emb(ids)) * self.frozen


def _token_units():
    torch.manual_seed(5)
    return [_Embed(), nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6)]


def _token_loss(out, target):
    return nn.functional.cross_entropy(out.reshape(-1, 6), target.reshape(-1))


def test_integer_inputs_frozen_and_3d_activations(worlds):
    """Token ids into stage 0, (batch, seq, d) activations, a frozen leaf (no gradient)."""
    gen = torch.Generator().manual_seed(1)
    ids, tgt = torch.randint(0, 11, (5, 4), generator=gen), torch.randint(0, 6, (5, 4),
                                                                          generator=gen)
    params, loss, grads, out = reference(_token_units(), 9, ids, tgt, _token_loss)

    def on_rank():
        pp = pipeline_stages(_token_units(), sf.Mesh({"pp": 2}), balance=[1, 3],
                             schedule="gpipe", microbatches=3, loss_fn=_token_loss)
        params = pp.init(9)
        return (*pp.value_and_grad(params, ids, tgt), pp.apply(params, ids))

    for got_loss, got_grads, got_out in worlds(2).run(on_rank):
        assert_close(got_loss, loss)
        assert "0.frozen" not in got_grads
        for name, grad in got_grads.items():
            assert_close(grad, grads[name])
        assert_close(got_out, out)


@pytest.mark.parametrize("by", ["params", "time"])
def test_balance_by_params_or_time(worlds, by):
    """balance="params"/"time" takes balance.balance_units' counts; the step is still exact."""
    balance = pytest.importorskip("shardfn.transforms.pipeline.balance")
    torch.manual_seed(0)
    units = [nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 4), nn.Tanh(),
             nn.Linear(4, 3)]
    x, y = batch(6)
    _, loss, grads, _ = reference(units, 1, x, y)

    def on_rank():
        pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=by, schedule="1f1b",
                             microbatches=2, loss_fn=mse, sample=x[:3])
        return pp.balance, *pp.value_and_grad(pp.init(1), x, y)

    results = worlds(2).run(on_rank)
    if by == "params":
        assert results[0][0] == tuple(balance.balance_units(units, 2, "params"))
    for counts, got_loss, got_grads in results:
        assert counts == results[0][0] and sum(counts) == len(units)
        assert_close(got_loss, loss)
        for name, grad in got_grads.items():
            assert_close(grad, grads[name])


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_communication_volume(worlds, schedule):
    """Per step: each boundary sends every micro-batch's activation forward and its gradient
    back; the last stage sends the 4-byte loss to the other ranks. Nothing else."""
    rows, width = 7, 8

    def on_rank():
        pp = pipeline_stages(mlp_units(8, d=width), sf.Mesh({"pp": 4}), balance=[2] * 4,
                             schedule=schedule, microbatches=3, loss_fn=mse)
        params = pp.init(0)
        sf.reset_comm_stats()
        pp.value_and_grad(params, *batch(rows))
        return pp.rank, sf.comm_stats().op_bytes("pipeline_send")

    activation = rows * width * 4  # all micro-batches of one boundary, float32
    for rank, sent in worlds(4).run(on_rank):
        forward = activation if rank < 3 else 0
        backward = activation if rank > 0 else 0
        loss = 3 * 4 if rank == 3 else 0
        assert sent == forward + backward + loss, (rank, sent)


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
@settings(max_examples=2)
@given(p=st.sampled_from([2, 4]), m=st.integers(1, 6), rows_each=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_declared_shapes_equal_unsplit(worlds, schedule, p, m, rows_each, seed):
    """shapes= declared (the receiver posts header and payload at once): same results."""
    v = virtual_for(schedule)
    if schedule_status(schedule, p, m, v) is not None:
        pytest.skip(f"{schedule!r} with p={p}, m={m}: not available")
    n_units = 2 * p * v
    torch.manual_seed(0)
    params, loss, grads, out = reference(mlp_units(n_units), seed, *batch(m * rows_each))

    def on_rank():
        torch.manual_seed(0)
        pp = pipeline_stages(mlp_units(n_units), sf.Mesh({"pp": p}), balance=[2] * (p * v),
                             schedule=schedule, microbatches=m, loss_fn=mse, virtual=v,
                             shapes=(rows_each, 8))
        leaves = pp.init(seed)
        x, y = batch(m * rows_each)
        return (*pp.value_and_grad(leaves, x, y), pp.apply(leaves, x))

    for got_loss, got_grads, got_out in worlds(p).run(on_rank):
        assert_close(got_loss, loss)
        assert_close(got_out, out)
        for name, grad in got_grads.items():
            assert_close(grad, grads[name])


def test_float64_leaves_and_activations(worlds):
    """Headers carry the dtype: a float64 model pipelines in float64 (no silent casts)."""
    torch.manual_seed(0)
    x, y = (t.double() for t in batch(5))
    model = sf.functional(nn.Sequential(*mlp_units(4)))
    full = {n: t.double() for n, t in model.init(2).items()}
    grads, loss = torch.func.grad_and_value(lambda p: mse(model.apply(p, x), y))(full)

    def on_rank():
        torch.manual_seed(0)
        pp = pipeline_stages(mlp_units(4), sf.Mesh({"pp": 2}), balance=[3, 1],
                             schedule="zb-h1", microbatches=2, loss_fn=mse)
        leaves = {n: t.double() for n, t in pp.init(2).items()}
        return pp.value_and_grad(leaves, x, y)

    for got_loss, got_grads in worlds(2).run(on_rank):
        assert got_loss.dtype == torch.float64
        assert_close(got_loss, loss)
        for name, grad in got_grads.items():
            assert grad.dtype == torch.float64
            assert_close(grad, grads[name])


def test_autocast_bf16_as_the_unsplit_model(worlds):
    """Under torch.autocast the stages compute in bf16 and the bf16 activations travel as
    such (the header carries the dtype); loss and gradients match the unsplit model under
    the same autocast to bf16 precision (rtol 1.6e-2: bf16's 8-bit mantissa)."""
    x, y = batch(6)
    model = sf.functional(nn.Sequential(*mlp_units(4)))
    params = model.init(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads, loss = torch.func.grad_and_value(lambda p: mse(model.apply(p, x), y))(params)

    def on_rank():
        pp = pipeline_stages(mlp_units(4), sf.Mesh({"pp": 2}), balance=[2, 2],
                             schedule="1f1b", microbatches=2, loss_fn=mse)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return pp.value_and_grad(pp.init(0), x, y)

    for got_loss, got_grads in worlds(2).run(on_rank):
        assert_close(got_loss, loss, rtol=1.6e-2, atol=1e-3)
        for name, grad in got_grads.items():
            assert grad.dtype == torch.float32
            assert_close(grad, grads[name], rtol=1.6e-2, atol=1e-2)
