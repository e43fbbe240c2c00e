"""Several tensors and keyword inputs per micro-batch (#24 item 3).

``value_and_grad(params, inputs, targets)`` and ``apply(params, inputs)`` take ``inputs`` as a
tuple (the first unit's positional arguments) or a dict (its keyword arguments) and
``targets`` as a dict, as ``torch.distributed.pipelining``'s ``schedule.step(*args, **kwargs)``
does. Ported in spirit from torch's ``test/distributed/pipelining/test_microbatch.py``:
``split_args_kwargs_into_chunks`` splits every tensor on dim 0, keyword arguments too, and
passes values that are not tensors whole (``test_split_and_merge``: the chunks merge back
into the batch); a model whose forward takes keyword arguments, run through the pipeline,
equals the model on the whole batch (``test_chunk_spec``). Here, over 2 and 4 ranks and
GPipe, 1F1B and interleaved: the loss, every gradient and ``apply`` equal the unsplit model's.
Refused, naming the leaf: tensors of different rows, a 0-dim tensor, inputs of different
structure on different pp ranks. A transformed stage 0 (a stage model) takes them too.
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
from shardfn.transforms.pipeline.batch import (
    UnitInputs,
    as_unit_inputs,
    check_batch,
    split_microbatches,
)
from tests.transforms.pipeline._pipeline_models import batch, schedule_status, virtual_for

D = 8


class MaskedIn(nn.Module):
    """forward(x, mask): two positional inputs, the mask an integer tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, D)

    def forward(self, x, mask):
        return self.lin(x) * mask.to(x.dtype)


class ScaledIn(nn.Module):
    """forward(x, *, scale, shift, unused=None): keyword inputs, a per-row tensor and a
    plain number (given whole to every micro-batch)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, D)

    def forward(self, x, *, scale, shift, unused=None):
        assert unused is None
        return self.lin(x) * scale + shift


class Chain(nn.Sequential):
    """The unsplit reference: the first unit takes the batch's arguments, the rest chain."""

    def forward(self, *args, **kwargs):
        first, *rest = self
        out = first(*args, **kwargs)
        for unit in rest:
            out = unit(out)
        return out


def units(kind: str) -> list[nn.Module]:
    first = MaskedIn() if kind == "positional" else ScaledIn()
    return [first, nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(),
            nn.Linear(D, D), nn.Linear(D, 3)]


def weighted_mse(out, targets):
    """A mean over the micro-batch of the targets dict's rows."""
    return (((out - targets["y"]) ** 2) * targets["weight"]).mean()


def make_batch(kind: str, rows: int, seed: int = 7):
    """(inputs, targets): a tuple or a dict of inputs, a dict of targets."""
    x, y = batch(rows, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    weight = torch.rand(rows, 1, generator=gen)
    if kind == "positional":
        inputs = (x, torch.randint(0, 2, (rows, D), generator=gen))
    else:
        inputs = {"x": x, "scale": torch.rand(rows, 1, generator=gen) + 0.5, "shift": 0.25,
                  "unused": None}
    return inputs, {"y": y, "weight": weight}


def reference(kind: str, seed: int, inputs, targets):
    """(loss, grads, out) of the unsplit model on the whole batch."""
    model = sf.functional(Chain(*units(kind)))
    params = model.init(seed)
    trainable, rest = model.split_trainable(params)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    grads, loss = torch.func.grad_and_value(
        lambda t: weighted_mse(model.apply({**rest, **t}, *args, **kwargs), targets))(trainable)
    return loss, grads, model.apply(params, *args, **kwargs)


def _on_rank(case: dict) -> dict:
    pp = pipeline_stages(units(case["kind"]), sf.Mesh({"pp": case["p"]}), "pp",
                         balance=case["balance"], schedule=case["schedule"],
                         microbatches=case["m"], loss_fn=weighted_mse, virtual=case["v"],
                         shapes=case.get("shapes"))
    params = pp.init(case["seed"])
    inputs, targets = make_batch(case["kind"], case["rows"])
    loss, grads = pp.value_and_grad(params, inputs, targets)
    loss2, grads2, report = pp.value_and_grad(params, inputs, targets, report=True)
    return {"loss": loss, "grads": grads, "loss2": loss2, "grads2": grads2,
            "events": len(report.events), "out": pp.apply(params, inputs)}


def _check(found: list[dict], case: dict) -> None:
    loss, grads, out = reference(case["kind"], case["seed"], *make_batch(case["kind"],
                                                                         case["rows"]))
    for got in found:
        assert_close(got["loss"], loss)
        assert_close(got["loss2"], loss)
        assert_close(got["out"], out)
        assert got["events"] > 0
        for name, grad in got["grads"].items():
            assert_close(grad, grads[name])
            assert_close(got["grads2"][name], grads[name])
    assert {n for got in found for n in got["grads"]} == set(grads)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("kind", ["positional", "keyword"])
def test_several_inputs_equal_the_unsplit_model(worlds, p, schedule, kind):
    """10 rows in 4 micro-batches (3, 3, 2, 2): every tensor of the inputs and targets is cut
    alike; the plain ``shift`` and the ``None`` reach every micro-batch whole."""
    v = virtual_for(schedule)
    if schedule_status(schedule, p, 4, v) is not None:
        pytest.skip(f"{schedule} with p={p}, m=4: {schedule_status(schedule, p, 4, v)}")
    balance = [1] * 8 if p * v == 8 else [2, 2, 2, 2] if p * v == 4 else [4, 4]
    case = {"kind": kind, "p": p, "v": v, "schedule": schedule, "balance": balance, "m": 4,
            "rows": 10, "seed": 3}
    _check(worlds(p).run(_on_rank, case), case)


def test_declared_shapes_with_keyword_inputs(worlds):
    """``shapes=`` declares the stage outputs; the inputs being a dict changes nothing."""
    case = {"kind": "keyword", "p": 2, "v": 1, "schedule": "1f1b", "balance": [3, 5], "m": 4,
            "rows": 8, "seed": 5, "shapes": (2, D)}
    _check(worlds(2).run(_on_rank, case), case)


def test_one_rank_with_remat_and_mutable():
    """One process, three stages handed over locally: with ``remat=`` (the UnitInputs go
    through remat's pytree) and with ``mutable=True`` (the spread reaches apply(mutable=))."""
    inputs, targets = make_batch("keyword", 7)
    loss, grads, _ = reference("keyword", 1, inputs, targets)
    for options in ({"remat": sf.checkpoint_policies.nothing_saveable}, {}):
        pp = pipeline_stages(units("keyword"), sf.Mesh({"pp": 1}), "pp", balance=[2, 3, 3],
                             virtual=3, schedule="gpipe", microbatches=3,
                             loss_fn=weighted_mse, **options)
        found = pp.value_and_grad(pp.init(1), inputs, targets, mutable=not options)
        assert_close(found[0], loss)
        assert_close(found[1], grads)


# -- splitting (torch's test_microbatch.py) -------------------------------------------------
def test_split_and_merge_keyword_and_positional():
    """Every tensor is cut on dim 0 into the same rows; plain values and None go whole; the
    pieces concatenate back into the batch."""
    x0, x1 = torch.randn(6, 5), torch.arange(6)
    whole = UnitInputs((x0, 3, None), {"x1": x1, "name": "a", "pair": (x0, 2.5)})
    pieces = split_microbatches(whole, 4)
    assert [p.args[0].shape[0] for p in pieces] == [2, 2, 1, 1]
    for piece in pieces:
        assert isinstance(piece, UnitInputs)
        assert piece.args[1:] == (3, None) and piece.kwargs["name"] == "a"
        assert piece.kwargs["pair"][1] == 2.5
        assert torch.equal(piece.kwargs["pair"][0], piece.args[0])
    assert torch.equal(torch.cat([p.args[0] for p in pieces]), x0)
    assert torch.equal(torch.cat([p.kwargs["x1"] for p in pieces]), x1)
    assert split_microbatches(None, 3) == [None, None, None]


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 4), extra=st.integers(0, 9), keyword=st.booleans(),
       widths=st.lists(st.integers(1, 3), min_size=1, max_size=3))
def test_split_property(m, extra, keyword, widths):
    """Any rows >= m, any number of leaves: micro-batch i holds the same rows of every leaf,
    sizes differ by at most one, and the pieces rebuild each leaf."""
    rows = m + extra
    leaves = [torch.randn(rows, w) for w in widths]
    inputs = {f"a{i}": t for i, t in enumerate(leaves)} if keyword else tuple(leaves)
    assert check_batch(inputs, {"t": torch.zeros(rows)}, m, False) == rows
    pieces = split_microbatches(as_unit_inputs(inputs), m)
    got = [list(p.kwargs.values()) if keyword else list(p.args) for p in pieces]
    sizes = [piece[0].shape[0] for piece in got]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == rows
    start = 0
    for piece, size in zip(got, sizes, strict=True):
        for leaf, part in zip(leaves, piece, strict=True):
            assert torch.equal(part, leaf[start:start + size])
        start += size


# -- refusals -----------------------------------------------------------------------------
def test_bad_batches_are_refused_naming_the_leaf():
    x, mask = torch.randn(6, 4), torch.ones(6, D)
    with pytest.raises(ValueError, match=r"inputs\.1 has 5 rows on dim 0, but inputs\.0 has 6"):
        check_batch((x, mask[:5]), None, 2, False)
    with pytest.raises(ValueError, match=r"inputs\.x has 6 rows on dim 0, but inputs\.scale "
                                         r"has 4"):  # a dict's leaves in sorted key order
        check_batch({"x": x, "scale": torch.ones(4, 1)}, None, 2, False)
    with pytest.raises(ValueError, match=r"targets\.weight has 5 rows on dim 0, but the inputs "
                                         r"have 6"):
        check_batch((x, mask), {"y": torch.zeros(6), "weight": torch.zeros(5)}, 2, False)
    with pytest.raises(ValueError, match=r"inputs\.scale is a 0-dim tensor"):
        check_batch({"x": x, "scale": torch.tensor(2.0)}, None, 2, False)
    with pytest.raises(ValueError, match="targets must be a tensor with the inputs' batch"):
        check_batch((x, mask), 3, 2, False)
    with pytest.raises(TypeError, match="hold no tensor"):
        check_batch({"scale": 2.0}, None, 1, False)
    with pytest.raises(TypeError, match=r"keyword names \['mutable'\]"):
        check_batch({"x": x, "mutable": True}, None, 1, False)
    with pytest.raises(TypeError, match="got str"):
        check_batch("x", None, 1, False)
    with pytest.raises(ValueError, match=r"batch \(6 rows\) must split evenly into 4"):
        check_batch((x, mask), None, 4, True)


def test_pipeline_refuses_different_rows_before_running():
    pp = pipeline_stages(units("positional"), sf.Mesh({"pp": 1}), "pp", balance=[8],
                         microbatches=2, loss_fn=weighted_mse)
    (x, mask), targets = make_batch("positional", 6)
    with pytest.raises(ValueError, match=r"inputs\.1 has 4 rows"):
        pp.value_and_grad(pp.init(0), (x, mask[:4]), targets)
    with pytest.raises(ValueError, match=r"inputs\.1 has 4 rows"):
        pp.apply(pp.init(0), (x, mask[:4]))


@pytest.mark.parametrize("kind", ["positional", "keyword"])
def test_several_inputs_into_transformed_stage_models(kind):
    """A stage model (here ``shard_params`` per stage) takes the batch's several inputs:
    its first unit gets them spread, as a plain stage does; equal to the unsplit model."""
    pp = pipeline_stages(units(kind), sf.Mesh({"pp": 1, "dp": 1}), "pp", balance=[5, 3],
                         virtual=2, schedule="interleaved", microbatches=2,
                         loss_fn=weighted_mse,
                         stage_transform=lambda fm, mesh: sf.shard_params(fm, mesh, "dp"))
    inputs, targets = make_batch(kind, 4)
    loss, grads = pp.value_and_grad(pp.init(0), inputs, targets)
    want_loss, want_grads, _ = reference(kind, 0, inputs, targets)
    assert_close(loss, want_loss)
    full = pp.gather(grads)
    assert sorted(full) == sorted(want_grads)
    for name, grad in want_grads.items():
        assert_close(full[name], grad, msg=name)


def _other_structure(check: bool):
    before = sf.check_consistency()
    sf.check_consistency(check)
    try:
        pp = pipeline_stages(units("positional"), sf.Mesh({"pp": 2}), "pp", balance=[4, 4],
                             microbatches=2, loss_fn=weighted_mse)
        (x, mask), targets = make_batch("positional", 6)
        inputs = (x, mask) if pp.rank == 0 else (x, mask, 1)   # same rows, another tuple
        try:
            pp.value_and_grad(pp.init(0), inputs, targets)
        except ValueError as error:
            return str(error)
        return None
    finally:
        sf.check_consistency(before)


@pytest.mark.parametrize("check", [True, False])
def test_ranks_given_other_structures_all_raise(worlds, check):
    """The rows agree, the structure does not: the digest exchanged at the step's start
    tells every rank (check mode or not), before stage 0 reads anything."""
    for found in worlds(2).run(_other_structure, check):
        assert found is not None, "a loss came back from different batches"
        assert "another structure" in found and "pp ranks [0] vs pp ranks [1]" in found, found
