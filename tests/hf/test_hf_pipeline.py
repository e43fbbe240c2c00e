"""Hugging Face causal LMs through ``pipeline_stages`` with the default glue (#24 items 3-4).

``sf.pipeline_stages(hf_model, mesh, "pp", balance=..., microbatches=...)`` cuts the model
into units (embedding with rotary/mask/position ids, one unit per decoder layer, norm and
head) keeping its own leaf names. On 2 ranks, one world call: a tiny Llama (1F1B), a
tied Llama (GPipe) and GPT-2 (1F1B), padding in the attention mask, the embedding tied to
the head across the first and the last stage: the loss and the gathered gradients equal HF's
own loss and gradients on the whole batch, and ``pp.gather(params)`` loads into the HF
model with ``load_state_dict(strict=True)``. A weight tied across plain units (no HF) too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import shardfn as sf

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 64, 6, 7


def hf_model(kind: str, layers: int = 3) -> nn.Module:
    """A tiny HF causal LM, the same in every process (dropout off)."""
    t = transformers
    if kind == "gpt2":
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              bos_token_id=0, eos_token_id=0)
    else:
        config = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=32,
                               tie_word_embeddings=kind == "tied")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return t.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def hf_batch() -> dict[str, torch.Tensor]:
    """Token ids, left padding on two rows (masked, and no labels there)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    mask[4, :1] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference(kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF's own loss and gradients on the whole batch, at ``sf.functional(model).init(0)``."""
    fm = sf.functional(hf_model(kind))
    params = fm.init(0)
    trainable = {n: params[n].clone().requires_grad_(True) for n in fm.trainable_names}
    loss = fm.apply({**params, **trainable}, **hf_batch()).loss
    grads = torch.autograd.grad(loss, list(trainable.values()))
    return loss.detach(), dict(zip(trainable, grads, strict=True))


def run_rank(cases):
    """Every case on this rank: (loss, gathered grads, checks that ran here)."""
    mesh = sf.Mesh({"pp": 2})
    results = []
    for kind, schedule, balance, microbatches in cases:
        model = hf_model(kind)
        pp = sf.pipeline_stages(model, mesh, "pp", balance=balance, schedule=schedule,
                                microbatches=microbatches)
        params = pp.init(0)
        loss, grads = pp.value_and_grad(params, hf_batch())
        full_grads = pp.gather(grads)
        full = pp.gather(params)
        fm = pp.functional
        # the gathered leaves load straight into the HF model (persistent keys, aliases)
        state = {key: full[fm.tied.get(key, key)] for key in model.state_dict()}
        model.load_state_dict(state, strict=True)
        with torch.no_grad():
            logits = model(input_ids=hf_batch()["input_ids"]).logits
        out = pp.apply(params, {"input_ids": hf_batch()["input_ids"]})
        results.append((loss, full_grads, sorted(params), torch.equal(out, logits)
                        if pp.rank == 1 else torch.allclose(out, logits, atol=1e-6)))
    # a weight tied across plain units: embedding (stage 0) and head (stage 1)
    emb, mid, head = nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Linear(8, VOCAB, bias=False)
    head.weight = emb.weight
    units = [emb, mid, head]

    def ce(logits, y):
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    pp = sf.pipeline_stages(units, mesh, "pp", balance=[2, 1], microbatches=3, loss_fn=ce)
    ids = hf_batch()["input_ids"]
    loss, grads = pp.value_and_grad(pp.init(0), ids, ids)
    results.append((loss, pp.gather(grads), sorted(pp.names), True))
    return results


CASES = [("llama", "1f1b", [2, 3], 3), ("tied", "gpipe", [3, 2], 2), ("gpt2", "1f1b", [2, 2], 2)]


def test_hf_pipeline_equals_hf_loss_and_grads(worlds):
    every = worlds(2).run(run_rank, CASES)
    for index, (kind, schedule, _, _) in enumerate(CASES):
        ref_loss, ref_grads = reference(kind)
        for rank in range(2):
            loss, grads, names, same_logits = every[rank][index]
            where = f"{kind} {schedule} rank {rank}"
            torch.testing.assert_close(loss, ref_loss, msg=where)
            assert sorted(grads) == sorted(ref_grads), where
            for name, grad in ref_grads.items():
                torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5,
                                           msg=f"{where}: {name}")
            assert same_logits, where
        tied = "model.embed_tokens.weight" if kind != "gpt2" else "transformer.wte.weight"
        held = [tied in every[rank][index][2] for rank in range(2)]
        assert held == [True, kind in ("tied", "gpt2")], (kind, held)  # tied: both stages
    # plain units: the tied weight's gradient is the sum of both uses
    emb, mid, head = nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Linear(8, VOCAB, bias=False)
    head.weight = emb.weight
    fm = sf.functional(nn.Sequential(emb, mid, head))
    params = fm.init(0)
    ids = hf_batch()["input_ids"]
    trainable = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    ref = nn.functional.cross_entropy(fm.apply(trainable, ids).flatten(0, 1), ids.flatten())
    ref_grads = dict(zip(trainable, torch.autograd.grad(ref, list(trainable.values())),
                         strict=True))
    for rank in range(2):
        loss, grads, names, _ = every[rank][-1]
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(grads, ref_grads)
        assert ("0.weight" in names) and (("1.weight" in names) == (rank == 0))


def test_hf_units_keep_the_model_names_and_init():
    model = hf_model("tied")
    pp = sf.pipeline_stages(model, sf.Mesh({"pp": 1}), "pp", balance=[1, 4], virtual=2,
                            schedule="interleaved", microbatches=2)
    fm = sf.functional(model)
    assert pp.names == fm.names and pp.functional.names == fm.names
    params, full = pp.init(0), fm.init(0)
    assert all(torch.equal(params[n], full[n]) for n in fm.names)
    with pytest.raises(ValueError, match="unknown keys \\['token_type_ids'\\]"):
        pp.value_and_grad(params, {"input_ids": hf_batch()["input_ids"],
                                   "token_type_ids": hf_batch()["input_ids"]})
    # stage models keep the names and init too: both virtual stages (one rank) hold the
    # tied embedding as shard_params shards; its gradient is the sum of both uses
    sharded = sf.pipeline_stages(model, sf.Mesh({"pp": 1, "dp": 1}), "pp", balance=[1, 4],
                                 virtual=2, schedule="interleaved", microbatches=2,
                                 stage_transform=lambda s, m: sf.shard_params(s, m, "dp"))
    assert sharded.names == fm.names and sorted(sharded.stage_models) == [0, 1]
    assert all(torch.equal(t, full[n]) for n, t in sharded.init(0).items())
    batch = {"input_ids": hf_batch()["input_ids"], "labels": hf_batch()["labels"]}
    torch.testing.assert_close(sharded.value_and_grad(params, batch),
                               pp.value_and_grad(params, batch))
