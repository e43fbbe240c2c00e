"""``tensor_split`` of Hugging Face models from their own plan (``plan="auto"``) and the
vocab-parallel causal-LM loss, against the HF module on one process.

Tiny models from configs (no download): Llama with GQA (4 heads, 2 key/value heads) on
2 ranks from its own plan (logits, loss and gathered gradients); the same with a
vocab-parallel ``lm_head`` and :func:`vocab_parallel_causal_lm_loss` (``ignore_index``
labels, ``num_items_in_batch``); GPT-2 (no plan in this transformers: a hand plan over
its ``Conv1D`` layers, fused ``c_attn``, tied ``wte``/``lm_head``); Qwen3 (per-head norms
whose gradients are summed). One world call runs
every distributed check; the refusals run in the test process.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import shardfn as sf
from shardfn.transforms._tp_hf import split_heads
from shardfn.transforms._tp_styles import Colwise, Replicate, Rowwise, Vocab
from shardfn.transforms.tensor_split import hf_tp_plan, tensor_split
from shardfn.transforms.vocab_parallel import vocab_parallel_causal_lm_loss

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 64, 2, 8
GPT2_PLAN = {"transformer.wte": "vocab", "transformer.h.*.attn.c_attn": "colwise",
             "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
             "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise"}


def hf_model(kind: str, kv_heads: int = 2) -> torch.nn.Module:
    """A tiny HF model, the same in every process (dropout off, train mode)."""
    t = transformers
    if kind in ("llama", "qwen3"):
        config = (t.LlamaConfig if kind == "llama" else t.Qwen3Config)(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
            max_position_embeddings=32)
    else:
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return t.AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels with ignored (-100) positions."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, -2] = -100
    return ids, labels


def hf_reference(hf: torch.nn.Module, ids, labels, **kwargs) -> tuple[torch.Tensor, ...]:
    """``(logits, loss, grads)`` of the HF module itself."""
    hf.zero_grad()
    out = hf(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4,
                               msg=lambda m: f"{what}: {m}")


def check_case(kind: str, plan, vocab_loss: bool) -> str:
    """On every rank: the split model's logits, loss and gathered grads equal the HF module's."""
    mesh = sf.Mesh({"tp": torch.distributed.get_world_size()})
    hf, (ids, labels) = hf_model(kind), inputs()
    items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)  # a larger accumulated batch
    kwargs = {"num_items_in_batch": items} if vocab_loss else {}
    want_logits, want_loss, want_grads = hf_reference(hf, ids, labels, **kwargs)
    tp = tensor_split(sf.functional(hf), mesh, "tp", plan)
    params = tp.params_from(hf)
    trainable, rest = tp.split_trainable(params)

    def loss_fn(t):
        out = tp.apply(tp.merge(t, rest), input_ids=ids,
                       **({} if vocab_loss else {"labels": labels}))
        if not vocab_loss:
            return out.loss, out.logits
        loss = vocab_parallel_causal_lm_loss(out.logits, labels, "tp", mesh=mesh,
                                             num_items_in_batch=items)
        return loss, out.logits

    grads, (loss, logits) = torch.func.grad_and_value(loss_fn, has_aux=True)(trainable)
    if vocab_loss:  # this rank's vocabulary slice of the logits
        logits = sf.all_gather(logits, "tp", dim=-1, mesh=mesh)
    what = f"{kind} {'vocab loss' if vocab_loss else 'auto'}"
    close(logits, want_logits, f"{what}: logits")
    close(loss, want_loss, f"{what}: loss")
    full = tp.gather(grads)
    for name, grad in full.items():
        close(grad, want_grads[name], f"{what}: grad {name}")
    return f"{what}: {len(full)} grads"


def run_cases() -> list[str]:
    llama_auto = "auto"
    llama_vocab = {**hf_tp_plan(hf_model("llama")), "lm_head": "colwise"}
    return [check_case("llama", llama_auto, False), check_case("llama", llama_vocab, True),
            check_case("gpt2", GPT2_PLAN, True),
            check_case("qwen3", "auto", False)]  # per-head q_norm: gradients summed


def test_llama_auto_plan_and_gpt2_conv1d_equal_hf(worlds):
    """tp = 2: Llama (GQA) from its own plan, Llama with vocab-parallel logits and HF's
    loss convention, GPT-2's Conv1D / fused c_attn / tied head, Qwen3 (its per-head
    q_norm/k_norm: "replicated_with_grad_allreduce", whose gradients would otherwise be
    each rank's heads' part): logits, loss and gradients equal the HF module's."""
    results = worlds(2).run(run_cases)
    assert results[0] == results[1] and len(results[0]) == 4


def test_auto_plan_maps_hf_styles_and_refuses_what_it_cannot():
    llama = hf_model("llama")
    plan = hf_tp_plan(llama)
    assert plan["model.embed_tokens"] == Vocab()
    assert plan["model.layers.*.self_attn.k_proj"] == Colwise()
    assert plan["model.layers.*.mlp.down_proj"] == Rowwise()
    assert plan["lm_head"] == Colwise(gather_output=True)
    # heads from the model: tp = 4 with 2 key/value heads is refused naming both numbers
    styles = {p: Colwise() for p in ("model.layers.0.self_attn.q_proj",
                                     "model.layers.0.self_attn.k_proj")}
    with pytest.raises(ValueError, match=r"tp = 4 .*num_key_value_heads = 2"):
        split_heads(styles, copy.deepcopy(llama), 4, "tp")
    skeleton = copy.deepcopy(llama)
    split_heads(styles, skeleton, 2, "tp")  # 2 ranks: whole heads, from the model's counts
    assert styles["model.layers.0.self_attn.q_proj"].n_heads == 4
    assert styles["model.layers.0.self_attn.k_proj"].n_heads == 2
    # GPT-2 has no plan in this transformers version: shardfn's own (KNOWN_PLANS); a model
    # with neither (OPT) is refused naming its config class
    gpt2 = hf_model("gpt2")
    assert hf_tp_plan(gpt2)["transformer.h.*.attn.c_attn"] == Colwise()
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
        num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32))
    with pytest.raises(ValueError, match="OPTConfig has no base_model_tp_plan"):
        tensor_split(sf.functional(opt), None, "tp", "auto")
    # its fused c_attn (Conv1D) splits per q/k/v block, and the attention's split_size
    # (read by its forward) becomes this rank's
    styles = {"transformer.h.0.attn.c_attn": Colwise()}
    skeleton = copy.deepcopy(gpt2)
    split_heads(styles, skeleton, 2, "tp")
    assert styles["transformer.h.0.attn.c_attn"] == Colwise(fused=3, n_heads=4)
    assert skeleton.transformer.h[0].attn.split_size == 16
    with pytest.raises(ValueError, match="'model.embed_tokens'.*'embedding_colwise'"):
        llama.tp_plan = {**llama.tp_plan, "model.embed_tokens": "embedding_colwise"}
        hf_tp_plan(llama)
    assert Replicate(sum_grads=True) != Replicate()


def test_causal_lm_loss_equals_hf_on_one_rank():
    """tp = 1: HF's ForCausalLMLoss (shift, ignore_index, mean or / num_items_in_batch)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(2))
    _, labels = inputs()
    with sf.Mesh({"tp": 1}):
        for items in (None, torch.tensor(17)):
            got = vocab_parallel_causal_lm_loss(logits, labels, "tp", num_items_in_batch=items)
            want = ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=items)
            close(got, want, f"num_items_in_batch={items}")
