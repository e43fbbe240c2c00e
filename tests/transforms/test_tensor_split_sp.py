"""Sequence parallelism (Megatron-SP) under tensor_split equals the unsplit model.

* The reference GPT with ``gpt_tp_plan(sequence_parallel=...)``, both settings, on 2
  and 4 ranks, random widths, heads, vocabularies, sequence lengths and batches:
  the logits (vocab-gathered), the loss and every gradient equal the unsplit
  model's under ``torch.func.grad``, ``grad_and_value``, ``vjp`` and autograd. The
  gradients are compared *as each rank holds them* for replicated leaves: the
  LayerNorms, the position embedding and the rowwise biases run on sequence chunks
  in SP, so a missing sum over tp would leave each rank its chunk's part (caught).
* A user plan on a Megatron-layout block (``[T, B, d]``, ``sequence_dim=0``, an
  ``nn.RMSNorm``): the input and output are the rank's sequence chunk.
* Errors: a sequence not divisible by tp (names the module, dim and sizes), a
  replicated leaf without a sequence-parallel style, styles on modules they cannot run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import GPT, GPTConfig, gpt_tp_plan
from shardfn.transforms.tensor_split import (
    Colwise,
    Rowwise,
    SequenceParallel,
    SplitRNG,
    tensor_split,
)


def _gpt(case: dict):
    config = GPTConfig(vocab_size=case["vocab"], d_model=case["d"], n_layers=case["layers"],
                       n_heads=case["heads"], seq_len=8, dropout=0.0)
    generator = torch.Generator().manual_seed(case["seed"])
    tokens = torch.randint(0, case["vocab"], (case["b"], case["s"]), generator=generator)
    targets = torch.randint(0, case["vocab"], (case["b"], case["s"]), generator=generator)
    return sf.functional(GPT(config)), tokens, targets


def _gpt_on_rank(case: dict):
    fmodel, tokens, targets = _gpt(case)
    mesh = sf.Mesh({"tp": case["n"]})
    model = tensor_split(fmodel, mesh, "tp", gpt_tp_plan(sequence_parallel=case["sp"]))
    params = model.init(case["seed"])

    def loss_fn(p):
        return sf.vocab_parallel_cross_entropy(model.apply(p, tokens), targets, "tp", mesh=mesh)

    logits = sf.all_gather(model.apply(params, tokens), "tp", dim=-1, mesh=mesh)
    grads, loss = torch.func.grad_and_value(loss_fn)(params)
    plain_grads = torch.func.grad(loss_fn)(params)
    vjp_loss, vjp_fn = torch.func.vjp(loss_fn, params)
    (vjp_grads,) = vjp_fn(torch.ones_like(vjp_loss))
    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    loss_fn(leaves).backward()
    replicated = [n for n, layout in model.specs.items()
                  if not isinstance(layout, sf.FusedLayout) and all(p is None for p in layout.spec)]
    return {"logits": logits, "loss": loss, "vjp_loss": vjp_loss,
            "full": model.gather_params(params),
            "grads": model.gather_params(grads), "vjp": model.gather_params(vjp_grads),
            "grad": model.gather_params(plain_grads),
            "autograd": model.gather_params({n: t.grad for n, t in leaves.items()}),
            "local_replicated": {n: grads[n] for n in replicated}}


def _check_gpt(worlds, case: dict):
    fmodel, tokens, targets = _gpt(case)
    params = fmodel.init(case["seed"])

    def loss_fn(p):
        return F.cross_entropy(fmodel.apply(p, tokens).flatten(0, 1), targets.flatten())

    grads, loss = torch.func.grad_and_value(loss_fn)(params)
    logits = fmodel.apply(params, tokens)
    for got in worlds(case["n"]).run(_gpt_on_rank, case):
        assert_close(got["full"], params)
        assert_close(got["logits"], logits)
        assert_close(got["loss"], loss)
        assert_close(got["vjp_loss"], loss)
        for how in ("grads", "grad", "vjp", "autograd"):
            assert_close(got[how], grads)  # the tied tok/head weight included
        assert {"ln_f.weight", "pos.weight", "blocks.0.mlp.fc2.bias"} <= set(
            got["local_replicated"])
        for name, grad in got["local_replicated"].items():  # this rank's copy: the whole sum
            assert_close(grad, grads[name])


@pytest.mark.parametrize("sp", [False, True])
@settings(max_examples=3)
@given(n=st.sampled_from([2, 4]), heads_per_rank=st.integers(1, 2),
       head_dim=st.sampled_from([2, 4]), vocab_per_rank=st.integers(1, 3),
       chunk=st.integers(1, 2), b=st.integers(1, 2), layers=st.integers(1, 2),
       seed=st.integers(0, 2**16))
def test_reference_gpt_with_and_without_sequence_parallel_equals_unsplit(
        worlds, sp, n, heads_per_rank, head_dim, vocab_per_rank, chunk, b, layers, seed):
    heads = n * heads_per_rank
    _check_gpt(worlds, {"n": n, "sp": sp, "heads": heads, "d": heads * head_dim,
                        "vocab": n * vocab_per_rank, "s": n * chunk, "b": b,
                        "layers": layers, "seed": seed})


class SeqFirstBlock(nn.Module):
    """Megatron layout ``[T, B, d]``: RMSNorm -> fc1 -> GELU -> fc2 -> residual, then LayerNorm."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.out = nn.LayerNorm(d)

    def forward(self, x):
        return self.out(x + self.fc2(F.gelu(self.fc1(self.norm(x)))))


SEQ_FIRST_PLAN = {"norm": SequenceParallel(sequence_dim=0),
                  "fc1": Colwise(sequence_parallel=True, sequence_dim=0),
                  "fc2": Rowwise(sequence_parallel=True, sequence_dim=0),
                  "out": "sequence_parallel"}  # its dim does not matter: it only normalises


def _seq_first(seed: int, t: int):
    torch.manual_seed(seed)
    return sf.functional(SeqFirstBlock(8, 16)), torch.randn(t, 3, 8)


def _seq_first_on_rank(n: int, seed: int, t: int):
    fmodel, x = _seq_first(seed, t)
    mesh = sf.Mesh({"tp": n})
    model = tensor_split(fmodel, mesh, "tp", SEQ_FIRST_PLAN)
    params = model.init(seed)
    mine = x.chunk(n, dim=0)[mesh.index("tp")]  # this rank's positions
    weight = torch.linspace(-1.0, 1.0, t).reshape(-1, 1, 1).chunk(n, dim=0)[mesh.index("tp")]

    def loss_fn(p):  # each rank sums its chunk's part; psum_invariant: the loss, counted once
        return sf.psum_invariant((model.apply(p, mine) * weight).square().sum(), "tp", mesh=mesh)

    grads, loss = torch.func.grad_and_value(loss_fn)(params)
    return model.apply(params, mine), loss, model.gather_params(grads)


@pytest.mark.parametrize("n", [2, 4])
def test_user_plan_on_a_sequence_first_block_equals_unsplit(worlds, n):
    seed, t = 3, 2 * n
    fmodel, x = _seq_first(seed, t)
    params = fmodel.init(seed)
    weight = torch.linspace(-1.0, 1.0, t).reshape(-1, 1, 1)
    grads, loss = torch.func.grad_and_value(
        lambda p: (fmodel.apply(p, x) * weight).square().sum())(params)
    out = fmodel.apply(params, x)
    for rank, (got_out, got_loss, got_grads) in enumerate(
            worlds(n).run(_seq_first_on_rank, n, seed, t)):
        assert_close(got_out, out.chunk(n, dim=0)[rank])
        assert_close(got_loss, loss)
        assert_close(got_grads, grads)


def _errors_on_rank():
    mesh = sf.Mesh({"tp": 2})
    config = GPTConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, seq_len=8)
    gpt = sf.functional(GPT(config))
    messages = []
    model = tensor_split(gpt, mesh, "tp", gpt_tp_plan(sequence_parallel=True))
    with pytest.raises(ValueError) as error:  # 5 positions over 2 ranks
        model.apply(model.init(0), torch.zeros(2, 5, dtype=torch.long))
    messages.append(str(error.value))
    plan = gpt_tp_plan(sequence_parallel=True)
    del plan["blocks.*.ln2"]
    for bad in [plan, {"blocks.*.attn.qkv": "colwise_sp", "blocks.*.mlp.fc1": "sequence_parallel"},
                {"blocks.*.ln1": SplitRNG()}]:
        with pytest.raises(ValueError) as error:
            tensor_split(gpt, mesh, "tp", bad)
        messages.append(str(error.value))
    return messages


def test_sequence_parallel_errors_name_the_module_and_sizes(worlds):
    for messages in worlds(2).run(_errors_on_rank):
        seq, ln2, linear, split_rng = messages
        assert "'tok'" in seq and "length 5" in seq and "divisible by 2" in seq
        assert "'tp'" in seq
        assert "'blocks.0.ln2.weight'" in ln2 and "SequenceParallel()" in ln2
        assert "'blocks.0.mlp.fc1'" in linear and "Linear" in linear
        assert "'blocks.0.ln1'" in split_rng and "parameters" in split_rng


def test_sequence_parallel_refuses_buffers_and_unknown_parametrised_modules():
    mesh = sf.Mesh({"tp": 1})
    net = sf.functional(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Conv1d(4, 4, 1)))
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\) has buffers"):
        tensor_split(net, mesh, "tp", {"1": "sequence_parallel"})
    with pytest.raises(ValueError, match=r"'2' \(Conv1d\) cannot run on a sequence chunk"):
        tensor_split(net, mesh, "tp", {"2": "sequence_parallel"})
