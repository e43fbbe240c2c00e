"""PP x FSDP on Hugging Face models: stage models of a HF pipeline, also across tied weights.

``sf.pipeline_stages(hf_model, mesh, "pp", ..., stage_transform=lambda s, m:
sf.shard_params(s, m, "dp"))`` (torchtitan's Llama recipe) and the explicit form over
``sf.pipeline_split(hf_model, balance)``: each stage model is named, initialised and
planned like the HF model (its tree cut to the stage), and a weight tied across stages
(GPT-2's ``wte``/``lm_head``, a tied Llama) is held by the first and last stage, sharded
alike, its shard gradients summed between them after each stage's own reduction over dp.

On 4 ranks ``{"pp": 2, "dp": 2}``, one world call, each dp replica passing its half of the
batch (``dp_axis="dp"``): Llama (1F1B), tied Llama (GPipe), GPT-2 (1F1B and GPipe): the
loss and the gathered gradients equal HF's own on the whole batch, ``pp.gather(pp.init(0))``
is ``sf.functional(model).init(0)``, and 2 ``sf.optim.adamw`` steps over the stage shards
equal ``torch.optim.AdamW`` on the HF module (the trained leaves load into it strictly; the
last case also saves them with ``sf.checkpoint`` and the pipeline as layout, and loads them
back). Tensor parallel stages (``tensor_split(plan="auto")``, the model's own plan over the
stage's HF paths) on ``{"pp": 2, "tp": 2}`` for the tied Llama. Holders of a tied weight
laid out differently are refused, naming the leaf and both layouts. Plain units tied across
(virtual) stages as ZeRO-3 stage models equal the unsplit model.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from tests.hf.test_hf_pipeline import hf_model as pipeline_hf_model

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS, LR, EPS = 64, 4, 8, 2, 1e-2, 1e-6


def hf_model(kind: str) -> torch.nn.Module:
    """A tiny HF causal LM of 2 layers (``test_hf_pipeline``'s), the same in every process."""
    return pipeline_hf_model(kind, layers=2)


def ids() -> torch.Tensor:
    """Token ids, every position a label: each dp half counts as many tokens."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def reference(kind: str) -> tuple[torch.Tensor, dict, dict, list[float]]:
    """HF on the whole batch: the loss and gradients at the module's values, then the
    parameters and losses of ``STEPS`` ``torch.optim.AdamW`` steps."""
    model, batch = hf_model(kind), ids()
    fm = sf.functional(model)
    loss = model(input_ids=batch, labels=batch).loss
    names = dict(model.named_parameters())  # a tied alias is not listed again
    grads = dict(zip(names, torch.autograd.grad(loss, list(names.values())), strict=True))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        step_loss = model(input_ids=batch, labels=batch).loss
        step_loss.backward()
        opt.step()
        losses.append(step_loss.item())
    params = {fm.tied.get(n, n): p.detach() for n, p in model.named_parameters()}
    return loss.detach(), {fm.tied.get(n, n): g for n, g in grads.items()}, params, losses


def train_stage_models(kind: str, schedule: str, explicit: bool, path: str | None = None
                       ) -> dict:
    """On every rank of {"pp": 2, "dp": 2}: shard_params stages, this dp replica's half;
    with ``path``, the trained shards saved with the pipeline as layout, then loaded back."""
    mesh, model = sf.Mesh({"pp": 2, "dp": 2}), hf_model(kind)
    options = dict(schedule=schedule, microbatches=2, dp_axis="dp")
    if explicit:
        split = sf.pipeline_split(model, [2, 2])
        stages = [sf.shard_params(s, mesh.submesh(["dp"]), "dp") for s in split]
        pp = sf.pipeline_stages(stages, mesh, "pp", **options)
    else:
        pp = sf.pipeline_stages(model, mesh, "pp", balance=[2, 2], **options,
                                stage_transform=lambda s, m: sf.shard_params(s, m, "dp"))
    half = ids().chunk(2)[mesh.index("dp")]
    params = pp.params_from(model)
    out = {"init": pp.gather(pp.init(0)), "names": pp.names,
           "kinds": sorted({type(m).__name__ for m in pp.stage_models.values()}),
           "shard": {n: tuple(t.shape) for n, t in params.items()}}
    trainable, rest = pp.split_trainable(params)
    opt = sf.optim.adamw(LR, eps=EPS, weight_decay=0.01)
    state, losses = opt.init(trainable), []
    for step in range(STEPS):
        loss, grads = pp.value_and_grad(pp.merge(trainable, rest),
                                        {"input_ids": half, "labels": half})
        if step == 0:  # at the module's values: HF's loss and gradients
            out.update(loss=loss, grads=pp.gather(grads))
        updates, state = opt.update(grads, state, trainable)
        trainable = sf.optim.apply_updates(trainable, updates)
        losses.append(loss.item())
    full = pp.gather(trainable)
    state_dict = model.state_dict()  # the trained leaves load straight into the HF module
    model.load_state_dict({k: full.get(pp.functional.tied.get(k, k), v)
                           for k, v in state_dict.items()}, strict=True)
    out.update(trained=full, losses=losses, specs=pp.specs, layout=pp.layout)
    if path is not None:
        trained = pp.merge(trainable, rest)
        sf.checkpoint.save(path, {"params": trained}, mesh, {"params": pp})
        like = {"params": {n: torch.zeros_like(t) for n, t in trained.items()}}
        back = sf.checkpoint.load(path, like, mesh, {"params": pp})["params"]
        out["reloaded"] = all(torch.equal(back[n], t) for n, t in trained.items())
    return out


def tensor_parallel_stages(kind: str) -> dict:
    """On every rank of {"pp": 2, "tp": 2}: tensor_split(plan="auto") stages, whole batch."""
    mesh, model = sf.Mesh({"pp": 2, "tp": 2}), hf_model(kind)
    pp = sf.pipeline_stages(model, mesh, "pp", balance=[2, 2], schedule="1f1b",
                            microbatches=2,
                            stage_transform=lambda s, m: sf.tensor_split(s, m, "tp", "auto"))
    loss, grads = pp.value_and_grad(pp.params_from(model),
                                    {"input_ids": ids(), "labels": ids()})
    return {"loss": loss, "grads": pp.gather(grads)}


CASES = [("llama", "1f1b", False), ("tied", "gpipe", True), ("gpt2", "1f1b", False),
         ("gpt2", "gpipe", True)]
TIED = {"gpt2": "transformer.wte.weight", "tied": "model.embed_tokens.weight"}


def run_rank(path: str) -> list[dict]:
    return [train_stage_models(*case, path=path if index == len(CASES) - 1 else None)
            for index, case in enumerate(CASES)] + [tensor_parallel_stages("tied")]


def assert_close_leaves(got: dict, want: dict, where: str, **tolerance) -> None:
    assert sorted(got) == sorted(want), where
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tolerance,
                                   msg=lambda m, n=name: f"{where}: {n}: {m}")


def test_hf_stage_models_equal_the_hf_module(worlds, tmp_path):
    every = worlds(4).run(run_rank, str(tmp_path / "ckpt"))
    references = {kind: reference(kind) for kind in ("llama", "tied", "gpt2")}
    for index, (kind, schedule, explicit) in enumerate(CASES + [("tied", "1f1b tp", None)]):
        loss, grads, params, losses = references[kind]
        fm = sf.functional(hf_model(kind))
        for rank in range(4):
            got, where = every[rank][index], f"{kind} {schedule} explicit={explicit} rank {rank}"
            torch.testing.assert_close(got["loss"], loss, msg=where)
            assert_close_leaves(got["grads"], grads, where, atol=1e-6, rtol=1e-5)
            if explicit is None:
                continue
            assert got["kinds"] == ["ShardedModel"], where
            assert_close_leaves(got["init"], fm.init(0), where + " init", rtol=0, atol=0)
            assert_close_leaves(got["trained"], params, where + " trained", atol=2e-5,
                                rtol=1e-4)
            assert got["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), where
            assert all(spec == sf.Layout(sf.P("dp"), tuple(fm.param_shapes()[n].shape))
                       for n, spec in got["specs"].items() if n in fm.param_names), where
            if kind in TIED:  # held by both stages as this dp shard; stage 0's in gather
                assert TIED[kind] in got["names"] and got["layout"][TIED[kind]] == 0, where
                assert got["shard"][TIED[kind]] == (VOCAB // 2, 32), where
            assert got.get("reloaded", index != len(CASES) - 1), where  # saved: the last


def test_tied_holders_laid_out_differently_are_refused():
    mesh = sf.Mesh({"pp": 1, "dp": 1})
    model = hf_model("gpt2")
    split = sf.pipeline_split(model, [1, 3])
    stages = [sf.shard_params(split[0], mesh.submesh(["dp"]), "dp"), split[1]]
    with pytest.raises(ValueError, match=r"leaf 'transformer.wte.weight' is tied across stages "
                                         r"\[0, 1\]: stage 0 holds it as Layout\(spec=P\('dp'\)"
                                         r".*stage 1 as Layout\(spec=P\(\)"):
        sf.pipeline_stages(stages, mesh, "pp", virtual=2, schedule="gpipe", microbatches=2)


def test_plain_units_tied_across_stages_as_stage_models():
    """No HF: an embedding whose weight the head reuses, the two on different (virtual)
    stages, each stage ZeRO-3 over dp: the stage models hold the tied leaf under its first
    name, and the loss and gradient (the sum of both uses) are the unsplit model's."""
    emb, mid = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, 8)
    head = torch.nn.Linear(8, VOCAB, bias=False)
    head.weight = emb.weight
    units = [emb, mid, head]
    mesh = sf.Mesh({"pp": 1, "dp": 1})

    def ce(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    split = sf.pipeline_split(units, [2, 1])
    assert split.tied_across() == {"0.weight": (0, 1)} and "0.weight" in split[1].names
    pp = sf.pipeline_stages([sf.shard_params(s, mesh.submesh(["dp"]), "dp") for s in split],
                            mesh, "pp", virtual=2, schedule="gpipe", microbatches=2,
                            loss_fn=ce)
    loss, grads = pp.value_and_grad(pp.init(0), ids(), ids())
    full = split.full.init(0)
    ref_grads, ref_loss = torch.func.grad_and_value(
        lambda p: ce(split.full.apply(p, ids()), ids()))(full)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(pp.gather(grads), ref_grads)
