"""Issue #23: the model protocol's conformance suite (``sf.testing.check_model``) over every
model kind: functional, shard_params, HSDP, tensor_split, FSDP x TP, pipeline,
precision-wrapped and remat-wrapped (over unsharded and sharded models), on 1-4 ranks.

Each rank builds the kind and runs the whole suite: members, names, specs, init, shard /
gather of params, of the trainable subset and of gradients, params_from, apply (and its
buffers), train/eval, and the gathered gradients against the unsharded reference. Two
mutants show the suite fails: a model whose ``gather`` drops the padding wrongly and one
whose ``specs`` lie.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import shardfn as sf

SEED = 5
PLAN = {"0": "colwise", "2": "rowwise"}
BF16 = sf.Precision(torch.bfloat16, output_dtype=torch.float32)


def _net(norm: bool = True) -> nn.Module:
    """Five units, a buffer (BatchNorm's statistics) and a frozen parameter; 7 rows over 2
    ranks are padded under shard_params, the split layers divide evenly for tensor_split."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 7),
                        nn.BatchNorm1d(7) if norm else nn.LayerNorm(7), nn.Linear(7, 3))
    net[4].bias.requires_grad_(False)
    return net


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _mse(out, targets):
    return (out - targets).square().mean()


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _build(kind: str):
    """``(model, reference, check_model options)`` for ``kind`` on this rank's world."""
    n = _world()
    fm = sf.functional(_net())
    if kind == "functional":
        return fm, None, {}
    if kind == "shard_params":
        return sf.shard_params(fm, sf.Mesh({"dp": n}), "dp", units=["0", "2"]), None, {}
    if kind == "hsdp":
        mesh = sf.Mesh({"r": 2, "dp": n // 2})
        return sf.shard_params(fm, mesh, "dp", replicate_axis="r"), None, {}
    if kind == "tensor_split":
        return sf.tensor_split(fm, sf.Mesh({"tp": n}), "tp", PLAN), None, {}
    if kind == "fsdp_tp":
        mesh = sf.Mesh({"dp": 2, "tp": n // 2})
        return sf.shard_params(sf.tensor_split(fm, mesh, "tp", PLAN), mesh, "dp"), None, {}
    if kind == "pipeline":
        net = _net(norm=False)  # micro-batched BatchNorm statistics are not the batch's
        model = sf.pipeline_stages(net, sf.Mesh({"pp": n}), "pp", balance=[3, 2],
                                   microbatches=2, loss_fn=_mse)
        return model, sf.functional(_net(norm=False)), {"mutable": False}
    if kind == "precision":
        return sf.with_precision(fm, BF16), sf.with_precision(fm, BF16), {"rtol": 2e-2,
                                                                          "atol": 2e-2}
    if kind == "precision_sharded":
        model = sf.with_precision(sf.shard_params(fm, sf.Mesh({"dp": n}), "dp"), BF16)
        return model, sf.with_precision(fm, BF16), {"rtol": 2e-2, "atol": 2e-2}
    if kind == "remat":
        return sf.remat(fm, sf.checkpoint_policies.dots_saveable), None, {}
    if kind == "remat_sharded":
        return sf.remat(sf.shard_params(fm, sf.Mesh({"dp": n}), "dp")), None, {}
    if kind == "hf_llama_sharded":  # a real model: its ModelOutput, rotary buffers, GQA
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        hf = sf.functional(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
        return sf.shard_params(hf, sf.Mesh({"dp": n}), "dp"), None, {"atol": 1e-6}
    raise AssertionError(kind)


def _check_on_rank(kind: str, mutant: str | None = None):
    model, reference, options = _build(kind)
    if mutant == "specs":  # specs that say "replicated" for a sharded leaf
        specs = {name: sf.Layout(sf.P(), layout.shape) for name, layout in model.specs.items()}
        model = dataclasses.replace(model, specs=specs)
    if kind.startswith("hf_"):
        ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
        return sf.testing.check_model(model, (), {"input_ids": ids}, seed=SEED,
                                      loss_fn=lambda out, t: out.logits.square().mean(),
                                      **options)
    x, y = _batch()
    return sf.testing.check_model(model, (x,), seed=SEED, reference=reference, loss_fn=_mse,
                                  targets=y, **options)


KINDS = {  # kind -> world size
    "functional": 1, "shard_params": 2, "hsdp": 4, "tensor_split": 2, "fsdp_tp": 4,
    "pipeline": 2, "precision": 1, "precision_sharded": 2, "remat": 1, "remat_sharded": 2,
    "hf_llama_sharded": 2,
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_conforms(worlds, kind):
    results = worlds(KINDS[kind]).run(_check_on_rank, kind)
    for report in results:
        assert {"members", "init", "gather", "subsets", "params_from", "apply",
                "train/eval", "grads"} <= set(report.checked), (kind, report)
    if kind == "pipeline":  # each rank holds its stages' leaves, together every leaf
        every = sf.functional(_net(norm=False)).names
        assert sorted(n for r in results for n in r.names) == sorted(every)


def test_every_kind_is_a_model():
    fm = sf.functional(_net())
    assert isinstance(fm, sf.Model)
    assert not isinstance(object(), sf.Model)
    assert sf.model.missing_members(object()) == list(sf.model.MEMBERS)


def test_the_suite_catches_specs_that_lie(worlds):
    with pytest.raises(sf.testing.RankError, match="specs"):
        worlds(2).run(_check_on_rank, "shard_params", "specs")


def test_the_suite_catches_a_wrong_gather():
    fm = sf.functional(_net())

    class Doubled:
        """A FunctionalModel whose gather doubles every leaf."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def gather(self, tree):
            return {n: 2 * t for n, t in tree.items()}

        def eval(self):
            return Doubled(self.inner.eval())

    x, y = _batch()
    with pytest.raises(AssertionError, match=r"Doubled.gather: leaf '0.weight' differs"):
        sf.testing.check_model(Doubled(fm), (x,), loss_fn=_mse, targets=y)
