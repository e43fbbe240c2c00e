"""BERT, Qwen2, Mistral and a tied Llama through ``pipeline_stages`` (#24 items 3-4).

``sf.pipeline_stages(hf_model, mesh, "pp", balance=..., microbatches=...)`` cuts each model
into units under its own names. On 2 ranks (one world call): BERT's masked LM (eager and
sdpa; token types, padding, a different number of masked tokens per micro-batch, the MLM
decoder tied to the word embedding across the first and the last stage), BERT's sequence
classification, Qwen2 (sdpa) with sliding-window layers after a full one and packed
sequences (position ids restarting, no attention mask), Mistral with a sliding window shorter
than the sequence and padding. On 4 ranks, a tied 6-layer Llama under the interleaved
schedule (the tie between rank 0 and rank 3). An sdpa case first takes a step without
padding (where HF would skip the mask): the next step's masks still travel. Each case
equals the HF module on one process: the loss (HF's own: the mean over every non-ignored
token of the whole batch), every
gradient (gathered, under the model's names), the initial leaves, and ``pp.gather(params)``
loads into the HF module with ``load_state_dict(strict=True)`` whose logits equal
``pp.apply``'s. What is refused is refused by name.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from tests.hf.test_hf_pipeline import BATCH, SEQ, VOCAB, hf_batch, hf_model

transformers = pytest.importorskip("transformers")

LABELS = 3  # sequence classification classes


def model_of(kind: str, implementation: str = "eager") -> torch.nn.Module:
    """A tiny HF model, the same in every process (dropout off)."""
    t = transformers
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, max_position_embeddings=32)
    if kind.startswith("bert"):
        config = t.BertConfig(**small, num_hidden_layers=2, type_vocab_size=2,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                              num_labels=LABELS)
        cls = t.BertForSequenceClassification if kind == "bert_cls" else t.BertForMaskedLM
    elif kind == "qwen2":  # layer 0 full, layers 1-2 sliding (window 3 < SEQ)
        config = t.Qwen2Config(**small, num_hidden_layers=3, num_key_value_heads=2,
                               use_sliding_window=True, sliding_window=3, max_window_layers=1)
        cls = t.Qwen2ForCausalLM
    elif kind == "mistral":  # every layer sliding, window 3 < SEQ
        config = t.MistralConfig(**small, num_hidden_layers=2, num_key_value_heads=2,
                                 sliding_window=3)
        cls = t.MistralForCausalLM
    else:  # "tied6": a Llama of 6 layers, embedding tied to the head
        config = t.LlamaConfig(**small, num_hidden_layers=6, num_key_value_heads=2,
                               tie_word_embeddings=True)
        cls = t.LlamaForCausalLM
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(config, attn_implementation=implementation).train()


def batch_of(kind: str) -> dict[str, torch.Tensor]:
    """HF keyword inputs with labels: padding, token types, masked tokens, packing."""
    gen = torch.Generator().manual_seed(2)
    if kind == "qwen2":  # two sequences per row, no attention mask (HF packing)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        positions = torch.tensor([0, 1, 2, 0, 1, 2, 3]).expand(BATCH, SEQ)
        return {"input_ids": ids, "position_ids": positions, "labels": ids}
    if not kind.startswith("bert"):
        return hf_batch()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 4:] = 0
    mask[4, 6:] = 0
    types = (torch.arange(SEQ) >= 3).long().expand(BATCH, SEQ)
    if kind == "bert_cls":
        labels = torch.randint(0, LABELS, (BATCH,), generator=gen)
    else:  # about 40% of the real tokens, so every micro-batch counts differently
        chosen = (torch.rand(BATCH, SEQ, generator=gen) < 0.4) & (mask == 1)
        labels = ids.masked_fill(~chosen, -100)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
            "labels": labels}


def reference(kind: str, implementation: str) -> tuple[torch.Tensor, dict, dict]:
    """HF's own loss and gradients on the whole batch, and ``sf.functional(model).init(0)``."""
    fm = sf.functional(model_of(kind, implementation))
    params = fm.init(0)
    trainable = {n: params[n].clone().requires_grad_(True) for n in fm.trainable_names}
    loss = fm.apply({**params, **trainable}, **batch_of(kind)).loss
    grads = torch.autograd.grad(loss, list(trainable.values()))
    return loss.detach(), dict(zip(trainable, grads, strict=True)), params


def run_rank(cases):
    """Every case on this rank: (loss, gathered grads, gathered params, names, same logits)."""
    mesh = sf.Mesh({"pp": torch.distributed.get_world_size()})
    results = []
    for kind, implementation, schedule, balance, microbatches, virtual in cases:
        model = model_of(kind, implementation)
        pp = sf.pipeline_stages(model, mesh, "pp", balance=balance, schedule=schedule,
                                microbatches=microbatches, virtual=virtual)
        params = pp.init(0)
        batch = batch_of(kind)
        if implementation == "sdpa":  # a first step without padding or packing: the
            plain = {k: v for k, v in batch.items() if k not in ("attention_mask",
                                                                 "position_ids")}
            pp.value_and_grad(params, plain)  # masks are sent all the same
        loss, grads = pp.value_and_grad(params, batch)
        full = pp.gather(params)
        tied = pp.functional.tied
        model.load_state_dict({k: full[tied.get(k, k)] for k in model.state_dict()},
                              strict=True)  # persistent keys; tied aliases from fm.tied
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits  # as sf.functional
        same = torch.allclose(pp.apply(params, inputs), logits, atol=1e-5, rtol=1e-5)
        results.append((loss, pp.gather(grads), full, sorted(params), same))
    return results


def check(results, cases) -> None:
    """Every rank's result of every case equals the HF module's on one process."""
    for index, (kind, implementation, schedule, *_) in enumerate(cases):
        ref_loss, ref_grads, ref_params = reference(kind, implementation)
        for rank, every in enumerate(results):
            loss, grads, full, names, same_logits = every[index]
            where = f"{kind} {implementation} {schedule} rank {rank}"
            torch.testing.assert_close(loss, ref_loss, msg=where)
            assert sorted(grads) == sorted(ref_grads), where
            for name, grad in ref_grads.items():
                torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5,
                                           msg=f"{where}: {name}")
            assert sorted(full) == sorted(ref_params), where
            assert all(torch.equal(full[n], ref_params[n]) for n in ref_params), where
            assert same_logits, where
        if kind in ("bert", "tied6"):  # the tied embedding: first and last rank
            word = ("bert.embeddings.word_embeddings.weight" if kind.startswith("bert")
                    else "model.embed_tokens.weight")
            assert word in results[0][index][3] and word in results[-1][index][3], kind


CASES = [("bert", "eager", "1f1b", [2, 2], 3, 1),
         ("bert", "sdpa", "gpipe", [1, 3], 2, 1),
         ("bert_cls", "sdpa", "1f1b", [2, 2], 2, 1),
         ("qwen2", "sdpa", "1f1b", [2, 3], 3, 1),
         ("mistral", "eager", "gpipe", [2, 2], 3, 1)]


def test_hf_models_pipelined_on_two_ranks(worlds):
    check(worlds(2).run(run_rank, CASES), CASES)


def test_tied_llama_interleaved_on_four_ranks(worlds):
    cases = [("tied6", "sdpa", "interleaved", [1] * 8, 4, 2)]
    check(worlds(4).run(run_rank, cases), cases)


@functools.cache
def _bert_on_one_rank(microbatches: int):
    """A BERT MLM, its functional reference at init(0), and its pipeline on one rank."""
    model = model_of("bert")
    fm = sf.functional(model)
    pp = sf.pipeline_stages(model, sf.Mesh({"pp": 1}), "pp", balance=[4],
                            microbatches=microbatches)
    return fm, fm.init(0), pp, pp.init(0)


@settings(max_examples=4, deadline=None)
@given(masked=st.lists(st.booleans(), min_size=BATCH * SEQ, max_size=BATCH * SEQ),
       microbatches=st.sampled_from([1, 2, 3, 6]))
def test_masked_lm_loss_is_the_whole_batch_mean(masked, microbatches):
    """HF's MLM loss over the whole batch, for any masked tokens and micro-batch count
    (a mean per micro-batch would differ when the micro-batches' counts differ)."""
    fm, params, pp, stage_params = _bert_on_one_rank(microbatches)
    batch = batch_of("bert")
    chosen = torch.tensor(masked).view(BATCH, SEQ)
    batch["labels"] = batch["input_ids"].masked_fill(~chosen, -100)
    with torch.no_grad():
        ref = fm.apply(params, **batch).loss
    loss, _ = pp.value_and_grad(stage_params, batch)
    if chosen.any():
        torch.testing.assert_close(loss, ref)
    else:  # HF's mean over no token is nan; the pipeline's count is clamped to 1: zero
        assert loss.item() == 0.0


def test_hf_pipeline_refusals():
    mesh, t = sf.Mesh({"pp": 1}), transformers
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        token = t.BertForTokenClassification(t.BertConfig(**small))
        roberta = t.RobertaForMaskedLM(t.RobertaConfig(**small, pad_token_id=1))
        decoder = t.BertForMaskedLM(t.BertConfig(**small, is_decoder=True))
    for model, message in ((token, "BertForTokenClassification's head is not one"),
                           (roberta, "model_type 'roberta'"),
                           (decoder, "BERT as a decoder")):
        with pytest.raises(TypeError, match=message):
            sf.pipeline_stages(model, mesh, "pp", balance=[4], microbatches=1,
                               loss_fn=lambda out, labels: out.sum())
    with pytest.raises(ValueError, match="BertForTokenClassification has no loss of its own"):
        sf.pipeline_stages(token, mesh, "pp", balance=[4], microbatches=1)
    bert = model_of("bert")
    with pytest.raises(ValueError, match="its own loss is 'masked_lm'"):
        sf.pipeline_stages(bert, mesh, "pp", balance=[4], microbatches=1, loss_fn="causal_lm")
    pp = sf.pipeline_stages(model_of("bert_cls"), mesh, "pp", balance=[4], microbatches=2)
    batch = batch_of("bert_cls")
    batch["labels"][0] = -100
    with pytest.raises(ValueError, match="ignored rows"):
        pp.value_and_grad(pp.init(0), batch)
    with pytest.raises(ValueError, match="unknown keys \\['token_type_ids'\\]"):
        llama = sf.pipeline_stages(hf_model("tied"), mesh, "pp", balance=[5], microbatches=1)
        llama.value_and_grad(llama.init(0), {**hf_batch(), "token_type_ids": hf_batch()["labels"]})
