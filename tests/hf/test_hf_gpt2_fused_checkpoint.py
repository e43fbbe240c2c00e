"""GPT-2's fused ``c_attn`` (a ``Conv1D``: ``sf.FusedLayout(..., dim=1)``) in native
checkpoints and under FSDP x TP, against the HF module on one process.

A tiny GPT-2 (n_embd 32, 4 heads, 2 layers, vocab 64) is tensor-split over 2 ranks with
the GPT-2 plan of ``test_hf_tensor_split`` (fused ``c_attn``, Conv1D colwise/rowwise,
vocab-split embedding and tied head). Its parameters and an AdamW state (moments set
to ``2 p + 1``, so a moment in the wrong place shows) are saved with ``sf.checkpoint.save``
and loaded into (a) one process, plain leaves, (b) tp = 2 again and dp = 2 ``shard_params``,
(c) FSDP x TP (dp 2 x tp 2, 4 ranks), which saves again for a second one-process load:
every value equals the HF module's. FSDP x TP over GPT-2 (dp 2 x tp 2, each dp rank half
the batch) gives the HF module's loss and gradients on the whole batch. Before
``FusedLayout`` had a ``dim``, (a)-(c) raised in ``sf.checkpoint``.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ck
from tests.hf.test_hf_tensor_split import GPT2_PLAN, hf_model

transformers = pytest.importorskip("transformers")

C_ATTN = "transformer.h.0.attn.c_attn.weight"
VOCAB, BATCH, SEQ = 64, 4, 8


def close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _model(kind: str, mesh: sf.Mesh, hf: torch.nn.Module):
    """``kind``: "tp" (tensor_split over tp), "fsdp" (shard_params over dp) or "fsdp_tp"."""
    fm = sf.functional(hf)
    if kind == "fsdp":
        return sf.shard_params(fm, mesh, "dp")
    tp = sf.tensor_split(fm, mesh, "tp", GPT2_PLAN)
    return tp if kind == "tp" else sf.shard_params(tp, mesh, "dp")


def _state(kind: str, mesh_shape: dict, zero: bool):
    """This rank's ``{"params", "opt"}`` (HF's values, moments ``2 p + 1``; or zeros), the
    layouts, the mesh and the model."""
    mesh, hf = sf.Mesh(mesh_shape), hf_model("gpt2")
    model = _model(kind, mesh, hf)
    params = model.params_from(hf)
    if zero:
        params = {k: torch.zeros_like(v) for k, v in params.items()}
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)._replace(mu={k: 2 * v + 1 for k, v in params.items()},
                                      count=torch.tensor(0 if zero else 4))
    return {"params": params, "opt": state}, {"params": model, "opt": opt}, mesh, model


def _gathered(state: dict, mesh: sf.Mesh, model) -> tuple[dict, dict, int]:
    return (sf.gather(state["params"], model.specs, mesh),
            sf.gather(state["opt"].mu, model.specs, mesh), int(state["opt"].count))


def _save_tp(path: str) -> dict:
    state, layouts, mesh, model = _state("tp", {"tp": 2}, zero=False)
    ck.save(path, state, mesh, layouts)
    return {"c_attn": model.specs[C_ATTN], "local": tuple(state["params"][C_ATTN].shape)}


def _load_two(path: str) -> dict:
    """(b): tp = 2 again and dp = 2 shard_params (2 ranks)."""
    out = {}
    for kind, mesh_shape in (("tp", {"tp": 2}), ("fsdp", {"dp": 2})):
        like, layouts, mesh, model = _state(kind, mesh_shape, zero=True)
        out[kind] = _gathered(ck.load(path, like, mesh, layouts), mesh, model)
    return out


def _load_fsdp_tp(path: str, again: str) -> dict:
    """(c): load into FSDP x TP (dp 2 x tp 2, 4 ranks) and save that again."""
    like, layouts, mesh, model = _state("fsdp_tp", {"dp": 2, "tp": 2}, zero=True)
    loaded = ck.load(path, like, mesh, layouts)
    ck.save(again, loaded, mesh, layouts)
    return {"loaded": _gathered(loaded, mesh, model), "layout": model.specs[C_ATTN]}


def _fsdp_tp_grads() -> dict:
    """FSDP x TP (dp 2 x tp 2): loss (mean over dp) and gathered gradients of this dp
    rank's half of the batch, HF's values."""
    _, _, mesh, model = _state("fsdp_tp", {"dp": 2, "tp": 2}, zero=False)
    ids = _batch().chunk(2)[mesh.index("dp")]

    def loss_fn(params):
        logits = model.apply(params, input_ids=ids).logits  # this rank's vocabulary slice
        return sf.vocab_parallel_causal_lm_loss(logits, ids, "tp", mesh=mesh)

    grads, loss = torch.func.grad_and_value(loss_fn)(model.params_from(hf_model("gpt2")))
    return {"loss": sf.pmean(loss.detach(), "dp", mesh=mesh), "grads": model.gather(grads)}


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_reference() -> tuple[dict, torch.Tensor, dict]:
    """HF's leaves (the functional names), and its loss and gradients on the whole batch."""
    hf = hf_model("gpt2")
    ids = _batch()
    out = hf(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    return sf.functional(hf).params_from(hf), out.loss.detach(), grads


def _plain(state: dict) -> tuple[dict, dict, int]:
    """A one-process state as ``_gathered`` returns one."""
    return state["params"], state["opt"].mu, int(state["opt"].count)


def _check_state(got: tuple[dict, dict, int], full: dict, what: str) -> None:
    params, mu, count = got
    assert sorted(params) == sorted(full), what
    for name, value in full.items():
        close(params[name], value, f"{what}: {name}")
        close(mu[name], 2 * value + 1, f"{what}: moment {name}")
    assert count == 4, what


def test_gpt2_fused_c_attn_checkpoint_loads_into_every_layout(worlds, tmp_path):
    full = _hf_reference()[0]
    path, again = str(tmp_path / "tp2"), str(tmp_path / "fsdp_tp")
    saved = worlds(2).run(_save_tp, path)[0]
    assert saved["c_attn"] == sf.FusedLayout("tp", 3, (32, 96), dim=1)  # the case covers it
    assert saved["local"] == (32, 48)
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    like = {"params": zeros, "opt": sf.optim.adamw(1e-2).init(zeros)}
    _check_state(_plain(ck.load(path, like)), full, "(a) one process")
    for rank, got in enumerate(worlds(2).run(_load_two, path)):
        for kind, state in got.items():
            _check_state(state, full, f"(b) {kind} rank {rank}")
    for rank, got in enumerate(worlds(4).run(_load_fsdp_tp, path, again)):
        assert got["layout"].tp == saved["c_attn"]
        _check_state(got["loaded"], full, f"(c) FSDP x TP rank {rank}")
    _check_state(_plain(ck.load(again, like)), full, "(c) FSDP x TP saved, one process")


def test_gpt2_fsdp_x_tp_loss_and_grads_equal_hf(worlds):
    _, want_loss, want_grads = _hf_reference()
    for rank, got in enumerate(worlds(4).run(_fsdp_tp_grads)):
        close(got["loss"], want_loss, f"loss, rank {rank}")
        assert sorted(got["grads"]) == sorted(want_grads)
        for name, grad in got["grads"].items():
            close(grad, want_grads[name], f"grad {name}, rank {rank}")
