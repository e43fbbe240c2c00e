"""Every transform x every Hugging Face model (#24 item 1): the cells most likely to break.

Tiny models from configs (no download): Llama (GQA), Qwen2, Qwen3 (per-head norms),
Mistral with a sliding window shorter than the sequence, GPT-2 (tied, ``Conv1D``, fused
``c_attn``), BERT (``BertForMaskedLM``, tied decoder and bias; ``BertModel``) and
``LlamaForSequenceClassification``, eager and sdpa. Each cell is a model, an attention
implementation and a transform written with the default glue (``plan="auto"`` for
tensor parallel, the model's own ``_no_split_modules`` as units); it returns the loss
(averaged over the data-parallel ranks) and the gathered gradients, or 3 AdamW steps'
parameters, and is compared with the HF module on the whole batch in the test process
(float32: tight; bfloat16 precision and autocast: looser). The cells of one world size
run in one world call; the refusals are asserted by message.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.transforms._tp_hf import split_heads
from shardfn.transforms._tp_plan import match_plan
from shardfn.transforms._tp_styles import Colwise

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, LR, EPS = 64, 4, 8, 1e-3, 1e-6
FP32 = {"atol": 2e-5, "rtol": 1e-4}
BF16 = {"atol": 3e-3, "rtol": 6e-2}
BF16_LOSS = {"atol": 3e-2, "rtol": 0.0}
P16 = sf.Precision(param_dtype=torch.bfloat16)


def hf_model(kind: str, attn: str = "eager", gc: bool = False) -> torch.nn.Module:
    """A tiny HF model, the same in every process (dropout off, train mode)."""
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    decoder = dict(num_key_value_heads=2, max_position_embeddings=32, **common)
    configs = {
        "llama": lambda: t.LlamaConfig(**decoder),
        "qwen2": lambda: t.Qwen2Config(**decoder),
        "qwen3": lambda: t.Qwen3Config(head_dim=8, **decoder),
        "mistral": lambda: t.MistralConfig(sliding_window=4, **decoder),  # < SEQ
        "seqcls": lambda: t.LlamaConfig(num_labels=3, pad_token_id=0, **decoder),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        "bert": lambda: t.BertConfig(max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **common)}
    config = configs["bert" if kind.startswith("bert") else kind]()
    cls = {"seqcls": t.LlamaForSequenceClassification, "bert": t.BertForMaskedLM,
           "bert_model": t.BertModel}.get(kind, t.AutoModelForCausalLM)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = (cls.from_config if cls is t.AutoModelForCausalLM else cls._from_config)(
            config, attn_implementation=attn)
        if gc:
            model.gradient_checkpointing_enable()
    return model.train()


def batch(kind: str) -> dict[str, torch.Tensor]:
    """The whole batch; each row ignores the same label positions (equal counts per rank)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    if kind == "bert_model":
        return {"input_ids": ids}
    if kind == "seqcls":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (BATCH,), generator=gen)}
    labels = ids.clone()
    labels[:, 2] = -100
    if kind == "bert":
        labels[:, ::2] = -100
    return {"input_ids": ids, "labels": labels}


def loss_of(out) -> torch.Tensor:
    """The model's own loss; for ``BertModel`` (none) a mean over its outputs."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    return out.last_hidden_state.float().square().mean() + out.pooler_output.float().mean()


# ------------------------------------------------------------------ the transforms


def build(how: str, kind: str, hf: torch.nn.Module) -> tuple[object, int, int]:
    """``(model, dp index, dp size)`` of the transform named ``how``, on this world."""
    n, fm = dist.get_world_size(), sf.functional(hf)
    dp, tp = sf.Mesh({"dp": n}), sf.Mesh({"tp": n})
    both = sf.Mesh({"dp": n // 2, "tp": 2}) if n >= 2 else None
    replicated = sf.Mesh({"rep": 2, "dp": n // 2}) if n >= 2 else None
    made = {
        "zero3": lambda: (sf.shard_params(fm, dp, "dp"), dp),
        "wp(zero3)": lambda: (sf.with_precision(sf.shard_params(fm, dp, "dp"), P16), dp),
        "zero3(wp)": lambda: (sf.shard_params(sf.with_precision(fm, P16), dp, "dp"), dp),
        "zero3(remat)": lambda: (sf.shard_params(sf.remat(fm), dp, "dp"), dp),
        "remat(zero3)": lambda: (sf.remat(sf.shard_params(fm, dp, "dp")), dp),
        "hsdp": lambda: (sf.shard_params(fm, replicated, "dp", replicate_axis="rep"),
                         replicated),
        "tp": lambda: (sf.tensor_split(fm, tp, "tp", plan="auto"), None),
        "remat(tp)": lambda: (sf.remat(sf.tensor_split(fm, tp, "tp", plan="auto")), None),
        "tp(remat)": lambda: (sf.tensor_split(sf.remat(fm), tp, "tp", plan="auto"), None),
        "wp(tp)": lambda: (sf.with_precision(sf.tensor_split(fm, tp, "tp", "auto"), P16), None),
        "fsdptp": lambda: (sf.shard_params(sf.tensor_split(fm, both, "tp", "auto"), both,
                                           "dp"), both),
        "fsdptp(wp)": lambda: (sf.shard_params(sf.tensor_split(fm, both, "tp", "auto"), both,
                                               "dp", precision=P16), both),
    }[how.split("+")[0]]
    model, mesh = made()
    if mesh is None:
        return model, 0, 1
    if how.startswith("hsdp"):
        return model, dist.get_rank(), n
    return model, mesh.index("dp"), mesh.size("dp")


def gradients(kind: str, attn: str, how: str) -> tuple[torch.Tensor, dict]:
    """On every rank: the loss (mean over the dp ranks) and the gathered gradients."""
    hf = hf_model(kind, attn, gc="+gc" in how)
    model, index, size = build(how, kind, hf)
    local = {k: v.chunk(size)[index] for k, v in batch(kind).items()}
    trainable, rest = model.split_trainable(model.params_from(hf))

    def loss_fn(t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled="+autocast" in how):
            return loss_of(model.apply(model.merge(t, rest), **local))

    grads, loss = torch.func.grad_and_value(loss_fn)(trainable)
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size(), model.gather(grads)


def adamw(kind: str, attn: str, how: str) -> tuple[torch.Tensor, dict]:
    """On every rank: 3 AdamW steps; the losses and the gathered parameters."""
    hf = hf_model(kind, attn)
    model, index, size = build(how, kind, hf)
    local = {k: v.chunk(size)[index] for k, v in batch(kind).items()}
    trainable, rest = model.split_trainable(model.params_from(hf))
    opt = sf.optim.adamw(LR, eps=EPS)
    state, losses = opt.init(trainable), []
    for _ in range(3):
        grads, loss = torch.func.grad_and_value(
            lambda t: loss_of(model.apply(model.merge(t, rest), **local)))(trainable)
        updates, state = opt.update(grads, state, trainable)
        trainable = sf.optim.apply_updates(trainable, updates)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total / dist.get_world_size())
    return torch.stack(losses), model.gather(trainable)


def pipeline(kind: str, attn: str, how: str) -> tuple[torch.Tensor, dict]:
    """On every rank: a pipeline of the HF model itself (2 stages), its loss and grads."""
    n, hf = dist.get_world_size(), hf_model(kind, attn, gc="+gc" in how)
    mesh = sf.Mesh({"pp": 2, "dp": n // 2})
    stages = {"stage_transform": lambda s, m: sf.shard_params(s, m, "dp")} \
        if how.startswith("pp(zero3)") else {}
    pp = sf.pipeline_stages(hf, mesh, "pp", balance=[2, 2], microbatches=2, dp_axis="dp",
                            **stages)
    local = {k: v.chunk(n // 2)[mesh.index("dp")] for k, v in batch(kind).items()}
    loss, grads = pp.value_and_grad(pp.params_from(hf), local)
    return loss.detach(), pp.gather(grads)


def run_cells(cells: list[tuple[str, str, str]]) -> list[object]:
    """Every cell on this rank: its result, or the error's ``"Type: message"``."""
    out = []
    for kind, attn, how in cells:
        run = pipeline if how.startswith("pp") else adamw if how.endswith("+adamw") else \
            gradients
        try:
            out.append(run(kind, attn, how))
        except (ValueError, TypeError, RuntimeError) as err:
            out.append(f"{type(err).__name__}: {err}")
    return out


# ------------------------------------------------------------------ the references


def reference(kind: str, attn: str, how: str) -> tuple[torch.Tensor, dict]:
    """The HF module on the whole batch: ``(loss, grads)``, or ``(losses, params)`` after 3
    ``torch.optim.AdamW`` steps; in bfloat16 for a precision policy, under autocast for
    autocast cells."""
    hf, data = hf_model(kind, attn), batch(kind)
    if "wp" in how:
        hf = hf.to(torch.bfloat16)
    tied = set(sf.functional(hf).tied)
    if how.endswith("+adamw"):
        opt = torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = loss_of(hf(**data))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses), {k: v.detach() for k, v in hf.named_parameters()
                                     if k not in tied}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled="+autocast" in how):
        loss = loss_of(hf(**data))
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in hf.named_parameters()
                           if k not in tied and v.grad is not None}


def assert_like_hf(got: tuple[torch.Tensor, dict], cell: tuple[str, str, str]) -> None:
    kind, attn, how = cell
    want_loss, want = reference(*cell)
    loss, values = got
    low = "wp" in how or "autocast" in how
    torch.testing.assert_close(loss.float(), want_loss.float(), **(BF16_LOSS if low else FP32),
                               msg=lambda m: f"{cell} loss: {m}")
    assert values.keys() >= want.keys(), (cell, sorted(want.keys() - values.keys()))
    for name, value in want.items():
        assert values[name].dtype == torch.float32, (cell, name, values[name].dtype)
        torch.testing.assert_close(values[name], value.float(), **(BF16 if low else FP32),
                                   msg=lambda m, name=name: f"{cell} {name}: {m}")


def check_world(results: list[list[object]], cells: list[tuple[str, str, str]],
                refused: dict[tuple[str, str, str], str]) -> None:
    for index, cell in enumerate(cells):
        every = [rank_results[index] for rank_results in results]
        if cell in refused:
            assert all(isinstance(r, str) for r in every), (cell, every[0])
            for text in every:
                assert refused[cell] in text, (cell, text)
            continue
        assert not isinstance(every[0], str), (cell, every[0])
        for got in every:
            assert_like_hf(got, cell)


# ------------------------------------------------------------------ the cells

CELLS_2 = [  # (model, attention, transform) on 2 ranks
    ("qwen2", "eager", "zero3"), ("mistral", "sdpa", "zero3"), ("qwen3", "sdpa", "zero3"),
    ("seqcls", "eager", "zero3"), ("bert_model", "sdpa", "zero3"),
    ("gpt2", "sdpa", "zero3+gc"), ("bert", "eager", "zero3+gc"),
    ("llama", "sdpa", "zero3+autocast"), ("gpt2", "eager", "wp(zero3)"),
    ("bert", "sdpa", "zero3(wp)"), ("qwen2", "sdpa", "zero3(remat)"),
    ("llama", "eager", "remat(zero3)"),
    ("gpt2", "eager", "tp"), ("gpt2", "sdpa", "tp+gc"), ("bert", "eager", "tp"),
    ("bert", "sdpa", "remat(tp)"), ("bert_model", "eager", "tp"), ("qwen2", "sdpa", "tp"),
    ("mistral", "eager", "tp"), ("seqcls", "sdpa", "tp"), ("llama", "sdpa", "tp+gc"),
    ("gpt2", "sdpa", "tp(remat)"), ("llama", "eager", "wp(tp)"), ("gpt2", "sdpa", "tp+adamw"),
    ("bert", "eager", "tp+adamw"),
]
CELLS_4 = [
    ("gpt2", "sdpa", "hsdp"), ("bert", "eager", "hsdp"),
    ("llama", "eager", "fsdptp"), ("gpt2", "sdpa", "fsdptp"), ("bert", "eager", "fsdptp"),
    ("qwen3", "sdpa", "fsdptp"), ("llama", "sdpa", "fsdptp+gc"), ("gpt2", "eager", "fsdptp+gc"),
    ("bert", "sdpa", "fsdptp(wp)"), ("gpt2", "eager", "fsdptp+adamw"),
    ("llama", "eager", "pp+gc"), ("gpt2", "sdpa", "pp(zero3)"),
    ("llama", "eager", "tp"),  # 4 ranks > 2 key/value heads: refused
]
REFUSED = {("llama", "eager", "tp"): "tp = 4 (size of axis 'tp') is larger than "
                                     "num_key_value_heads = 2"}


@pytest.fixture(scope="module")
def world_results(worlds):
    return {2: worlds(2).run(run_cells, CELLS_2), 4: worlds(4).run(run_cells, CELLS_4)}


@pytest.mark.parametrize("cell", CELLS_2, ids=["-".join(c) for c in CELLS_2])
def test_two_ranks_equal_hf(world_results, cell):
    """ZeRO-3 (default units), its compositions with precision and remat, autocast, HF's
    own checkpointing, and ``tensor_split(plan="auto")`` (GPT-2 and BERT from shardfn's
    plans for them): loss and gradients (or 3 AdamW steps) equal the HF module's."""
    index = CELLS_2.index(cell)
    check_world([r[index:index + 1] for r in world_results[2]], [cell], REFUSED)


@pytest.mark.parametrize("cell", CELLS_4, ids=["-".join(c) for c in CELLS_4])
def test_four_ranks_equal_hf(world_results, cell):
    """HSDP, FSDP x TP (fused ``c_attn``, per-head norms, HF checkpointing, bf16, AdamW),
    pipelines of the HF model (checkpointing; ZeRO-3 stages) on 2 x 2 meshes; tp = 4
    over 2 key/value heads is refused naming both numbers."""
    index = CELLS_4.index(cell)
    check_world([r[index:index + 1] for r in world_results[4]], [cell], REFUSED)


def test_the_comparison_can_fail(world_results):
    """A loss not averaged over the ranks, or a gradient off by its rank count, fails."""
    loss, grads = world_results[2][0][0]
    with pytest.raises(AssertionError):
        assert_like_hf((loss * 2, grads), CELLS_2[0])
    with pytest.raises(AssertionError):
        assert_like_hf((loss, {k: v * 2 for k, v in grads.items()}), CELLS_2[0])


# ------------------------------------------------------------------ one process


def test_input_require_grads_and_recorded_outputs():
    """``enable_input_require_grads()`` (PEFT, HF checkpointing) no longer breaks
    ``torch.func.grad``; ``output_hidden_states`` equals HF under ``sf.functional`` and
    under ``shard_params`` (recorded inside its units; tests/hf/test_hf_router_logits.py
    checks values and gradients on 2 ranks, and what stays refused)."""
    data = batch("gpt2")
    hf = hf_model("gpt2", "sdpa")
    hf.enable_input_require_grads()
    fm = sf.functional(hf)
    trainable, rest = fm.split_trainable(fm.params_from(hf))
    grads, loss = torch.func.grad_and_value(
        lambda t: fm.apply(fm.merge(t, rest), **data).loss)(trainable)
    assert_like_hf((loss, grads), ("gpt2", "sdpa", ""))
    out = fm.apply(fm.params_from(hf), **data, output_hidden_states=True)
    hidden = hf(**data, output_hidden_states=True).hidden_states
    assert len(out.hidden_states) == len(hidden) == 3
    for got, expected in zip(out.hidden_states, hidden, strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    sharded = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp")
    out = sharded.apply(sharded.params_from(hf), **data, output_hidden_states=True)
    assert len(out.hidden_states) == len(hidden)
    for got, expected in zip(out.hidden_states, hidden, strict=True):
        torch.testing.assert_close(got, expected)


def test_plans_for_models_without_one_and_hf_globs():
    """GPT-2 and BERT have no plan in transformers 5: ``plan="auto"`` uses shardfn's (blocks
    split as Megatron does; GPT-2's tied ``wte``/``lm_head`` by vocabulary); BERT's heads
    come from ``attention_head_size``; a HF glob whose ``*`` would span dots loses to the
    one matching component by component, and a real ambiguity is still refused."""
    gpt2, bert = sf.hf_tp_plan(hf_model("gpt2")), sf.hf_tp_plan(hf_model("bert"))
    assert gpt2["transformer.wte"] == sf.Vocab()
    assert gpt2["lm_head"] == Colwise(gather_output=True)
    assert gpt2["transformer.h.*.attn.c_attn"] == Colwise()
    assert bert["bert.encoder.layer.*.output.dense"] == sf.Rowwise()
    assert not any("embeddings" in k or "cls" in k for k in bert)  # tied decoder: whole
    model = hf_model("bert")
    styles = {"bert.encoder.layer.0.attention.self.query": Colwise()}
    split_heads(styles, copy.deepcopy(model), 2, "tp")
    assert styles["bert.encoder.layer.0.attention.self.query"].n_heads == 4
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by tp = 3"):
        split_heads(dict(styles), copy.deepcopy(model), 3, "tp")
    paths = ["layer.0.attention.output.dense", "layer.0.output.dense"]
    styles = match_plan({"layer.*.output.dense": "rowwise",
                         "layer.*.attention.output.dense": "colwise"}, paths)
    assert styles == {"layer.0.output.dense": sf.Rowwise(),
                      "layer.0.attention.output.dense": Colwise()}
    with pytest.raises(ValueError, match="matched by both"):
        match_plan({"layer.*": "rowwise", "*.dense": "colwise"}, paths)
