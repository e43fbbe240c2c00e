"""Every model kind has every member of the model protocol, and they agree (issue 23).

For the unsharded model, ``shard_params`` (ZeRO-3, HSDP), ``tensor_split``, FSDP x TP
and ``with_precision`` on 1 and 2 ranks (HSDP x ZeRO-3 on 4): ``missing_members`` is
empty; ``shard(full) == init(seed)``; ``gather(init(seed)) == functional.init(seed)``;
the trainable part round-trips through ``shard``/``gather``; ``gather`` of the gradient
``torch.func.grad`` gives w.r.t. the trainable part is the unsharded gradient;
``params_from(module) == shard(functional.params_from(module))``;
``sf.gather(tree, model.specs, model.mesh) == model.gather(tree)``; a name that is not a
leaf and a leaf of the wrong shape are refused, named.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.model import missing_members

SEED = 3
PLAN = {"fc1": "colwise", "fc2": "rowwise"}


class Net(nn.Module):
    """Split-able MLP, uneven rows (5 over 2 ranks), a frozen layer, a buffer, a 0-dim leaf."""

    def __init__(self, d: int = 4, hidden: int = 6, out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out)
        self.skip = nn.Linear(d, out)
        self.skip.requires_grad_(False)
        self.ln = nn.LayerNorm(out)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, out))

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x))) + self.skip(x)
        return self.ln(y) * self.scale * self.temperature


#: kind -> {world size: mesh shape}
KINDS = {
    "functional": {1: None, 2: None},
    "shard_params": {1: {"dp": 1}, 2: {"dp": 2}},
    "hsdp": {1: {"rep": 1, "dp": 1}, 2: {"rep": 2, "dp": 1}, 4: {"rep": 2, "dp": 2}},
    "tensor_split": {1: {"tp": 1}, 2: {"tp": 2}},
    "fsdp_tp": {1: {"dp": 1, "tp": 1}, 2: {"dp": 1, "tp": 2}},
    "fsdp_tp_dp": {2: {"dp": 2, "tp": 1}},
    "precision": {1: None, 2: None},
    "precision_tp": {1: {"tp": 1}, 2: {"tp": 2}},
}
CASES = [(kind, n) for kind, sizes in KINDS.items() for n in sizes]


def _inputs(d: int = 4) -> torch.Tensor:
    return torch.randn(3, d, generator=torch.Generator().manual_seed(7))


def _build(kind: str, shape: dict | None, dims: tuple[int, int, int] = (4, 6, 5)):
    """``(model, fmodel, module)``: the model of ``kind`` over ``shape``, its functional."""
    torch.manual_seed(0)
    module = Net(*dims)
    fm = sf.functional(module)
    mesh = sf.Mesh(shape) if shape is not None else None
    policy = sf.Precision(param_dtype=torch.float64)
    if kind == "functional":
        model = fm
    elif kind == "shard_params":
        model = sf.shard_params(fm, mesh, "dp", units=["fc1", "fc2"])
    elif kind == "hsdp":
        model = sf.shard_params(fm, mesh, "dp", replicate_axis="rep")
    elif kind == "tensor_split":
        model = sf.tensor_split(fm, mesh, "tp", PLAN)
    elif kind in ("fsdp_tp", "fsdp_tp_dp"):
        model = sf.shard_params(sf.tensor_split(fm, mesh, "tp", PLAN), mesh, "dp", units=["fc1"])
    elif kind == "precision":
        model = sf.with_precision(fm, policy)
    else:
        model = sf.with_precision(sf.tensor_split(fm, mesh, "tp", PLAN), policy)
    return model, fm, module


def _loss(model, trainable, rest, x):
    return model.apply(model.merge(trainable, rest), x).square().sum()


def _members_on_rank(kind: str, shape: dict | None, dims: tuple[int, int, int]) -> dict:
    model, fm, module = _build(kind, shape, dims)
    full = fm.init(SEED)
    shards = model.init(SEED)
    trainable, rest = model.split_trainable(shards)
    full_trainable, _ = fm.split_trainable(full)
    grads = torch.func.grad(_loss, argnums=1)(model, trainable, rest, _inputs(dims[0]))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    mesh = model.mesh if model.mesh is not None else sf.Mesh({"dp": world})  # specs: all P()
    errors = {}
    for what, call in (("unknown", lambda: model.shard({"fc1.wieght": full["fc1.weight"]})),
                       ("shape", lambda: model.shard({"fc2.weight": full["fc1.weight"]}))):
        try:
            call()
        except (TypeError, ValueError) as error:
            errors[what] = f"{type(error).__name__}: {error}"
    return dict(
        missing=missing_members(model), functional_is_fm=model.functional is fm,
        names=(model.names, model.param_names, model.buffer_names, model.trainable_names,
               model.frozen_names),
        init=shards, shard=model.shard(full), gather=model.gather(shards),
        gather_trainable=model.gather(trainable), shard_trainable=model.shard(full_trainable),
        trainable=trainable, grads=model.gather(grads),
        params_from=model.params_from(module),
        shard_params_from=model.shard(fm.params_from(module)),
        sf_gather=sf.gather(shards, model.specs, mesh),
        sf_gather_grads=sf.gather(grads, {n: model.specs[n] for n in grads}, mesh),
        errors=errors)


def _reference(dims: tuple[int, int, int] = (4, 6, 5)) -> tuple[dict, dict, dict]:
    torch.manual_seed(0)
    fm = sf.functional(Net(*dims))
    full = fm.init(SEED)
    trainable, rest = fm.split_trainable(full)
    grads = torch.func.grad(_loss, argnums=1)(fm, trainable, rest, _inputs(dims[0]))
    return fm, full, grads


def _equal(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def _check(results: list[dict], kind: str, dims: tuple[int, int, int] = (4, 6, 5)) -> None:
    fm, full, grads = _reference(dims)
    names = (fm.names, fm.param_names, fm.buffer_names, fm.trainable_names, fm.frozen_names)
    for got in results:
        assert got["missing"] == []
        assert got["names"] == names
        assert got["functional_is_fm"]
        _equal(got["shard"], got["init"])
        _equal(got["gather"], full)
        _equal(got["sf_gather"], got["gather"])
        _equal(got["gather_trainable"], {n: full[n] for n in fm.trainable_names})
        _equal(got["shard_trainable"], got["trainable"])
        _equal(got["params_from"], got["shard_params_from"])
        assert list(got["grads"]) == list(grads)
        assert_close(got["grads"], grads, rtol=1e-5, atol=1e-5)
        _equal(got["sf_gather_grads"], got["grads"])
        assert "'fc1.wieght'" in got["errors"]["unknown"] and "fc1.weight" in got["errors"][
            "unknown"], got["errors"]
        assert got["errors"]["shape"].startswith("ValueError") and "fc2.weight" in got[
            "errors"]["shape"], got["errors"]


@pytest.mark.parametrize(("kind", "n"), CASES)
def test_every_kind_has_every_member_and_they_agree(worlds, kind, n):
    results = worlds(n).run(_members_on_rank, kind, KINDS[kind][n], (4, 6, 5))
    _check(results, kind)
    if n > 1 and kind in ("shard_params", "tensor_split", "fsdp_tp"):  # really split
        assert any(results[0]["init"][name].shape != v.shape
                   for name, v in results[0]["gather"].items())


@settings(max_examples=4, deadline=None)
@given(d=st.integers(1, 5), hidden=st.sampled_from([2, 4, 6]), out=st.integers(1, 5),
       kind=st.sampled_from(["shard_params", "fsdp_tp_dp", "hsdp"]))
def test_uneven_shapes_round_trip_on_two_ranks(worlds, d, hidden, out, kind):
    """Uneven rows (padding) and tiny dims: shard/gather/grad still agree with the reference."""
    shape = KINDS[kind][2]
    _check(worlds(2).run(_members_on_rank, kind, shape, (d, hidden, out)), kind, (d, hidden, out))


def test_gather_refuses_a_full_leaf_of_a_split_model(worlds):
    def on_rank():
        model, fm, _ = _build("shard_params", {"dp": 2})
        try:
            model.gather({"fc1.weight": fm.init(0)["fc1.weight"]})
        except ValueError as error:
            return str(error)
        return ""

    for message in worlds(2).run(on_rank):
        assert "fc1.weight" in message and "(6, 4)" in message and "(3, 4)" in message, message
