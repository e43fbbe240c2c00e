"""Communication of one reference GPT block (attention + MLP) under tensor_split, vs Megatron.

Counted with ``sf.comm_stats()`` (bytes this rank sends, ring algorithm; see
``shardfn/primitives/stats.py``) for one ``Block`` on tp = 2 and 4, activations of
``A = batch * T * d_model * 4`` bytes (the full sequence):

* without sequence parallelism: forward exactly 2 all-reduces of ``A`` (the
  rowwise ``proj`` and ``fc2`` outputs), ``2 * 2 A (tp-1)/tp`` bytes; backward
  exactly 2 more (the colwise ``qkv`` and ``fc1`` inputs' gradients), nothing else;
* with sequence parallelism: forward 2 all-gathers (into ``qkv`` and ``fc1``) and 2
  reduce-scatters (out of ``proj`` and ``fc2``) of ``A (tp-1)/tp`` bytes each, no
  all-reduce; backward the same 2 + 2 (reversed), plus one all-reduce per
  replicated leaf used on sequence chunks (``ln1``, ``ln2`` weight and bias, the
  ``proj`` and ``fc2`` biases: 6 vectors of ``d_model``), Megatron's all-reduce of
  the sequence-parallel parameters' gradients.

The expected numbers come from the formula, and the gradients are checked against
the unsplit block too, so a cheaper but wrong schedule cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import Block, GPTConfig
from shardfn.transforms.tensor_split import tensor_split

PLAN = {"attn.qkv": "colwise", "attn.core": "split_rng", "attn.proj": "rowwise",
        "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
SP_PLAN = {"ln1": "sequence_parallel", "attn.qkv": "colwise_sp", "attn.core": "split_rng",
           "attn.proj": "rowwise_sp", "attn.resid_dropout": "sequence_parallel",
           "ln2": "sequence_parallel", "mlp.fc1": "colwise_sp", "mlp.fc2": "rowwise_sp",
           "mlp.dropout": "sequence_parallel"}
B, T = 2, 8


def _block(n: int):
    config = GPTConfig(vocab_size=8, d_model=4 * n, n_layers=1, n_heads=n, seq_len=T)
    torch.manual_seed(0)
    return sf.functional(Block(config)), torch.randn(B, T, config.d_model)


def _stats(stats: sf.CommStats) -> dict:
    return {op: (stats.op_calls(op), stats.op_bytes(op))
            for op in ("psum", "all_gather", "psum_scatter") if stats.op_calls(op)}


def _minus(both: dict, forward: dict) -> dict:
    out = {op: (calls - forward.get(op, (0, 0))[0], nbytes - forward.get(op, (0, 0))[1])
           for op, (calls, nbytes) in both.items()}
    return {op: v for op, v in out.items() if v[0]}


def _on_rank(n: int, sp: bool, how: str):
    fmodel, x = _block(n)
    mesh = sf.Mesh({"tp": n})
    model = tensor_split(fmodel, mesh, "tp", SP_PLAN if sp else PLAN)
    params = model.init(0)
    if sp:
        x = x.chunk(n, dim=1)[mesh.index("tp")]  # this rank's positions

    def loss_fn(p):  # SP: the rank's chunk of the sum; by JAX's rule the sum over ranks
        return model.apply(p, x).square().sum()

    sf.reset_comm_stats()
    loss_fn(params)
    forward = _stats(sf.comm_stats())
    sf.reset_comm_stats()
    if how == "func":
        grads = torch.func.grad(loss_fn)(params)
    else:
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss_fn(leaves).backward()
        grads = {k: v.grad for k, v in leaves.items()}
    backward = _minus(_stats(sf.comm_stats()), forward)
    return forward, backward, model.gather_params(grads)


def _exact(expected: dict) -> dict:
    """The formula's figures are whole bytes for these shapes (the counters round each call)."""
    assert all(float(b).is_integer() for _, b in expected.values())
    return {op: (calls, int(b)) for op, (calls, b) in expected.items()}


@pytest.mark.parametrize("how", ["func", "autograd"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("n", [2, 4])
def test_block_communication_is_megatrons(worlds, n, sp, how):
    fmodel, x = _block(n)
    d = x.shape[-1]
    grads = torch.func.grad(lambda p: fmodel.apply(p, x).square().sum())(fmodel.init(0))
    activation = B * T * d * 4
    all_reduce = 2 * activation * (n - 1) / n
    one_way = activation * (n - 1) / n  # an all-gather of A, or a reduce-scatter of A
    if sp:
        expected_forward = {"all_gather": (2, 2 * one_way), "psum_scatter": (2, 2 * one_way)}
        sp_leaves = 6  # ln1/ln2 weight and bias, proj and fc2 bias: d_model floats each
        expected_backward = {**expected_forward,
                             "psum": (sp_leaves, sp_leaves * 2 * (4 * d) * (n - 1) / n)}
    else:
        expected_forward = expected_backward = {"psum": (2, 2 * all_reduce)}
    for forward, backward, got_grads in worlds(n).run(_on_rank, n, sp, how):
        assert forward == _exact(expected_forward)
        assert backward == _exact(expected_backward)
        assert_close(got_grads, grads)
