"""tensor_split misuse is refused (issue 22, item 3 and its crashes), never a wrong number.

Check mode (on in the local world) compares what must be equal over the tp axis:
the inputs entering a split region, the initial parameters and the plan. Token ids
outside the vocabulary raise IndexError in every mode, as the unsplit embedding
does. ``sf.gather``/``sf.shard`` take fused (and FSDP x TP) layouts; gather_params
takes a subset of the leaves; a list plan and a too-long spec get clear errors.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import GPT, GPTConfig, gpt_tp_plan
from shardfn.transforms.tensor_split import Colwise, tensor_split

MLP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}


class MLP(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 8):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.register_buffer("scale", torch.ones(d))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)))) * self.scale


class QKV(nn.Module):
    """A fused [q|k|v] projection (detected from the name) and an embedding split on rows."""

    def __init__(self, vocab: int = 6, d: int = 4):
        super().__init__()
        self.head_dim = 2
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, ids):
        return self.qkv(self.emb(ids))


def _gpt(vocab: int = 8) -> sf.FunctionalModel:
    return sf.functional(GPT(GPTConfig(vocab_size=vocab, d_model=8, n_layers=1, n_heads=2,
                                       seq_len=4, dropout=0.0)))


def _raised(fn, *args, **kwargs) -> tuple[str, str]:
    """``(type name, message)`` of what ``fn`` raised, ``("", "")`` when it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test looks at what was raised
        return type(error).__name__, str(error)
    return "", ""


# ---------------------------------------------------------------- item 3: check mode


def _different_inputs_on_rank(kind: str):
    rank = torch.distributed.get_rank()
    mesh = sf.Mesh({"tp": 2})
    if kind == "mlp":
        tp = tensor_split(sf.functional(MLP()), mesh, "tp", MLP_PLAN)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))  # per rank
    else:  # GPT with its sequence-parallel plan: the ids enter the Vocab embedding
        tp = tensor_split(_gpt(), mesh, "tp", gpt_tp_plan(sequence_parallel=True))
        x = torch.tensor([[rank, 1, 2, 3]])
    return _raised(tp.apply, tp.init(0), x)


@pytest.mark.parametrize("kind", ["mlp", "gpt_sp"])
def test_different_inputs_per_tp_rank_raise_naming_the_input_and_rank(worlds, kind):
    for name, message in worlds(2).run(_different_inputs_on_rank, kind):
        assert name == "ConsistencyError", message
        assert "rank 1" in message and ("input args.0" in message if kind == "mlp"
                                        else "'ids'" in message or "ids:" in message)


def _seed_per_rank_on_rank(fsdp: bool):
    rank = torch.distributed.get_rank()
    if fsdp:
        mesh = sf.Mesh({"dp": 1, "tp": 2})
        model = sf.shard_params(tensor_split(sf.functional(MLP()), mesh, "tp", MLP_PLAN),
                                mesh, "dp")
    else:
        model = tensor_split(sf.functional(MLP()), sf.Mesh({"tp": 2}), "tp", MLP_PLAN)
    return _raised(model.init, rank)


@pytest.mark.parametrize("fsdp", [False, True])
def test_rank_dependent_init_seed_raises(worlds, fsdp):
    for name, message in worlds(2).run(_seed_per_rank_on_rank, fsdp):
        assert name == "ConsistencyError", message
        assert "same seed" in message and "leaf 'fc1.weight'" in message


def _different_plans_on_rank(at: str):
    rank = torch.distributed.get_rank()
    plan = MLP_PLAN if rank == 0 else {"fc1": Colwise(gather_output=True)}
    fmodel = sf.functional(MLP())
    tp = tensor_split(fmodel, sf.Mesh({"tp": 2}), "tp", plan)
    start = time.monotonic()
    if at == "init":
        got = _raised(tp.init, 0)
    else:  # shards made without a checked init (cut: no communication)
        got = _raised(tp.apply, tp.cut(fmodel.init(0)), torch.ones(2, 4))
    return (*got, time.monotonic() - start)


@pytest.mark.parametrize("at", ["init", "apply"])
def test_ranks_with_different_plans_raise_clearly_not_hang(worlds, at):
    for name, message, seconds in worlds(2).run(_different_plans_on_rank, at):
        assert name == "ConsistencyError", message
        assert "plan['fc1']" in message and "Colwise(gather_output=True" in message
        assert "plan['fc2']" in message and "<absent>" in message
        assert seconds < 10  # before: a 20 s hang or torch's matmul shape error


def _bad_ids_on_rank(check: bool, bad: int, sequence_parallel: bool):
    before = sf.check_consistency()
    sf.check_consistency(check)
    try:
        tp = tensor_split(_gpt(8), sf.Mesh({"tp": 2}), "tp",
                          gpt_tp_plan(sequence_parallel=sequence_parallel))
        return _raised(tp.apply, tp.init(0), torch.tensor([[0, bad, 3, 1]]))
    finally:
        sf.check_consistency(before)


@pytest.mark.parametrize("check, bad, sequence_parallel",
                         [(True, 8, False), (False, -1, False), (False, 11, True)])
def test_out_of_vocabulary_ids_raise_index_error_in_every_mode(worlds, check, bad,
                                                               sequence_parallel):
    gpt = _gpt(8)
    with pytest.raises(IndexError):  # the unsplit model
        gpt.apply(gpt.init(0), torch.tensor([[0, bad, 3, 1]]))
    for name, message in worlds(2).run(_bad_ids_on_rank, check, bad, sequence_parallel):
        assert name == "IndexError", message  # before: looked up as zeros, loss 3.0
        assert "'tok'" in message and "[0, 8)" in message and f"id {bad}" in message


# ---------------------------------------------------------------- crashes


def _gather_subset_on_rank():
    fmodel = sf.functional(MLP())
    tp = tensor_split(fmodel, sf.Mesh({"tp": 2}), "tp", MLP_PLAN)
    params = tp.init(0)
    trainable, rest = tp.split_trainable(params)
    x = torch.arange(8.0).reshape(2, 4)
    grads = torch.func.grad(lambda t: tp.apply(tp.merge(t, rest), x).square().sum())(trainable)
    return tp.gather_params(grads), _raised(tp.gather_params, {"nope": grads["fc1.weight"]})


def test_gather_params_of_a_gradient_subset(worlds):
    fmodel = sf.functional(MLP())
    params = fmodel.init(0)
    trainable, rest = fmodel.split_trainable(params)
    x = torch.arange(8.0).reshape(2, 4)
    expected = torch.func.grad(
        lambda t: fmodel.apply(fmodel.merge(t, rest), x).square().sum())(trainable)
    for full, (name, message) in worlds(2).run(_gather_subset_on_rank):
        assert_close(full, expected)  # before: "missing buffers"
        assert name == "ValueError" and "'nope'" in message


def _fused_gather_on_rank(dp: int, tp: int):
    mesh = sf.Mesh({"dp": dp, "tp": tp})
    fmodel = sf.functional(QKV())
    tp = tensor_split(fmodel, mesh, "tp", {"emb": "vocab", "qkv": "colwise"})
    full = fmodel.init(0)
    fsdp = sf.shard_params(tp, mesh, "dp")
    tp_params, shards = tp.init(0), fsdp.init(0)
    return {
        "fused": isinstance(tp.specs["qkv.weight"], sf.FusedLayout),
        "tp_gather": sf.gather(tp_params, tp.specs, mesh),
        "tp_shard_equal": all(torch.equal(a, tp_params[n])
                              for n, a in sf.shard(full, tp.specs, mesh).items()),
        "fsdp_gather": sf.gather(shards, fsdp.specs, mesh),
        "fsdp_shard_equal": all(torch.equal(a, shards[n])
                                for n, a in sf.shard(full, fsdp.specs, mesh).items()),
        "grad_subset": sf.gather({"qkv.weight": shards["qkv.weight"]},
                                 {"qkv.weight": fsdp.specs["qkv.weight"]}, mesh),
    }


def test_sf_gather_and_shard_take_fused_and_fsdp_tp_layouts(worlds):
    full = sf.functional(QKV()).init(0)
    for got in worlds(2).run(_fused_gather_on_rank, 1, 2):  # (dp 2 x tp 2: checked by hand)
        assert got["fused"]
        assert_close(got["tp_gather"], full)  # before: TypeError, FusedLayout refused
        assert_close(got["fsdp_gather"], full)
        assert got["tp_shard_equal"] and got["fsdp_shard_equal"]
        assert_close(got["grad_subset"]["qkv.weight"], full["qkv.weight"])


def test_fused_layout_round_trips_and_refuses_an_uneven_split():
    mesh = sf.Mesh({"tp": 1})
    x = torch.arange(12.0).reshape(6, 2)
    layout = sf.FusedLayout("tp", 3, (6, 2))
    assert torch.equal(sf.gather(sf.shard(x, layout, mesh), layout, mesh), x)
    with pytest.raises(ValueError, match="divisible by parts"):
        sf.shard(torch.zeros(5, 2), sf.FusedLayout("tp", 3, (5, 2)), mesh)
    with pytest.raises(ValueError, match="names axis 'dp'"):
        sf.gather(x, sf.FusedLayout("dp", 3, (6, 2)), mesh)


@pytest.mark.parametrize("plan", [[("fc1", "colwise"), ("fc2", "rowwise")], "colwise",
                                  {0: "colwise"}])
def test_a_plan_that_is_not_a_dict_of_globs_raises_type_error(plan):
    with pytest.raises(TypeError, match="plan") as error:  # before: AttributeError
        tensor_split(sf.functional(MLP()), sf.Mesh({"tp": 1}), "tp", plan)
    if isinstance(plan, list):
        assert "dict(pairs)" in str(error.value)


def test_local_shape_with_a_spec_longer_than_the_shape_raises_value_error():
    mesh = sf.Mesh({"dp": 1})
    with pytest.raises(ValueError, match=r"local_shape: spec P\(None, 'dp'\)"):  # was IndexError
        sf.spec.local_shape((3,), sf.P(None, "dp"), mesh)
    assert sf.spec.local_shape((3,), sf.P("dp", None), mesh) == (3,)  # trailing None: fine


@pytest.mark.parametrize("style", [lambda: Colwise(n_heads=0), lambda: Colwise(fused="3"),
                                   lambda: sf.Rowwise(sequence_parallel=1),
                                   lambda: sf.SequenceParallel(sequence_dim=None)])
def test_style_fields_of_the_wrong_type_raise_value_error(style):
    with pytest.raises(ValueError, match="is not valid"):  # before: ZeroDivisionError, ...
        style()
