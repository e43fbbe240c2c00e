"""tensor_split composes with torch.func transforms, autocast, train/eval and buffers.

Each test runs a tp-split model on 2 (and where cheap 4) ranks of mesh
{"tp": n} and compares with the same transform of the unsplit model, computed
in the test process:

* ``vmap``: the batched forward, per-example gradients ``vmap(grad(loss))``
  (gathered per example; also the reference GPT, with and without sequence
  parallel) and a vmap over an ensemble of parameter trees; the
  the vocab-parallel loss under vmap;
* ``jvp`` / ``vjp`` / ``grad_and_value(has_aux=True)``;
* ``torch.autocast("cpu", bfloat16)``: output dtype, output, loss and gradients
  within a stated bf16 tolerance (and far from the float32 result, so the
  autocast really ran); the reference GPT's loss with and without sequence
  parallel; the vocab-parallel loss in float32 under autocast, as F.cross_entropy;
* ``eval()`` / ``train()`` with dropout (the reference GPT);
* buffers in replicated modules (a BatchNorm): the output in both modes and the
  caller's buffers untouched; the updated statistics from ``mutable=True``.
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
from shardfn.transforms.tensor_split import Colwise, tensor_split


class Block(nn.Module):
    """LayerNorm -> fc1 (colwise) -> GELU -> fc2 (rowwise), residual."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


PLAN = {"fc1": "colwise", "fc2": "rowwise"}


class NormedBlock(nn.Module):
    """A replicated BatchNorm (running-stat buffers) in front of a split MLP."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(d)
        self.mlp = Block(d, hidden)

    def forward(self, x):  # x: [batch, d]
        return self.mlp(self.bn(x))


BN_PLAN = {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


def _loss(out, y):
    return F.mse_loss(out, y)


def _data(case: dict, extra: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(case["seed"])
    shape = (*extra, case["b"], case["s"], case["d"])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _split(case: dict):
    fmodel = sf.functional(Block(case["d"], case["hidden"]))
    return fmodel, tensor_split(fmodel, sf.Mesh({"tp": case["n"]}), "tp", PLAN)


def _case(n: int, d: int, mult: int, b: int, s: int, seed: int) -> dict:
    return {"n": n, "d": d, "hidden": 2 * n * mult, "b": b, "s": s, "seed": seed}


# ----------------------------------------------------------------------------- vmap


def _vmap_on_rank(case: dict):
    fmodel, tp = _split(case)
    params = tp.init(case["seed"])
    x, y = _data(case)
    out = torch.func.vmap(tp.apply, in_dims=(None, 0))(params, x)
    per_example = torch.func.vmap(torch.func.grad(lambda p, xi, yi: _loss(tp.apply(p, xi), yi)),
                                  in_dims=(None, 0, 0))(params, x, y)
    gathered = [tp.gather_params({n: g[i] for n, g in per_example.items()})
                for i in range(case["b"])]
    return out, {n: torch.stack([g[n] for g in gathered]) for n in fmodel.names}


@settings(max_examples=4, deadline=None)
@given(n=st.sampled_from([2, 4]), d=st.sampled_from([4, 8]), mult=st.integers(1, 2),
       b=st.integers(1, 3), s=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_vmap_forward_and_per_example_grads_equal_unsplit(worlds, n, d, mult, b, s, seed):
    case = _case(n, d, mult, b, s, seed)
    fmodel = sf.functional(Block(d, case["hidden"]))
    params = fmodel.init(seed)
    x, y = _data(case)
    out = torch.func.vmap(fmodel.apply, in_dims=(None, 0))(params, x)
    per_example = torch.func.vmap(
        torch.func.grad(lambda p, xi, yi: _loss(fmodel.apply(p, xi), yi)),
        in_dims=(None, 0, 0))(params, x, y)
    assert b == 1 or not torch.allclose(per_example["fc1.weight"][0],
                                        per_example["fc1.weight"][-1])  # really per example
    for got_out, got_grads in worlds(n).run(_vmap_on_rank, case):
        assert_close(got_out, out)
        assert_close(got_grads, per_example)


def _ensemble_on_rank(case: dict, members: int):
    _, tp = _split(case)
    stacked = {n: torch.stack([tp.init(case["seed"] + k)[n] for k in range(members)])
               for n in tp.names}
    x, _ = _data(case)
    return torch.func.vmap(tp.apply, in_dims=(0, None))(stacked, x)


def test_vmap_over_an_ensemble_of_split_params_equals_unsplit(worlds):
    case, members = _case(2, 4, 1, 2, 3, 7), 3
    fmodel = sf.functional(Block(4, case["hidden"]))
    x, _ = _data(case)
    expected = torch.stack([fmodel.apply(fmodel.init(case["seed"] + k), x)
                            for k in range(members)])
    for got in worlds(2).run(_ensemble_on_rank, case, members):
        assert_close(got, expected)


# ----------------------------------------------------------------------------- jvp, vjp


def _tangents(fmodel, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    return {n: torch.randn(shape.shape, generator=g)
            for n, shape in fmodel.param_shapes().items()}


def _jvp_vjp_on_rank(case: dict):
    fmodel, tp = _split(case)
    params = tp.init(case["seed"])
    x, y = _data(case)
    tangents = tp.shard_params_tree(_tangents(fmodel, case["seed"]))
    out, jvp_out = torch.func.jvp(lambda p: tp.apply(p, x), (params,), (tangents,))
    vjp_out, vjp_fn = torch.func.vjp(lambda p: tp.apply(p, x), params)
    (cotangent_grads,) = vjp_fn(y)  # y: the (replicated) output cotangent
    grads, (loss, aux) = torch.func.grad_and_value(
        lambda p: (_loss(tp.apply(p, x), y), tp.apply(p, x).sum()), has_aux=True)(params)
    return (out, jvp_out, vjp_out, tp.gather_params(cotangent_grads), tp.gather_params(grads),
            loss, aux)


@pytest.mark.parametrize("n", [2, 4])
def test_jvp_vjp_and_grad_and_value_equal_unsplit(worlds, n):
    case = _case(n, 4, 1, 2, 3, 11)
    fmodel = sf.functional(Block(4, case["hidden"]))
    params = fmodel.init(case["seed"])
    x, y = _data(case)
    out, jvp_out = torch.func.jvp(lambda p: fmodel.apply(p, x), (params,),
                                  (_tangents(fmodel, case["seed"]),))
    _, vjp_fn = torch.func.vjp(lambda p: fmodel.apply(p, x), params)
    (cotangent_grads,) = vjp_fn(y)
    grads, (loss, aux) = torch.func.grad_and_value(
        lambda p: (_loss(fmodel.apply(p, x), y), fmodel.apply(p, x).sum()), has_aux=True)(params)
    for got in worlds(n).run(_jvp_vjp_on_rank, case):
        got_out, got_jvp, got_vjp_out, got_cotangent, got_grads, got_loss, got_aux = got
        assert_close(got_out, out)
        assert_close(got_jvp, jvp_out)
        assert_close(got_vjp_out, out)
        assert_close(got_cotangent, cotangent_grads)
        assert_close(got_grads, grads)
        assert_close((got_loss, got_aux), (loss, aux))


# ----------------------------------------------------------------------------- autocast

#: bf16 keeps 8 significant bits (unit round-off 2**-8 = 0.0039). The split model rounds
#: each rank's partial product of the rowwise layer to bf16 before the psum (and the sum
#: again), the unsplit one rounds the whole product once: a few round-offs of the output's
#: size apart. 2**-5 (8 round-offs) relative to the largest entry; a missing or doubled
#: psum, or autocast not applied (float32: ~2**-8 away), would be far outside or exactly 0.
BF16_TOL = 2.0**-5


def _close_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.detach().abs().max().item()
    assert_close(got.float(), expected.float(), rtol=0.0, atol=BF16_TOL * scale)


def _autocast_on_rank(case: dict):
    _, tp = _split(case)
    params = tp.init(case["seed"])
    x, y = _data(case)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tp.apply(params, x)
        grads, loss = torch.func.grad_and_value(lambda p: _loss(tp.apply(p, x), y))(params)
    return out, loss, tp.gather_params(grads)


@pytest.mark.parametrize("n", [2, 4])
def test_autocast_bf16_equals_unsplit_under_the_same_autocast(worlds, n):
    case = _case(n, 8, 2, 2, 4, 5)
    fmodel = sf.functional(Block(8, case["hidden"]))
    params = fmodel.init(case["seed"])
    x, y = _data(case)
    full_precision = fmodel.apply(params, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fmodel.apply(params, x)
        grads, loss = torch.func.grad_and_value(lambda p: _loss(fmodel.apply(p, x), y))(params)
    # the residual keeps the output float32; the matmuls ran in bf16 (float32 round-off
    # would be ~1e-7 of the scale):
    assert (out - full_precision).abs().max() > 1e-4 * full_precision.abs().max()
    for got_out, got_loss, got_grads in worlds(n).run(_autocast_on_rank, case):
        assert got_out.dtype == out.dtype and got_loss.dtype == loss.dtype
        assert {k: v.dtype for k, v in got_grads.items()} == {k: v.dtype for k, v in grads.items()}
        _close_bf16(got_out, out)
        _close_bf16(got_loss, loss)
        for name in grads:
            _close_bf16(got_grads[name], grads[name])


def _gpt(dropout: float):
    config = GPTConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, seq_len=8,
                       dropout=dropout)
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, 16, (2, 8), generator=g) for _ in range(2))
    return sf.functional(GPT(config)), tokens, targets


def _gpt_autocast_on_rank(n: int, sequence_parallel: bool):
    fmodel, tokens, targets = _gpt(0.0)
    tp = tensor_split(fmodel, sf.Mesh({"tp": n}), "tp", gpt_tp_plan(sequence_parallel))
    params = tp.init(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        local_logits = tp.apply(params, tokens)
        loss = sf.vocab_parallel_cross_entropy(local_logits, targets, "tp", mesh=tp.mesh)
    return local_logits.dtype, loss


def _unsplit_gpt_autocast_loss():
    fmodel, tokens, targets = _gpt(0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = fmodel.apply(fmodel.init(0), tokens)
        return logits.dtype, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_autocast_bf16_reference_gpt_loss_equals_unsplit(worlds, sequence_parallel):
    logits_dtype, loss = _unsplit_gpt_autocast_loss()
    for dtype, got in worlds(2).run(_gpt_autocast_on_rank, 2, sequence_parallel):
        assert dtype == logits_dtype == torch.bfloat16
        _close_bf16(got, loss)


def test_autocast_vocab_parallel_loss_has_the_unsplit_dtype(worlds):
    _, loss = _unsplit_gpt_autocast_loss()
    assert loss.dtype == torch.float32
    for _, got in worlds(2).run(_gpt_autocast_on_rank, 2, False):
        assert got.dtype == loss.dtype


def _gpt_per_example_on_rank(sequence_parallel: bool, vocab_parallel_loss: bool):
    fmodel, tokens, targets = _gpt(0.0)
    plan = gpt_tp_plan(sequence_parallel)
    if not vocab_parallel_loss:  # replicated logits, the transpose keeping this rank's slice
        plan["head"] = Colwise(gather_output=True, sequence_parallel=sequence_parallel)
    tp = tensor_split(fmodel, sf.Mesh({"tp": 2}), "tp", plan)

    def loss(p, t, y):
        if vocab_parallel_loss:
            return sf.vocab_parallel_cross_entropy(tp.apply(p, t), y, "tp", mesh=tp.mesh)
        return F.cross_entropy(tp.apply(p, t), y)

    try:
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(tp.init(0), tokens,
                                                                            targets)
    except RuntimeError as error:
        if "vmap" not in str(error):
            raise
        return None  # data-dependent control flow under vmap
    return [tp.gather_params({n: g[i] for n, g in grads.items()}) for i in range(len(tokens))]


def _unsplit_gpt_per_example():
    fmodel, tokens, targets = _gpt(0.0)
    grads = torch.func.vmap(torch.func.grad(lambda p, t, y: F.cross_entropy(fmodel.apply(p, t), y)),
                            in_dims=(None, 0, 0))(fmodel.init(0), tokens, targets)
    return [{n: g[i] for n, g in grads.items()} for i in range(len(tokens))]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vmap_per_example_grads_of_reference_gpt_equal_unsplit(worlds, sequence_parallel):
    expected = _unsplit_gpt_per_example()
    for got in worlds(2).run(_gpt_per_example_on_rank, sequence_parallel, False):
        assert_close(got, expected)


def test_vmap_per_example_grads_with_vocab_parallel_loss(worlds):
    expected = _unsplit_gpt_per_example()
    for got in worlds(2).run(_gpt_per_example_on_rank, False, True):
        assert got is not None, "vocab_parallel_cross_entropy fails under vmap"
        assert_close(got, expected)


# ----------------------------------------------------------------------------- train / eval


def _modes_on_rank(n: int):
    fmodel, tokens, _ = _gpt(0.5)
    mesh = sf.Mesh({"tp": n})
    outputs = {}
    for mode, model in (("eval", fmodel.eval()), ("train", fmodel.train())):
        tp = tensor_split(model, mesh, "tp", gpt_tp_plan())
        local_logits = tp.apply(tp.init(0), tokens)  # vocab-split: gathered to compare
        outputs[mode] = sf.all_gather(local_logits, "tp", dim=-1, mesh=mesh)
        outputs[mode + "_training"] = tp.module.training
    return outputs


def test_eval_equals_unsplit_eval_and_train_mode_uses_dropout(worlds):
    fmodel, tokens, _ = _gpt(0.5)
    params = fmodel.init(0)
    expected = fmodel.eval().apply(params, tokens)
    for got in worlds(2).run(_modes_on_rank, 2):
        assert (got["eval_training"], got["train_training"]) == (False, True)
        assert_close(got["eval"], expected)
        assert not torch.allclose(got["train"], expected)  # dropout at p=0.5 was applied


def _eval_method_on_rank():
    fmodel, tokens, _ = _gpt(0.5)
    mesh = sf.Mesh({"tp": 2})
    tp = tensor_split(fmodel, mesh, "tp", gpt_tp_plan())
    if not hasattr(tp, "eval"):
        return None
    evaluating = tp.eval()
    return sf.all_gather(evaluating.apply(tp.init(0), tokens), "tp", dim=-1, mesh=mesh)


def test_tensor_split_model_eval_equals_unsplit_eval(worlds):
    fmodel, tokens, _ = _gpt(0.5)
    expected = fmodel.eval().apply(fmodel.init(0), tokens)
    for got in worlds(2).run(_eval_method_on_rank):
        assert got is not None, "TensorSplitModel.eval is missing"
        assert_close(got, expected)


# ----------------------------------------------------------------------------- buffers


def _buffers_on_rank(d: int, hidden: int, x: torch.Tensor):
    fmodel = sf.functional(NormedBlock(d, hidden))
    outputs = {}
    for mode, model in (("train", fmodel.train()), ("eval", fmodel.eval())):
        tp = tensor_split(model, sf.Mesh({"tp": 2}), "tp", BN_PLAN)
        params = tp.init(0)
        params["bn.running_mean"] = torch.linspace(-1.0, 1.0, d)  # eval must use these
        params["bn.running_var"] = torch.linspace(0.5, 2.0, d)
        before = {n: params[n].clone() for n in fmodel.buffer_names}
        outputs[mode] = tp.apply(params, x)
        trainable, rest = tp.split_trainable(params)
        grads = torch.func.grad(
            lambda t, tp=tp, rest=rest: tp.apply(tp.merge(t, rest), x).square().mean())(trainable)
        outputs[mode + "_grads"] = tp.split_trainable(tp.gather_params(tp.merge(grads, rest)))[0]
        outputs[mode + "_untouched"] = all(torch.equal(params[n], before[n]) for n in before)
        outputs["specs"] = {n: tp.specs[n].spec for n in fmodel.buffer_names}
    return outputs


def test_replicated_buffers_in_train_and_eval_equal_unsplit(worlds):
    d, hidden = 4, 8
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(2))
    fmodel = sf.functional(NormedBlock(d, hidden))
    expected = {}
    for mode, model in (("train", fmodel.train()), ("eval", fmodel.eval())):
        params = model.init(0)
        params["bn.running_mean"] = torch.linspace(-1.0, 1.0, d)
        params["bn.running_var"] = torch.linspace(0.5, 2.0, d)
        expected[mode] = model.apply(params, x)
        trainable, rest = model.split_trainable(params)
        expected[mode + "_grads"] = torch.func.grad(
            lambda t, model=model, rest=rest: model.apply(model.merge(t, rest), x).square().mean()
        )(trainable)
    assert not torch.allclose(expected["train"], expected["eval"])  # the buffers matter
    for got in worlds(2).run(_buffers_on_rank, d, hidden, x):
        assert got["train_untouched"] and got["eval_untouched"]  # apply is pure
        assert all(spec == sf.P() for spec in got["specs"].values())  # buffers replicated
        for key in ("train", "eval", "train_grads", "eval_grads"):
            assert_close(got[key], expected[key])


def _mutable_on_rank(x: torch.Tensor):
    tp = tensor_split(sf.functional(NormedBlock(4, 8)), sf.Mesh({"tp": 2}), "tp", BN_PLAN)
    try:
        _, new_buffers = tp.apply(tp.init(0), x, mutable=True)
    except TypeError as error:  # mutable= reaches the module's forward
        if "mutable" not in str(error):
            raise
        return None
    return new_buffers


def test_updated_buffers_come_back_from_apply(worlds):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    fmodel = sf.functional(NormedBlock(4, 8))
    _, expected = fmodel.apply(fmodel.init(0), x, mutable=True)
    for got in worlds(2).run(_mutable_on_rank, x):
        assert got is not None, "TensorSplitModel.apply(..., mutable=True) is not supported"
        assert_close(got, expected)
