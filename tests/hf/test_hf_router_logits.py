"""Hugging Face's recorded outputs under ``shard_params`` (2 ranks, dp): an MoE model's
``output_router_logits`` (its load-balancing aux loss in ``out.loss``, its gradient reaching
the routers), ``output_hidden_states`` and ``output_attentions`` equal one process.

HF records them with hooks on layers inside the units; ``shard_params`` carries them out of
each unit call as outputs of the call (``shardfn._functional_hf.call_recording``), so they
join its graph, its recompute (``remat=``) and its backward. Each rank's values are the
one-process model's on that rank's tokens; the gathered gradients are the one-process
gradient of the mean of the ranks' losses (the aux loss is a product of means over a rank's
tokens: the mean over ranks is not the aux loss of the whole batch, as in GShard and
DeepSpeed-MoE).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.transforms.experts import expert_parallel

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8
NOTHING, DOTS = sf.checkpoint_policies.nothing_saveable, sf.checkpoint_policies.dots_saveable
#: (label, shard_params options, differentiate with "grad" (torch.func) or "autograd")
VARIANTS = (("zero3", {}, "grad"), ("keep", {"reshard_after_forward": False}, "autograd"),
            ("remat", {"remat": DOTS}, "grad"))


def _moe(kind: str, gc: bool = False) -> torch.nn.Module:
    """A tiny Mixtral or Qwen2-MoE (2 layers, 4 experts, top-2, a sharp router); Qwen2-MoE
    asks for the router logits in its config, Mixtral by keyword."""
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=SEQ,
                  router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    if kind == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(intermediate_size=16, num_local_experts=4,
                                                     **common))
    else:
        model = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            intermediate_size=16, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=4, output_router_logits=True, **common))
    with torch.no_grad():  # uneven expert loads: an aux loss far from its minimum
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(40.0)
    if gc:
        with warnings.catch_warnings():  # transformers 5 renames it
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    return model.train()


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(10 + rank))


def _moe_loss(out) -> torch.Tensor:
    """HF's loss: cross-entropy + coef * aux loss."""
    return out.loss


def _recorded_loss(out) -> torch.Tensor:
    """The loss and every recorded output, so each one's gradient counts."""
    return (out.loss + sum(h.square().mean() for h in out.hidden_states)
            + sum(a.square().mean() for a in out.attentions))


MOE_KW = {"output_router_logits": True}
LLAMA_KW = {"output_hidden_states": True, "output_attentions": True}


def _values(out) -> tuple:
    """What is compared per rank: the loss, the aux loss and every recorded tensor."""
    fields = ("loss", "aux_loss", "router_logits", "hidden_states", "attentions")
    return tuple(getattr(out, f, None) for f in fields)


def _step(model, shards, ids, kwargs, loss_fn, mode):
    """``(values, gathered gradients)`` of one step of ``model`` on ``ids``."""
    trainable, rest = model.split_trainable(shards)
    if mode == "grad":
        grads = torch.func.grad(
            lambda t: loss_fn(model.apply(model.merge(t, rest), input_ids=ids, labels=ids,
                                          **kwargs)))(trainable)
    else:
        live = {k: v.detach().clone().requires_grad_() for k, v in trainable.items()}
        loss_fn(model.apply(model.merge(live, rest), input_ids=ids, labels=ids,
                            **kwargs)).backward()
        grads = {k: v.grad for k, v in live.items()}
    with torch.no_grad():
        values = _values(model.apply(shards, input_ids=ids, labels=ids, **kwargs))
    return values, model.gather(grads)


def _on_rank(kind: str, variants=VARIANTS):
    """Every variant on this rank (mesh {"dp": 2}): ``{label: (values, grads)}``."""
    hf = _moe(kind) if kind != "llama" else _llama()
    kwargs, loss_fn = (LLAMA_KW, _recorded_loss) if kind == "llama" else (MOE_KW, _moe_loss)
    fm, mesh, ids = sf.functional(hf), sf.Mesh({"dp": 2}), _tokens(dist.get_rank())
    out = {}
    for label, options, mode in variants:
        model = sf.shard_params(fm, mesh, "dp", **options)
        out[label] = _step(model, model.params_from(hf), ids, kwargs, loss_fn, mode)
    return out


def _reference(kind: str, ranks: int = 2):
    """Per rank the one-process values on its tokens; the gradient of the mean loss."""
    hf = _moe(kind) if kind != "llama" else _llama()
    kwargs, loss_fn = (LLAMA_KW, _recorded_loss) if kind == "llama" else (MOE_KW, _moe_loss)
    fm = sf.functional(hf)
    full = fm.params_from(hf)
    trainable, rest = fm.split_trainable(full)

    def mean_loss(t):
        return sum(loss_fn(fm.apply(fm.merge(t, rest), input_ids=_tokens(r), labels=_tokens(r),
                                    **kwargs)) for r in range(ranks)) / ranks

    values = [_values(fm.apply(full, input_ids=_tokens(r), labels=_tokens(r), **kwargs))
              for r in range(ranks)]
    return values, torch.func.grad(mean_loss)(trainable)


def _check(results, kind: str) -> None:
    want_values, want_grads = _reference(kind)
    for rank, per_rank in enumerate(results):
        for label, (values, grads) in per_rank.items():
            torch.testing.assert_close(values, want_values[rank],
                                       msg=lambda m, la=label: f"{la} {m}")
            assert grads.keys() == want_grads.keys()
            for name, want in want_grads.items():
                torch.testing.assert_close(grads[name], want,
                                           msg=lambda m, la=label, n=name: f"{la} {n}: {m}")


def test_mixtral_router_logits_under_shard_params_equal_one_process(worlds):
    """Mixtral on 2 ranks, ``output_router_logits=True``: the loss with the aux loss, the
    router logits of both layers, and the gathered gradients (the routers' included) equal
    one process; ZeRO-3 (torch.func), reshard_after_forward=False (autograd), remat."""
    results = worlds(2).run(_on_rank, "mixtral")
    assert results[0]["zero3"][0][1] is not None and len(results[0]["zero3"][0][2]) == 2
    _check(results, "mixtral")


def test_qwen2_moe_router_logits_from_its_config(worlds):
    """Qwen2-MoE (a shared expert; the flag in its config): the same, ZeRO-3."""
    _check(worlds(2).run(_on_rank, "qwen2_moe", VARIANTS[:1]), "qwen2_moe")


def test_llama_hidden_states_and_attentions_equal_one_process(worlds):
    """Llama (eager attention), ``output_hidden_states`` and ``output_attentions``: every
    hidden state (the embeddings' included) and attention map equals one process, and so do
    the gradients of a loss over all of them, in every variant."""
    results = worlds(2).run(_on_rank, "llama")
    hidden, attentions = results[0]["zero3"][0][3:]
    assert len(hidden) == 3 and len(attentions) == 2
    _check(results, "llama")


def _fsdp_ep_on_rank():
    """shard_params over an expert_parallel Mixtral, {"ep": 2}: the experts split over ep,
    every leaf sharded over it (the ep axis is the sharding axis)."""
    hf = _moe("mixtral")
    mesh = sf.Mesh({"ep": 2})
    model = sf.shard_params(expert_parallel(sf.functional(hf), mesh, "ep"), mesh, "ep")
    return {"fsdp_ep": _step(model, model.params_from(hf), _tokens(dist.get_rank()), MOE_KW,
                             _moe_loss, "grad")}


def test_fsdp_by_expert_parallel_router_logits(worlds):
    """``sf.shard_params(sf.expert_parallel(...))``: the aux loss and its gradients too."""
    _check(worlds(2).run(_fsdp_ep_on_rank), "mixtral")


# ------------------------------------------------------------------ one process


def _one_process(kind: str, **options):
    hf = _moe(kind)
    fm = sf.functional(hf)
    model = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp", **options)
    return hf, fm, model, _tokens(0)


def test_without_the_unit_boundary_the_router_gradient_is_wrong(monkeypatch):
    """The tests above can fail: with the router logits recorded inside the units but not
    returned by the unit calls (the hooks alone), the loss is right and the routers'
    gradients lose the aux loss's part."""
    from shardfn.transforms.shard_params import plan

    _, fm, model, ids = _one_process("mixtral")
    shards = model.params_from(_moe("mixtral"))
    _, want = _step(model, shards, ids, MOE_KW, _moe_loss, "grad")
    monkeypatch.setattr(plan, "call_recording", lambda inner, call, args, kw: call(args, kw))
    values, got = _step(model, shards, ids, MOE_KW, _moe_loss, "grad")
    torch.testing.assert_close(values[0], fm.apply(fm.params_from(_moe("mixtral")),
                                                   input_ids=ids, labels=ids, **MOE_KW).loss)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(got[router], want[router])


def test_router_logits_out_of_hf_gradient_checkpointing():
    """A model with ``gradient_checkpointing_enable()``: what its layers record inside their
    own checkpoints (router logits) leaves each checkpoint as an output, so the aux loss's
    gradient reaches the routers, under ``sf.functional`` and ``shard_params`` alike (it
    was silently missing there: the loss right, the router gradients not)."""
    ids, mesh = _tokens(0), sf.Mesh({"dp": 1})
    plain = sf.functional(reference := _moe("mixtral"))
    want, want_grads = _step(plain, plain.params_from(reference), ids, MOE_KW, _moe_loss, "grad")
    hf = _moe("mixtral", gc=True)
    for label, model in (("functional", sf.functional(hf)),
                         ("shard_params", sf.shard_params(sf.functional(hf), mesh, "dp"))):
        got, grads = _step(model, model.params_from(hf), ids, MOE_KW, _moe_loss, "grad")
        torch.testing.assert_close(got, want, msg=label)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-5,
                                       msg=lambda m, n=name, lab=label: f"{lab} {n}: {m}")


def test_refused_where_it_cannot_be_right(monkeypatch):
    """Refused by name: a transformers without the collector shardfn reads."""
    from transformers.utils import output_capturing

    ids = _tokens(0)
    model = sf.shard_params(sf.functional(_moe("qwen2_moe")), sf.Mesh({"dp": 1}), "dp")
    monkeypatch.delattr(output_capturing, "_active_collector")
    with pytest.raises(ValueError, match=r"output_router_logits=True \(a keyword or "
                                         r"Qwen2MoeConfig\).*come back empty"):
        model.apply(model.params_from(_moe("qwen2_moe")), input_ids=ids, labels=ids)
