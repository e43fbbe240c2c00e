"""Outputs and arguments in containers optree does not know carry their gradients (issue #22.1).

HF models return a ``ModelOutput`` (a dataclass and an ``OrderedDict`` subclass); under
``shard_params`` its tensors used to stay inside a constant of the unit's
``autograd.Function`` and every gradient came out 0. The property: for every container
kind (dataclass, frozen dataclass, dict / OrderedDict subclasses, NamedTuple, list and
tuple subclasses, nested builtins, a ModelOutput look-alike) returned by a unit and by the
root, and taken by the unit as its argument, every model kind (functional,
``shard_params`` with and without units, ``tensor_split``, FSDP x TP, precision- and
remat-wrapped) gives the unsharded gradients under ``torch.func.grad`` and under
``loss.backward()``, on 1 and 2 ranks. Then: the issue's snippet, a tiny HF Llama, a
pipeline whose last stage returns a container, and clear TypeErrors for a container that
cannot be taken apart.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn import pytree

# ---------------------------------------------------------------- container kinds


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    aux: Any
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    y: torch.Tensor
    aux: Any


class ODict(collections.OrderedDict):
    pass


class PlainDict(dict):
    def __init__(self, **kw):  # a constructor that is not dict's
        super().__init__(**kw)
        self.tag = "t"


class Pair(NamedTuple):
    y: torch.Tensor
    aux: Any


class MyList(list):
    pass


class MyTuple(tuple):
    __slots__ = ()


class FakeModelOutput(collections.OrderedDict):
    """HF's ModelOutput, in short: a dataclass whose non-None fields are also its items."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@dataclasses.dataclass
class LMOut(FakeModelOutput):
    loss: torch.Tensor | None = None
    y: torch.Tensor | None = None
    aux: Any = None


# kind -> (make(y, aux), read(out) -> (y, aux)); read does not use shardfn's helpers
KINDS = {
    "dataclass": (lambda y, a: Out(y, [a, 2]), lambda o: (o.y, o.aux[0])),
    "frozen_dataclass": (lambda y, a: FrozenOut(y, (a,)), lambda o: (o.y, o.aux[0])),
    "odict_subclass": (lambda y, a: ODict(y=y, aux=a), lambda o: (o["y"], o["aux"])),
    "dict_subclass": (lambda y, a: PlainDict(y=y, aux={"in": a}),
                      lambda o: (o["y"], o["aux"]["in"])),
    "namedtuple": (lambda y, a: Pair(y, MyList([a])), lambda o: (o.y, o.aux[0])),
    "list_tuple_subclass": (lambda y, a: MyTuple((y, MyList([None, a]))),
                            lambda o: (o[0], o[1][1])),
    "nested_builtins": (lambda y, a: {"out": [(y, {"a": a}), 3]},
                        lambda o: (o["out"][0][0], o["out"][0][1]["a"])),
    "model_output": (lambda y, a: LMOut(y=y, aux=a), lambda o: (o["y"], o.aux)),
}


class Body(nn.Module):
    """A unit that takes a container and returns one."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 4)

    def forward(self, packed):
        make, read = KINDS[self.kind]
        x, scale = read(packed)
        hidden = torch.tanh(self.fc1(x * scale))
        return make(self.fc2(hidden), hidden.sum(-1))


class Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.body = Body(kind)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        make, read = KINDS[self.kind]
        y, aux = read(self.body(make(x, torch.full_like(x[:, :1], 0.5))))
        return make(self.head(y), aux * 2)


def loss_of(kind: str, out) -> torch.Tensor:
    y, aux = KINDS[kind][1](out)
    return (y ** 2).sum() + (aux * torch.linspace(-1, 1, aux.numel()).view_as(aux)).sum()


# ---------------------------------------------------------------- the property

TP_PLAN = {"body.fc1": "colwise", "body.fc2": "rowwise"}


def _wrap(model_kind: str, fm, n: int):
    """``(model, gather(grads) -> full grads, reference functional model)``."""
    from shardfn.transforms.precision import Precision

    if model_kind == "functional":
        return fm, lambda g: g, fm
    if model_kind in ("shard_params", "shard_params_units"):
        mesh = sf.Mesh({"dp": n})
        units = ["body"] if model_kind == "shard_params_units" else None
        model = sf.shard_params(fm, mesh, "dp", units=units)
        return model, lambda g: sf.gather(g, {k: model.specs[k] for k in g}, mesh), fm
    if model_kind == "tensor_split":
        mesh = sf.Mesh({"tp": n})
        model = sf.tensor_split(fm, mesh, "tp", TP_PLAN)
        return model, lambda g: sf.gather(g, {k: model.specs[k] for k in g}, mesh), fm
    if model_kind == "fsdp_tp":
        mesh = sf.Mesh({"dp": 1, "tp": n})
        model = sf.shard_params(sf.tensor_split(fm, mesh, "tp", TP_PLAN), mesh, "dp",
                                units=["body"])
        return model, model.gather_params, fm
    if model_kind in ("precision", "precision_wrapped"):  # float64 compute on both sides
        policy = Precision(param_dtype=torch.float64, output_dtype=torch.float32)
        mesh = sf.Mesh({"dp": n})
        if model_kind == "precision":  # shard_params' own policy
            model = sf.shard_params(fm, mesh, "dp", units=["body"], precision=policy)
        else:  # with_precision around the sharded model
            model = sf.with_precision(sf.shard_params(fm, mesh, "dp", units=["body"]), policy)
        gather = lambda g: sf.gather(g, {k: model.specs[k] for k in g}, mesh)  # noqa: E731
        return model, gather, sf.with_precision(fm, policy)
    if model_kind == "shard_params_remat":
        mesh = sf.Mesh({"dp": n})
        model = sf.shard_params(fm, mesh, "dp", units=["body"],
                                remat=sf.checkpoint_policies.dots_saveable)
        return model, lambda g: sf.gather(g, {k: model.specs[k] for k in g}, mesh), fm
    if model_kind == "remat":
        remat_apply = sf.remat(fm.apply)
        return _Applied(fm, remat_apply), lambda g: g, fm
    raise AssertionError(model_kind)


@dataclasses.dataclass
class _Applied:
    """A functional model whose apply is replaced (remat-wrapped)."""

    fm: Any
    fn: Any

    def apply(self, params, *args):
        return self.fn(params, *args)


def _grads(kind: str, model, params: dict, x: torch.Tensor, how: str) -> dict:
    def loss(p):
        return loss_of(kind, model.apply(p, x))

    if how == "func":
        return torch.func.grad(loss)(params)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    loss(leaves).backward()
    return {k: v.grad for k, v in leaves.items()}


def _on_rank(case: dict) -> dict:
    import torch

    import shardfn as sf  # noqa: F401  (the rank's own import)

    torch.manual_seed(0)
    kind, model_kind, n = case["kind"], case["model"], case["n"]
    fm = sf.functional(Net(kind))
    full = fm.init(case["seed"])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(case["seed"]))
    model, gather, ref_model = _wrap(model_kind, fm, n)
    local = full if model_kind in ("functional", "remat") else model.init(case["seed"])
    out = {}
    for how in ("func", "autograd"):
        out[how] = {k: v.detach() for k, v in gather(_grads(kind, model, local, x, how)).items()}
    out["reference"] = _grads(kind, ref_model, full, x, "autograd")
    return out


MODEL_KINDS = ["functional", "shard_params", "shard_params_units", "shard_params_remat",
               "tensor_split", "fsdp_tp", "precision", "precision_wrapped", "remat"]


@settings(max_examples=5, deadline=None)
@given(kind=st.sampled_from(sorted(KINDS)), model=st.sampled_from(MODEL_KINDS),
       n=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_every_model_kind_gives_unsharded_grads_through_every_container(worlds, kind, model, n,
                                                                         seed):
    if model in ("functional", "remat"):
        n = 1
    case = {"kind": kind, "model": model, "n": n, "seed": seed}
    results = worlds(n).run(_on_rank, case) if n > 1 else [_on_rank(case)]
    for rank, result in enumerate(results):
        ref = result["reference"]
        assert any(g.abs().sum() > 0 for g in ref.values())
        for how in ("func", "autograd"):
            got = result[how]
            assert set(got) == set(ref), (how, rank)
            for name in ref:
                assert_close(got[name], ref[name], msg=lambda m, name=name, how=how, rank=rank:
                             f"{kind}/{model}/n={n} {how} rank {rank} {name}: {m}")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_container_kind_round_trips_under_shard_params(kind):
    """Every kind, in-process (mesh of 1): the sharded apply's value and gradients."""
    _check_local(kind, "shard_params_units")


@pytest.mark.parametrize("model_kind", MODEL_KINDS)
def test_every_model_kind_carries_a_model_output_in_process(model_kind):
    """Every model kind, in-process (meshes of 1), with the ModelOutput look-alike."""
    _check_local("model_output", model_kind)


def _check_local(kind: str, model_kind: str) -> None:
    result = _on_rank({"kind": kind, "model": model_kind, "n": 1, "seed": 3})
    for how in ("func", "autograd"):
        for name, ref in result["reference"].items():
            assert_close(result[how][name], ref, msg=f"{how} {name}")


# ---------------------------------------------------------------- regressions


def test_issue_snippet_dataclass_output_gets_gradients():
    @dataclasses.dataclass
    class Out1:
        y: torch.Tensor

    class Net1(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x):
            return Out1(self.fc(x))

    fm = sf.functional(Net1())
    sp = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp")
    p, x = fm.init(0), torch.randn(3, 4)
    got = torch.func.grad(lambda s: sp.apply(s, x).y.sum())(sp.shard(p))["fc.weight"]
    want = torch.func.grad(lambda s: fm.apply(s, x).y.sum())(p)["fc.weight"]
    assert want.abs().sum() > 0
    assert_close(got, want)
    leaves = {k: v.detach().requires_grad_() for k, v in sp.shard(p).items()}
    sp.apply(leaves, x).y.sum().backward()  # was: setStorage ... out of bounds
    assert_close(leaves["fc.weight"].grad, want)


def test_remat_of_a_function_returning_a_dataclass():
    fn = sf.remat(lambda p, x: Out(x @ p["w"], x.sum()))
    w, x = torch.randn(4, 2), torch.randn(3, 4)
    got = torch.func.grad(lambda w: fn({"w": w}, x).y.sum())(w)
    assert_close(got, x.sum(0)[:, None].expand(4, 2))


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _llama_grads(model, params, ids, how: str, **kw) -> dict:
    train, rest = model.split_trainable(params)

    def loss(t):
        out = model.apply(model.merge(t, rest), ids, labels=ids, **kw)
        return out[0] if isinstance(out, tuple) else out.loss

    if how == "func":
        return torch.func.grad(loss)(train)
    leaves = {k: v.detach().requires_grad_() for k, v in train.items()}
    loss(leaves).backward()
    return {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("units", [None, ["model"]], ids=["root", "model-unit"])
@pytest.mark.parametrize("kw", [{}, {"return_dict": False}], ids=["ModelOutput", "tuple"])
def test_hf_llama_under_shard_params_gives_unsharded_grads(units, kw):
    fm = sf.functional(_tiny_llama())
    params = fm.init(0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _llama_grads(fm, params, ids, "func", **kw)
    sp = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp", units=units)
    for how in ("func", "autograd"):
        got = _llama_grads(sp, sp.shard(params), ids, how, **kw)
        assert set(got) == set(ref)
        zero = [n for n in ref if ref[n].abs().sum() > 0 and got[n].abs().sum() == 0]
        assert not zero, f"{how}: zero gradients for {zero}"
        for name in ref:
            assert_close(got[name], ref[name], msg=f"{how} {name}")


def _llama_on_rank(units_name: str | None) -> dict:
    import torch

    import shardfn as sf

    fm = sf.functional(_tiny_llama())
    params = fm.init(0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _llama_grads(fm, params, ids, "autograd")
    mesh = sf.Mesh({"dp": 2})
    sp = sf.shard_params(fm, mesh, "dp", units=None if units_name is None else [units_name])
    got = _llama_grads(sp, sp.init(0), ids, "func")
    got = sf.gather(got, {k: sp.specs[k] for k in got}, mesh)
    return {"ref": ref, "got": got}


@pytest.mark.world(2)
def test_hf_llama_on_two_ranks_gives_unsharded_grads():
    pytest.importorskip("transformers")
    result = _llama_on_rank("model")
    for name, ref in result["ref"].items():
        assert_close(result["got"][name], ref, msg=name)


def test_hf_decoder_layer_units_with_a_cache_refuse_clearly():
    """A unit that writes into an argument object (HF's DynamicCache) would have the
    write lost or made twice by the recompute: refused, naming use_cache=False."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    fm = sf.functional(_tiny_llama())
    params = fm.init(0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    sp = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp", units=LlamaDecoderLayer)
    with pytest.raises(ValueError, match="use_cache=False"):
        _llama_grads(sp, sp.shard(params), ids, "func", use_cache=True)
    ref = _llama_grads(fm, params, ids, "func", use_cache=False)
    got = _llama_grads(sp, sp.shard(params), ids, "func", use_cache=False)
    for name in ref:
        assert_close(got[name], ref[name], msg=name)


# ---------------------------------------------------------------- pipeline


class _Stage(nn.Module):
    def __init__(self, last: bool):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.last = last

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        return LMOut(y=y, aux=y.sum(-1)) if self.last else y


def _pipeline_on_rank(middle_container: bool) -> dict:
    import torch

    import shardfn as sf

    torch.manual_seed(0)
    units = [_Stage(middle_container), _Stage(True)]

    def loss_fn(out, target):
        return ((out.y - target) ** 2).mean() + out["aux"].mean()

    pp = sf.pipeline_stages(units, sf.Mesh({"pp": 2}), "pp", balance=[1, 1], microbatches=2,
                            loss_fn=loss_fn)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    target = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    try:
        loss, grads = pp.value_and_grad(pp.init(0), x, target)
    except Exception as error:  # noqa: BLE001 (every rank reports what it raised)
        return {"error": f"{type(error).__name__}: {error}"}
    fm = sf.functional(nn.Sequential(*units))
    full = fm.init(0)
    ref = torch.func.grad(lambda p: loss_fn(fm.apply(p, x), target))(full)
    return {"grads": grads, "ref": {k: ref[k] for k in grads}, "loss": loss}


def test_pipeline_last_stage_may_return_a_model_output(worlds):
    for result in worlds(2).run(_pipeline_on_rank, False):
        assert "error" not in result, result
        assert result["grads"], "every stage has parameters"
        for name, ref in result["ref"].items():
            assert_close(result["grads"][name], ref, msg=name)


def test_pipeline_refuses_a_container_between_stages_naming_it(worlds):
    results = worlds(2).run(_pipeline_on_rank, True)
    assert all("error" in r for r in results), results
    assert results[0]["error"].startswith("TypeError") and "LMOut" in results[0]["error"]
    assert "LMOut" in results[1]["error"]  # the peer says why it stopped


# ---------------------------------------------------------------- refusals


class Slotted:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


class RigidMapping(collections.abc.Mapping):
    def __init__(self, a, b):  # cannot be rebuilt from its items
        self._d = {"a": a, "b": b}

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return 2


@pytest.mark.parametrize("make", [lambda t: Slotted(t), lambda t: RigidMapping(t, 1)],
                         ids=["slots", "mapping"])
def test_a_container_that_cannot_be_taken_apart_is_refused_naming_its_type(make):
    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return {"out": make(self.fc(x))}

    fm = sf.functional(Net2())
    sp = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp")
    p, x = fm.init(0), torch.randn(3, 4)
    name = type(make(x)).__qualname__
    with pytest.raises(TypeError, match=rf"{name}.*namespace=\"shardfn\""):
        torch.func.grad(lambda s: sp.apply(s, x)["out"].t.sum())(sp.shard(p))
    with pytest.raises(TypeError, match=name):
        sf.remat(lambda x: make(x * 2))(x.clone().requires_grad_())


def test_containers_without_tensors_stay_whole_and_model_outputs_keep_their_keys():
    size, marker = torch.Size([2, 3]), object()
    leaves, spec = pytree.tree_flatten_deep({"s": size, "m": marker, "d": Out(None, 3)})
    assert isinstance(leaves[0], Out) and leaves[1] is marker and leaves[2] is size
    back = pytree.tree_unflatten_deep(spec, leaves)
    assert back["s"] is size and back["m"] is marker
    out = LMOut(loss=torch.ones(()), aux=torch.zeros(2))
    leaves, spec = pytree.tree_flatten_deep(out)
    assert len(leaves) == 2  # an item that is also a field is taken out once
    back = pytree.tree_unflatten_deep(spec, [t + 1 for t in leaves])
    assert type(back) is LMOut and list(back.keys()) == ["loss", "aux"] and back.y is None
    assert back["loss"] is back.loss and float(back.loss) == 2.0
