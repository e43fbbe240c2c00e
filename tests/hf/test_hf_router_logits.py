"""An MoE model's ``output_router_logits`` under ``shard_params``: refused by name (HF records
the router logits with hooks the units never run), and computed as HF does by sf.functional."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")


def _mixtral():
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def test_router_logits_under_shard_params_are_refused_by_name():
    module = _mixtral()
    fm = sf.functional(module)
    params = fm.params_from(module)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out = fm.apply(params, input_ids=ids, labels=ids, output_router_logits=True)
    reference = module(input_ids=ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(out.aux_loss, reference.aux_loss, rtol=0, atol=0)
    sharded = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp")
    shards = sharded.shard(params)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        sharded.apply(shards, input_ids=ids, labels=ids, output_router_logits=True)
    plain = sharded.apply(shards, input_ids=ids, labels=ids)  # without it: HF's loss
    torch.testing.assert_close(plain.loss, module(input_ids=ids, labels=ids).loss)
