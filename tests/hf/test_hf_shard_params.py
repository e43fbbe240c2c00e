"""Hugging Face models through ``sf.functional``, ``shard_params``, ``shard_opt_state``,
``remat`` and ``Precision``, with the default glue, against the HF module on one process.

Tiny models from configs (no download): Llama (GQA), Qwen2, Mistral, GPT-2 (tied
``wte``/``lm_head``, ``Conv1D``), BERT (``BertForMaskedLM``, tied decoder). The
distributed cases run in one world call per world size, each rank computing several
checks, and compare with ``torch.optim.AdamW`` on the HF module over the whole batch.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS, LR, EPS = 64, 4, 8, 3, 1e-2, 1e-6


def hf_model(kind: str, attn: str = "eager") -> torch.nn.Module:
    """A tiny HF model, the same in every process (dropout off, train mode)."""
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    if kind in ("llama", "qwen2", "mistral"):
        config_class = {"llama": t.LlamaConfig, "qwen2": t.Qwen2Config,
                        "mistral": t.MistralConfig}[kind]
        config = config_class(num_key_value_heads=2, max_position_embeddings=32, **common)
        build = lambda: t.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn)
    elif kind == "gpt2":
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              bos_token_id=0, eos_token_id=0)
        build = lambda: t.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn)
    else:
        config = t.BertConfig(max_position_embeddings=32, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0, **common)
        build = lambda: t.BertForMaskedLM._from_config(
            config, attn_implementation=attn)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build().train()


def batch() -> torch.Tensor:
    """Token ids; every position is a label, so each rank's loss counts the same tokens."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def hf_reference(kind: str, attn: str = "eager", steps: int = STEPS
                 ) -> tuple[dict, list[float]]:
    """The HF module trained ``steps`` steps with ``torch.optim.AdamW`` on the whole batch."""
    model, ids = hf_model(kind, attn), batch()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.named_parameters()}, losses


def train(kind: str, how: str, attn: str = "eager") -> tuple[dict, list[float]]:
    """On every rank: ``STEPS`` AdamW steps on this rank's part of the batch.

    ``how``: ``zero3`` (``shard_params``, default units), ``hsdp`` (over a 2 x 2 mesh) or
    ``zero1`` (``sf.functional`` with ``shard_opt_state``). Returns the full parameters
    (gathered) and the mean loss over the ranks at each step.
    """
    n, hf = torch.distributed.get_world_size(), hf_model(kind, attn)
    fm = sf.functional(hf)
    if how == "zero1":
        mesh = sf.Mesh({"dp": n})
        model, opt = fm, sf.shard_opt_state(sf.optim.adamw(LR, eps=EPS), mesh, "dp")
        rank = mesh.index("dp")
    else:
        mesh = sf.Mesh({"dp": n} if how == "zero3" else {"rep": 2, "dp": n // 2})
        model = sf.shard_params(fm, mesh, "dp", **({} if how == "zero3" else
                                                   {"replicate_axis": "rep"}))
        opt, rank = sf.optim.adamw(LR, eps=EPS), torch.distributed.get_rank()
    ids = batch().chunk(n)[rank]
    trainable, rest = model.split_trainable(model.params_from(hf))
    state = opt.init(trainable)
    loss_fn = lambda t: model.apply(model.merge(t, rest), input_ids=ids, labels=ids).loss
    losses = []
    for _ in range(STEPS):
        grads, loss = torch.func.grad_and_value(loss_fn)(trainable)
        updates, state = opt.update(grads, state, trainable)
        trainable = sf.optim.apply_updates(trainable, updates)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # every rank's batch has as many tokens
        losses.append(total.item() / n)
    return model.gather(trainable), losses


def train_all(cases: list[tuple[str, str, str]]) -> list[tuple[dict, list[float]]]:
    return [train(*case) for case in cases]


def assert_trained_like_hf(got: tuple[dict, list[float]], want: tuple[dict, list[float]],
                           what: str) -> None:
    params, losses = got
    want_params, want_losses = want
    assert params.keys() <= want_params.keys(), what
    for name, value in params.items():
        torch.testing.assert_close(value, want_params[name], atol=2e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{what}: {name}: {m}")
    assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6), what


def test_shard_params_and_shard_opt_state_train_like_hf_adamw(worlds):
    """ZeRO-3 (default units) and ZeRO-1 on 2 ranks, 3 AdamW steps: Llama (eager, sdpa),
    GPT-2 (tied, Conv1D), BERT (tied decoder and bias; sdpa, eager): the HF module's
    parameters and losses; HSDP on 4 ranks once (Llama)."""
    cases = [("llama", "zero3", "eager"), ("gpt2", "zero3", "eager"), ("bert", "zero3", "sdpa"),
             ("llama", "zero1", "sdpa"), ("gpt2", "zero1", "eager"), ("bert", "zero1", "eager")]
    results = worlds(2).run(train_all, cases)
    hsdp = worlds(4).run(train, "llama", "hsdp", "eager")
    references = {}
    for index, case in enumerate(cases):
        kind, _, attn = case
        want = references.setdefault((kind, attn), hf_reference(kind, attn))
        for rank in range(2):
            assert_trained_like_hf(results[rank][index], want, f"{case} rank {rank}")
    for rank in range(4):
        assert_trained_like_hf(hsdp[rank], references[("llama", "eager")], f"hsdp rank {rank}")
    # the comparison catches a step too few (or a gradient not averaged over the ranks)
    params, losses = hf_reference("llama", steps=STEPS - 1)
    with pytest.raises(AssertionError):
        assert_trained_like_hf((params, results[0][0][1]), references[("llama", "eager")], "")


# ---------------------------------------------------------------- one process


def grads_of(model, params, ids):
    trainable, rest = model.split_trainable(params)
    return torch.func.grad_and_value(lambda t: model.apply(
        model.merge(t, rest), input_ids=ids, labels=ids).loss)(trainable)


def hf_grads(hf, ids):
    hf.zero_grad()
    out = hf(input_ids=ids, labels=ids)
    out.loss.backward()
    return {k: p.grad for k, p in hf.named_parameters()}, out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2", "bert"])
def test_functional_equals_the_hf_module(kind):
    """Logits, loss (the ModelOutput's ``.loss``) and gradients, eager and sdpa."""
    ids = batch()
    for attn in ("eager", "sdpa"):
        hf = hf_model(kind, attn)
        fm = sf.functional(hf)
        params = fm.params_from(hf)
        out = fm.apply(params, input_ids=ids, labels=ids)
        want_grads, want = hf_grads(hf, ids)
        assert type(out) is type(want)
        torch.testing.assert_close(out.logits, want.logits, atol=0, rtol=0)
        torch.testing.assert_close(out.loss, want.loss, atol=0, rtol=0)
        grads, loss = grads_of(fm, params, ids)
        torch.testing.assert_close(loss, want.loss)
        for name, grad in grads.items():
            where = f"{kind} {attn} {name}"
            torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-5,
                                       msg=lambda m, where=where: f"{where}: {m}")
        assert {fm.tied.get(k, k) for k in want_grads} == set(grads)  # tied: one leaf


def test_init_follows_hf_init_weights():
    """``init(seed)`` is HF's ``_init_weights``: embeddings and linears N(0, 0.02), GPT-2's
    ``c_proj`` N(0, 0.02 / sqrt(2 n_layer)), norms ones, rotary frequencies from the config;
    deterministic, the caller's RNG and module untouched, any subset the same values."""
    llama, gpt2, bert = hf_model("llama"), hf_model("gpt2"), hf_model("bert")
    for hf in (llama, gpt2, bert):
        before = {k: v.clone() for k, v in hf.state_dict().items()}
        fm = sf.functional(hf)
        rng = torch.random.get_rng_state()
        params = fm.init(0)
        assert torch.equal(rng, torch.random.get_rng_state())
        again, other = fm.init(0), fm.init(1)
        assert all(torch.equal(params[k], again[k]) for k in params)
        owner = fm.owners[fm.param_names[-1]]
        subset = fm.init_subset(0, [owner])
        assert subset and all(torch.equal(subset[k], params[k]) for k in subset)
        assert all(torch.equal(v, hf.state_dict()[k]) for k, v in before.items())
        embedding = next(k for k in params if k.endswith(("embed_tokens.weight", "wte.weight",
                                                          "word_embeddings.weight")))
        assert abs(params[embedding].std().item() - 0.02) < 0.003, embedding
        assert not torch.equal(params[embedding], other[embedding])
        norms = [k for k in params if ("norm" in k.lower() or "ln_" in k) and k.endswith("weight")]
        assert norms and all(torch.equal(params[k], torch.ones_like(params[k])) for k in norms)
        for name, value in fm.abstract().items():  # buffers are the HF model's own
            if name in fm.buffer_names:
                torch.testing.assert_close(params[name], hf.get_buffer(name), atol=0, rtol=0)
            assert params[name].shape == value.shape
    gpt2_params = sf.functional(gpt2).init(0)
    c_proj = gpt2_params["transformer.h.0.attn.c_proj.weight"].std().item()
    assert abs(c_proj - 0.02 / math.sqrt(4)) < 0.002
    q_proj = sf.functional(llama).init(0)["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q_proj.std().item() - 0.02) < 0.003


def test_default_units_are_the_models_no_split_modules():
    """``shard_params(fm, mesh, "dp")`` gathers HF's ``_no_split_modules`` one at a time
    (HF's FSDP auto-wrap); ``units=[]`` asks for one unit, explicit units win."""
    mesh = sf.Mesh({"dp": 1})
    units = lambda kind, **kw: sf.shard_params(
        sf.functional(hf_model(kind)), mesh, "dp", **kw).units
    assert units("llama") == ("model.layers.0", "model.layers.1")
    assert units("gpt2") == ("transformer.h.0", "transformer.h.1")
    assert units("bert") == ("bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1")
    assert units("llama", units=[]) == ()
    assert units("llama", units=["model.norm"]) == ("model.norm",)
    assert sf.shard_params(sf.functional(torch.nn.Linear(2, 2)), mesh, "dp").units == ()
    fm = sf.functional(hf_model("gpt2"))  # each unit built on its own: the same values
    model, want = sf.shard_params(fm, mesh, "dp"), fm.init(3)
    assert all(torch.equal(v, want[k]) for k, v in model.gather(model.init(3)).items())


def test_remat_precision_and_hf_gradient_checkpointing_on_llama():
    """On one process: ``remat=`` (per decoder layer), ``sf.remat`` of the functional model,
    HF's own ``gradient_checkpointing_enable()`` (run as remat) and sdpa give the gradients
    of the plain HF module; bf16 ``Precision`` those of the HF module in bf16."""
    ids, mesh = batch(), sf.Mesh({"dp": 1})
    policies = sf.checkpoint_policies
    hf = hf_model("llama", "sdpa")
    want, out = hf_grads(hf, ids)
    fm = sf.functional(hf)
    params = fm.params_from(hf)
    checkpointed = hf_model("llama", "sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpointed.gradient_checkpointing_enable()
    models = {"remat=nothing_saveable": sf.shard_params(fm, mesh, "dp",
                                                        remat=policies.nothing_saveable),
              # a policy that saves: the root's recompute replays the ops it recorded, so
              # the rotary buffer's copy must be made outside the replay (as in the forward)
              "remat=everything_saveable": sf.shard_params(
                  fm, mesh, "dp", remat=policies.everything_saveable),
              "sf.remat(dots_saveable)": sf.shard_params(sf.remat(fm, policies.dots_saveable),
                                                         mesh, "dp"),
              "gradient_checkpointing_enable": sf.shard_params(sf.functional(checkpointed),
                                                               mesh, "dp")}
    for what, model in models.items():
        grads, loss = grads_of(model, model.shard(params), ids)
        torch.testing.assert_close(loss, out.loss, msg=what)
        for name, grad in model.gather(grads).items():
            torch.testing.assert_close(grad, want[name], atol=1e-6, rtol=1e-5,
                                       msg=lambda m, name=name, what=what: f"{what} {name}: {m}")
    bf16 = sf.shard_params(fm, mesh, "dp", precision=sf.Precision(param_dtype=torch.bfloat16))
    grads, loss = grads_of(bf16, bf16.shard(params), ids)
    want_bf16, out_bf16 = hf_grads(hf.to(torch.bfloat16), ids)
    torch.testing.assert_close(loss.float(), out_bf16.loss.float(), atol=2e-2, rtol=0)
    assert 0 < abs(loss.item() - out.loss.item()) < 5e-2  # computed in bf16, close to fp32
    for name, grad in bf16.gather(grads).items():
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, want_bf16[name].float(), atol=2e-3, rtol=5e-2,
                                   msg=lambda m, name=name: f"bf16 {name}: {m}")
