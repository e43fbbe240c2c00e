"""Bad input to pipeline_stages gives a clear error, and a failing rank never hangs the others.

Construction and call checks run in one process (pp size 1). On 2 and 4 ranks:
a declared shape that a stage output breaks, and a rank whose stage raises,
make *every* rank raise quickly (the failing one its own error, the others
that a peer failed), and the same world then runs a correct step: no message
was left unmatched.
"""

from __future__ import annotations

import time

import pytest
import torch
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


def _make(balance, **kw):
    options = {"schedule": "gpipe", "microbatches": 2, "loss_fn": mse, **kw}
    return pipeline_stages(mlp_units(5), sf.Mesh({"pp": 1}), "pp", balance=balance, **options)


@pytest.mark.parametrize("balance, virtual, words", [
    ([2, 2], 2, "covers 4 units, but the model has 5"),
    ([3, 3], 2, "covers 6 units"),
    ([5], 2, "has 1 entries, but the pipeline has 2 stages"),
    ([2, 2, 1], 2, "has 3 entries"),
    ([5, 0], 2, "stages [1] have no units"),
    ([6, -1], 2, "stages [1] have no units"),
])
def test_bad_balance(balance, virtual, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _make(balance, virtual=virtual)


def test_bad_balance_types_and_names():
    with pytest.raises(TypeError, match="ints"):
        _make([2.0, 3], virtual=2)
    with pytest.raises(TypeError, match="list of unit counts"):
        _make(5)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        _make([5], schedule="pipedream")
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        _make([5], microbatches=0)
    with pytest.raises(ValueError, match="axis 'tp' is not in the mesh"):
        pipeline_stages(mlp_units(5), sf.Mesh({"pp": 1}), "tp", balance=[5], microbatches=1,
                        loss_fn=mse)
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        pipeline_stages(nn.Linear(2, 2), sf.Mesh({"pp": 1}), balance=[1], microbatches=1,
                        loss_fn=mse)
    with pytest.raises(ValueError, match="shapes= has 3 entries, but the pipeline has 1"):
        _make([2, 3], virtual=2, shapes=[(1, 8)] * 3)


def test_tied_weights_across_stages_with_stage_models_hold_the_tie():
    """A weight tied across units is held by every stage using it, also when the stages are
    stage models (a stage_transform): the loss and the summed gradient are the unsplit
    model's (tests/hf/test_hf_pipeline_stage_models.py: ties under ZeRO-3 over dp)."""
    first, last = nn.Linear(3, 3), nn.Linear(3, 3)
    last.weight = first.weight
    mesh = sf.Mesh({"pp": 1, "dp": 1})
    pp = pipeline_stages([first, last], mesh, "pp", balance=[1, 1], virtual=2,
                         schedule="gpipe", microbatches=1, loss_fn=mse,
                         stage_transform=lambda fm, m: sf.shard_params(fm, m, "dp"))
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    full = sf.functional(nn.Sequential(first, last))
    params = pp.init(0)
    assert all(torch.equal(t, full.init(0)[n]) for n, t in pp.gather(params).items())
    want, want_loss = torch.func.grad_and_value(lambda p: mse(full.apply(p, x), y))(
        full.init(0))
    loss, grads = pp.value_and_grad(params, x, y)
    torch.testing.assert_close(loss, want_loss)
    got = pp.gather(grads)
    assert sorted(got) == sorted(want) == ["0.bias", "0.weight", "1.bias"]
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_bad_calls():
    pp = _make([2, 3], virtual=2, microbatches=3)
    params = pp.init(0)
    x, y = batch(5)
    with pytest.raises(ValueError, match="a batch of 2 rows cannot be split into 3"):
        pp.value_and_grad(params, x[:2], y[:2])
    with pytest.raises(ValueError, match="targets must be a tensor with the inputs' batch"):
        pp.value_and_grad(params, x, y[:4])
    with pytest.raises(ValueError, match=r"missing \['4.bias'\], unexpected \['9.bias'\]"):
        pp.value_and_grad({**{n: t for n, t in params.items() if n != "4.bias"},
                           "9.bias": torch.zeros(1)}, x, y)
    declared = _make([2, 3], virtual=2, microbatches=2, shapes=(2, 8))
    with pytest.raises(ValueError, match=r"batch \(5 rows\) must split evenly into 2"):
        declared.value_and_grad(params, x, y)


def test_uneven_split_is_the_weighted_mean():
    """5 rows in 3 micro-batches (2, 2, 1): the loss is still the unsplit mean."""
    pp = _make([2, 3], virtual=2, microbatches=3)
    x, y = batch(5)
    torch.manual_seed(0)
    _, loss, grads, _ = reference(mlp_units(5), 0, x, y)
    got_loss, got_grads = pp.value_and_grad(pp.init(0), x, y)
    assert_close(got_loss, loss)
    assert_close(got_grads, grads)


class _Growing(nn.Module):
    """Adds a column from its second call on (a stage whose output shape changes)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.cat([x, x[:, :1]], dim=1) if self.calls > 1 else x


class _Failing(nn.Module):
    """Raises on micro-batch ``when`` (counted by calls)."""

    def __init__(self, when: int):
        super().__init__()
        self.when, self.calls = when, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when + 1:
            raise RuntimeError("unit exploded on purpose")
        return x


def _catching(case: dict):
    """Run one step with the given units; every rank returns its error (or None)."""
    pp = pipeline_stages(case["units"], sf.Mesh({"pp": case["p"]}), balance=case["balance"],
                         schedule=case["schedule"], microbatches=case["m"], loss_fn=mse,
                         virtual=case["v"], shapes=case.get("shapes"))
    x, y = batch(case["rows"], d_out=case.get("d_out", 3))
    start = time.perf_counter()
    try:
        pp.value_and_grad(pp.init(0), x, y)
    except Exception as error:  # noqa: BLE001 - the test looks at every rank's error
        return type(error).__name__, str(error), time.perf_counter() - start
    return None


def _healthy_step(p: int):
    pp = pipeline_stages(mlp_units(2 * p), sf.Mesh({"pp": p}), balance=[2] * p,
                         schedule="1f1b", microbatches=3, loss_fn=mse)
    return pp.value_and_grad(pp.init(0), *batch(6))[0]


def _expected_healthy_loss(p: int):
    return reference(mlp_units(2 * p), 0, *batch(6))[1]


def test_declared_shape_change_raises_on_every_rank(worlds):
    units = [nn.Linear(4, 8), _Growing(), nn.Linear(8, 8), nn.Linear(8, 3)]
    # stage 0 = Linear + Growing: micro-batch 1's output is (2, 9), declared (2, 8)
    case = {"units": units, "p": 2, "balance": [2, 2], "schedule": "1f1b", "m": 3,
            "v": 1, "rows": 6, "shapes": (2, 8)}
    first, second = worlds(2).run(_catching, case)
    assert first[0] == "ValueError"
    assert "stage 0 output for micro-batch 1 has shape (2, 9)" in first[1]
    assert "declared (2, 8)" in first[1]
    assert second[0] == "PeerFailed" and "pp rank 0 failed" in second[1]
    assert max(first[2], second[2]) < 20
    for loss in worlds(2).run(_healthy_step, 2):  # nothing left over in the group
        assert_close(loss, _expected_healthy_loss(2))


def test_declared_shapes_that_hold_give_the_same_result(worlds):
    def on_rank():
        pp = pipeline_stages(mlp_units(5), sf.Mesh({"pp": 2}), balance=[3, 2],
                             schedule="1f1b", microbatches=3, loss_fn=mse,
                             shapes=sf.ShapeDtype(torch.Size([2, 8]), torch.float32))
        return pp.value_and_grad(pp.init(0), *batch(6))[0]

    expected = reference(mlp_units(5), 0, *batch(6))[1]
    for loss in worlds(2).run(on_rank):
        assert_close(loss, expected)


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
def test_a_stage_that_raises_stops_every_rank(worlds, schedule):
    """Stage 2 (of 4, or of 8 with interleaved) raises on micro-batch 1."""
    v = virtual_for(schedule)
    if schedule_status(schedule, 4, 4, v) == "missing":
        pytest.skip(f"make_schedule has no {schedule!r} yet")
    n_stages = 4 * v
    units = [nn.Linear(4, 8)] + [nn.Linear(8, 8) for _ in range(n_stages - 2)] + [
        nn.Linear(8, 3)]
    units.insert(3, _Failing(when=1))  # the last unit of stage 2 (balance below)
    balance = [1, 1, 2] + [1] * (n_stages - 3)
    case = {"units": units, "p": 4, "balance": balance, "schedule": schedule, "m": 4,
            "v": v, "rows": 8}
    results = worlds(4).run(_catching, case)
    assert all(r is not None for r in results), results
    failing = results[2]
    assert failing[0] == "RuntimeError" and "exploded on purpose" in failing[1]
    for rank, (name, text, seconds) in enumerate(results):
        if rank != 2:
            assert name == "PeerFailed", (rank, name, text)
        assert seconds < 20, (rank, seconds)
    for loss in worlds(4).run(_healthy_step, 4):
        assert_close(loss, _expected_healthy_loss(4))


def test_the_failing_rank_is_reported_by_the_world(worlds):
    """Uncaught: the local world reports the failing rank's error (not a hang)."""
    units = [nn.Linear(4, 8), _Failing(when=0), nn.Linear(8, 3)]

    def on_rank():
        pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=[1, 2], schedule="gpipe",
                             microbatches=2, loss_fn=mse)
        return pp.value_and_grad(pp.init(0), *batch(4))

    start = time.perf_counter()
    with pytest.raises(sf.testing.RankError, match="exploded on purpose"):
        worlds(2).run(on_rank)
    assert time.perf_counter() - start < 30
    for loss in worlds(2).run(_healthy_step, 2):
        assert_close(loss, _expected_healthy_loss(2))


class _Dying(nn.Module):
    """Ends its process on its second call (a peer that dies mid-step)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            import os

            os._exit(3)
        return x


def test_a_peer_that_dies_mid_step_is_reported_not_hung(worlds):
    units = [nn.Linear(4, 8), nn.Linear(8, 8), _Dying(), nn.Linear(8, 3)]

    def on_rank():
        pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=[2, 2], schedule="1f1b",
                             microbatches=3, loss_fn=mse)
        return pp.value_and_grad(pp.init(0), *batch(6))

    start = time.perf_counter()
    with pytest.raises(sf.testing.WorldTimeout, match=r"rank 1 is dead \(exit code 3\)"):
        worlds(2).run(on_rank)
    assert time.perf_counter() - start < 60
    for loss in worlds(2).run(_healthy_step, 2):  # the respawned world runs a correct step
        assert_close(loss, _expected_healthy_loss(2))


def test_torch_func_transforms_are_refused():
    pp = _make([2, 3], virtual=2)
    params, (x, y) = pp.init(0), batch(4)
    with pytest.raises(RuntimeError, match="cannot run under torch.func transforms"):
        torch.func.vmap(lambda xs: pp.apply(params, xs))(x[None])
    with pytest.raises(RuntimeError, match="cannot run under torch.func transforms"):
        torch.func.grad(lambda p: pp.value_and_grad(p, x, y)[0])(params)


@pytest.mark.parametrize("call", ["value_and_grad", "apply", "gather"])
def test_bad_arguments_on_one_rank_stop_every_rank(worlds, call):
    """pp rank 1 alone passes a tree missing a leaf: it raises its ValueError, and rank 0,
    which would wait for its messages, raises PeerFailed with that text, instead of hanging."""

    def on_rank():
        pp = pipeline_stages(mlp_units(4), sf.Mesh({"pp": 2}), balance=[2, 2],
                             schedule="1f1b", microbatches=2, loss_fn=mse)
        params = pp.init(0)
        if pp.rank == 1 and call == "gather":  # gather takes any subset: a leaf of rank 0
            params["0.weight"] = torch.zeros(1)
        elif pp.rank == 1:
            params.pop("3.bias")
        x, y = batch(4)
        start = time.perf_counter()
        try:
            if call == "value_and_grad":
                pp.value_and_grad(params, x, y)
            elif call == "apply":
                pp.apply(params, x)
            else:
                pp.gather(params)
        except Exception as error:  # noqa: BLE001 - the test looks at every rank's error
            return type(error).__name__, str(error), time.perf_counter() - start
        return None

    first, second = worlds(2).run(on_rank)
    text = "unexpected ['0.weight']" if call == "gather" else "missing ['3.bias']"
    assert second[0] == "ValueError" and text in second[1]
    assert first[0] == "PeerFailed" and text in first[1]
    assert max(first[2], second[2]) < 20
    for loss in worlds(2).run(_healthy_step, 2):
        assert_close(loss, _expected_healthy_loss(2))


class _AsDict(nn.Module):
    """Returns a dict: no boundary takes it (only tensors and tuples/lists of them)."""

    def forward(self, x):
        return {"h": x}


class _FromDict(nn.Module):
    def forward(self, d):
        return d["h"]


def _tuple_units():
    from tests.transforms.pipeline.test_pipeline_tuples import Masked, Pair, TakeFirst

    return [nn.Linear(4, 8), Pair(), Masked(), TakeFirst(), nn.Linear(8, 3)]


@pytest.mark.parametrize("shapes, words", [
    ([((2, 8), ((2, 8), torch.int32))],  # the mask is int64
     "stage 0 output for micro-batch 0, entry 1, has shape (2, 8) torch.int64, but shapes= "
     "declared (2, 8) torch.int32 (on pp rank 0)"),
    ([(2, 8)],  # a single tensor declared for a tuple output
     "stage 0 output for micro-batch 0 has shape ((2, 8) torch.float32, (2, 8) torch.int64), "
     "but shapes= declared (2, 8) torch.float32"),
    ([((2, 8), (2, 8), (2, 8))],
     "stage 0 output for micro-batch 0 has 2 entries, but shapes= declared 3"),
])
def test_declared_tuple_mismatch_raises_on_every_rank(worlds, shapes, words):
    case = {"units": _tuple_units(), "p": 2, "balance": [2, 3], "schedule": "1f1b", "m": 3,
            "v": 1, "rows": 6, "shapes": shapes}
    first, second = worlds(2).run(_catching, case)
    assert first[0] == "ValueError" and words in first[1], first
    assert second[0] == "PeerFailed" and "pp rank 0 failed" in second[1]
    assert words in second[1]  # the failing rank's text travels with its error header
    assert max(first[2], second[2]) < 20
    for loss in worlds(2).run(_healthy_step, 2):
        assert_close(loss, _expected_healthy_loss(2))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_dict_stage_output_is_refused_on_every_rank(worlds, schedule):
    units = [nn.Linear(4, 8), _AsDict(), _FromDict(), nn.Linear(8, 3)]
    case = {"units": units, "p": 2, "balance": [2, 2], "schedule": schedule, "m": 2,
            "v": 1, "rows": 4}
    first, second = worlds(2).run(_catching, case)
    assert first[0] == "TypeError", first
    assert "pipeline stage 0 output for micro-batch 0 is a dict: only a tensor or a " \
           "tuple/list of tensors (and None) can travel between pp ranks" in first[1]
    assert second[0] == "PeerFailed" and "is a dict" in second[1]
    for loss in worlds(2).run(_healthy_step, 2):
        assert_close(loss, _expected_healthy_loss(2))


@pytest.mark.parametrize("inner, kind", [(lambda x: (x, x), "tuple"), (lambda x: 3, "int")])
def test_a_nested_tuple_or_a_number_in_a_tuple_is_refused(inner, kind):
    units = [nn.Linear(4, 8), _Nested(inner), _FromNested(), nn.Linear(8, 3)]
    pp = pipeline_stages(units, sf.Mesh({"pp": 1}), balance=[2, 2], schedule="gpipe",
                         microbatches=2, loss_fn=mse, virtual=2)
    with pytest.raises(TypeError, match=rf"micro-batch 0 is a tuple: .*entry 1 is a {kind}"):
        pp.value_and_grad(pp.init(0), *batch(4))


class _Nested(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x, self.inner(x)


class _FromNested(nn.Module):
    def forward(self, pair):
        return pair[0]
