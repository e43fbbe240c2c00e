"""FSDP + TP: ``shard_params`` over ``tensor_split`` on a 2-D mesh equals one process.

On 4 ranks, mesh {"dp": 2, "tp": 2} (and, in the property test, every 2-D shape of
2 and 4 ranks): the reference GPT and an MLP give the single-process forward, loss
and gradients (torch.func and autograd); replicated-over-tp gradients are equal on
the tp ranks and not double-reduced; 5 AdamW steps with ``clip_by_global_norm``
(clipping active) equal 5 single-process steps on the full batch, compared after
every step; the same with ``shard_opt_state`` (ZeRO) over dp instead of
``shard_params`` (ZeRO-2 with autograd overlap too); HSDP x TP on {"rep", "dp", "tp"};
the global norm is exact and the per-rank parameter count is (split/tp + rest)/dp; bad
input is refused clearly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import GPT, GPTConfig, gpt_tp_plan
from shardfn.models.gpt import Block as GPTBlock

STEPS = 5
LR, CLIP = 3e-2, 0.05
# Adam's eps: the attention's k bias has an exactly-zero gradient (softmax ignores a shift
# of every score), which float32 computes as ~1e-9 noise; with eps=1e-8 Adam turns that
# noise into lr-sized updates of random sign, on the sharded and the unsharded side alike.
EPS = 1e-3


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(n_blocks))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


MLP_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


# ---------------------------------------------------------------- cases


def _fmodel(case: dict):
    if case["kind"] == "gpt":
        return sf.functional(GPT(GPTConfig(vocab_size=case["vocab"], d_model=case["d"],
                                           n_layers=2, n_heads=case["heads"], seq_len=8,
                                           dropout=0.0)))
    return sf.functional(MLP(case["d"], case["hidden"]))


def _batch(case: dict, step: int):
    gen = torch.Generator().manual_seed(case["seed"] * 100 + step)
    b, s = _n_data(case) * case["per_rank"], case["seq"]
    if case["kind"] == "gpt":
        return (torch.randint(0, case["vocab"], (b, s), generator=gen),
                torch.randint(0, case["vocab"], (b, s), generator=gen))
    return torch.randn(b, s, case["d"], generator=gen), torch.randint(0, 3, (b, s), generator=gen)


def _full_loss(case: dict, fmodel, params, x, y):
    return F.cross_entropy(fmodel.apply(params, x).flatten(0, 1), y.flatten())


def _gpt_case(**kw) -> dict:
    case = {"kind": "gpt", "dp": 2, "tp": 2, "vocab": 16, "d": 16, "heads": 4, "seq": 8,
            "per_rank": 2, "seed": 3, "remat": False, "zero": False}
    return {**case, **kw}


# ---------------------------------------------------------------- on the ranks


def _n_data(case: dict) -> int:
    """Data-parallel ranks: dp, times the HSDP replicas ("rep") if any."""
    return case.get("rep", 1) * case["dp"]


def _data_axes(case: dict):
    return ("rep", "dp") if case.get("rep") else "dp"


def _setup(case: dict):
    """Mesh, the 2-D (or ZeRO) model, its loss on this data rank's part of a batch."""
    axes = {"rep": case["rep"]} if case.get("rep") else {}
    mesh = sf.Mesh({**axes, "dp": case["dp"], "tp": case["tp"]})
    fmodel = _fmodel(case)
    tp = sf.tensor_split(fmodel, mesh, "tp",
                         gpt_tp_plan() if case["kind"] == "gpt" else MLP_PLAN)
    units = GPTBlock if case["kind"] == "gpt" else MLPBlock
    if case.get("units") == "layers":  # split layers as units of their own, and a block
        units = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1"]
    remat = sf.checkpoint_policies.nothing_saveable if case["remat"] else None
    model = tp if case["zero"] else sf.shard_params(
        tp, mesh, "dp", units=units, remat=remat, prefetch=case.get("prefetch", 1),
        reshard_after_forward=case.get("reshard", True),
        replicate_axis="rep" if case.get("rep") else None)
    rank = mesh.index(_data_axes(case))

    def local(batch):
        return tuple(t.chunk(_n_data(case))[rank] for t in batch)

    def loss_fn(params, x, y):
        out = model.apply(params, x)
        if case["kind"] == "gpt":  # vocab-split logits
            return sf.vocab_parallel_cross_entropy(out, y, "tp", mesh=mesh)
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    return mesh, tp, model, local, loss_fn


def _grads_on_rank(case: dict):
    mesh, tp, model, local, loss_fn = _setup(case)
    shards = model.init(case["seed"])
    x, y = local(_batch(case, 0))
    grads, loss = torch.func.grad_and_value(loss_fn)(shards, x, y)
    leaves = {n: t.detach().requires_grad_() for n, t in shards.items()}
    loss_fn(leaves, x, y).backward()
    autograd = {n: t.grad for n, t in leaves.items()}
    # two micro-batches (one if the local batch is 1), one reduce-scatter per unit
    accumulated, _ = model.accumulate_grads(lambda p, batch: loss_fn(p, *batch),
                                            2 - x.shape[0] % 2)(shards, (x, y))
    ln = "ln_f.weight" if case["kind"] == "gpt" else "blocks.0.ln.weight"
    return (sf.pmean(loss.detach(), _data_axes(case), mesh=mesh), model.gather_params(shards),
            model.gather_params(grads), model.gather_params(autograd),
            model.gather_params(accumulated),
            sf.all_gather(sf.gather(grads[ln], model.dp_specs[ln], mesh)[None], "tp", dim=0,
                          mesh=mesh))


def _train_on_rank(case: dict):
    mesh, tp, model, local, loss_fn = _setup(case)
    if case["zero"]:  # ZeRO-1/2 over dp of the TP shards: clip told the TP layout
        inner = sf.optim.chain(sf.optim.clip_by_global_norm(CLIP, tp.specs, mesh),
                               sf.optim.adamw(LR, eps=EPS, weight_decay=0.1))
        opt = sf.shard_opt_state(inner, mesh, "dp", shard_grads=case["zero"] == "zero2")
        params, gather_fn = tp.init(case["seed"]), tp.gather_params
    else:
        opt = sf.optim.chain(sf.optim.clip_by_global_norm(CLIP, model.specs, mesh),
                             sf.optim.adamw(LR, eps=EPS, weight_decay=0.1))
        params, gather_fn = model.init(case["seed"]), model.gather_params
    state = opt.init(params)
    history = []
    for step in range(STEPS):
        batch = local(_batch(case, step))
        if case["zero"] == "zero2":  # autograd, reduce-scatters overlapped, .grad freed
            params = {n: t.detach().requires_grad_() for n, t in params.items()}
            with opt.overlap(params) as sync:
                loss = loss_fn(params, *batch)
                loss.backward()
            grads, params = sync.grads(), {n: t.detach() for n, t in params.items()}
        else:
            grads, loss = torch.func.grad_and_value(loss_fn)(params, *batch)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        history.append((sf.pmean(loss.detach(), _data_axes(case), mesh=mesh),
                        gather_fn(params)))
    return history


def _reference_train(case: dict):
    fmodel = _fmodel(case)
    params = fmodel.init(case["seed"])
    opt = sf.optim.chain(sf.optim.clip_by_global_norm(CLIP),
                         sf.optim.adamw(LR, eps=EPS, weight_decay=0.1))
    state, history, norms = opt.init(params), [], []
    for step in range(STEPS):
        grads, loss = torch.func.grad_and_value(
            lambda p, x, y: _full_loss(case, fmodel, p, x, y))(params, *_batch(case, step))
        norms.append(float(sf.optim.global_norm(grads)))
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        history.append((loss, params))
    assert min(norms) > CLIP, norms  # clipping is active: a wrong global norm changes updates
    return history


def _check_training(case: dict, worlds) -> None:
    expected = _reference_train(case)
    for history in worlds(_n_data(case) * case["tp"]).run(_train_on_rank, case):
        for (loss, params), (want_loss, want) in zip(history, expected, strict=True):
            assert_close(loss, want_loss)
            assert_close(params, want)


def _check_grads(case: dict, worlds) -> None:
    fmodel = _fmodel(case)
    params = fmodel.init(case["seed"])
    x, y = _batch(case, 0)
    grads, loss = torch.func.grad_and_value(
        lambda p: _full_loss(case, fmodel, p, x, y))(params)
    ln = "ln_f.weight" if case["kind"] == "gpt" else "blocks.0.ln.weight"
    for got_loss, full, got, got_autograd, got_accumulated, ln_per_tp in worlds(
            _n_data(case) * case["tp"]).run(_grads_on_rank, case):
        assert_close(got_loss, loss)
        assert_close(full, params)
        assert_close(got, grads)  # the tied tok/head weight and the fused qkv included
        assert_close(got_autograd, grads)
        assert_close(got_accumulated, grads)
        for replica in ln_per_tp:  # replicated over tp: equal on every tp rank, counted once
            torch.testing.assert_close(replica, ln_per_tp[0], rtol=0, atol=0)
            assert_close(replica, grads[ln])


# ---------------------------------------------------------------- the tests


def test_gpt_forward_loss_and_grads_equal_unsplit(worlds):
    _check_grads(_gpt_case(), worlds)


def test_gpt_5_adamw_steps_with_clipping_equal_single_process(worlds):
    _check_training(_gpt_case(), worlds)


def test_hsdp_x_tp_on_a_3d_mesh_equals_single_process(worlds):
    # {"rep": 2, "dp": 1, "tp": 2}: gradients averaged over rep and dp, never over tp
    case = {"kind": "mlp", "rep": 2, "dp": 1, "tp": 2, "d": 5, "hidden": 6, "seq": 2,
            "per_rank": 2, "seed": 7, "remat": False, "zero": False}
    _check_grads(case, worlds)
    _check_training(case, worlds)


@pytest.mark.parametrize("zero", ["zero1", "zero2"])
def test_gpt_zero_over_dp_of_tp_shards_equals_single_process(worlds, zero):
    _check_training(_gpt_case(zero=zero, seed=5), worlds)


MESHES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]


@settings(max_examples=4, deadline=None)
@given(mesh=st.sampled_from(MESHES), width=st.integers(1, 2), per_rank=st.integers(1, 2),
       seq=st.integers(1, 4), remat=st.booleans(), reshard=st.booleans(),
       prefetch=st.integers(0, 2), units=st.sampled_from(["class", "layers"]),
       seed=st.integers(0, 2**16))
def test_mlp_fsdp_tp_training_equals_single_process(worlds, mesh, width, per_rank, seq,
                                                    remat, reshard, prefetch, units, seed):
    dp, tp = mesh
    # uneven dp shards: the TP-local rows (hidden / tp and d) need not divide by dp
    case = {"kind": "mlp", "dp": dp, "tp": tp, "d": 3 + 2 * width, "hidden": tp * (2 + width),
            "seq": seq, "per_rank": per_rank, "seed": seed, "remat": remat, "zero": False,
            "reshard": reshard, "prefetch": prefetch, "units": units}
    _check_grads(case, worlds)
    _check_training(case, worlds)


# ---------------------------------------------------------------- communication


def _comm_on_rank(case: dict):
    mesh, tp, model, local, loss_fn = _setup(case)
    shards = model.init(case["seed"])
    x, y = local(_batch(case, 0))
    torch.func.grad(loss_fn)(shards, x, y)  # warm-up: the prefetch order
    sf.reset_comm_stats()
    torch.func.grad(loss_fn)(shards, x, y)
    stats = sf.comm_stats()
    return stats.by_op, {n: tuple(t.shape) for n, t in tp.init(0).items()}


def test_comm_per_step_is_fsdp_over_dp_plus_megatron_over_tp(worlds):
    case = {"kind": "mlp", "dp": 2, "tp": 2, "d": 5, "hidden": 6, "seq": 3, "per_rank": 2,
            "seed": 0, "remat": False, "zero": False}
    dp, tp = case["dp"], case["tp"]
    activation = case["per_rank"] * case["seq"] * case["d"] * 4  # one dp rank's batch
    for by_op, tp_shapes in worlds(4).run(_comm_on_rank, case):
        # dp: each TP shard gathered in forward and again in backward, reduce-scattered once
        padded = sum(-(-s[0] // dp) * math.prod(s[1:]) * 4 for s in tp_shapes.values())
        assert by_op[("dp", "all_gather")] == 2 * padded * (dp - 1)
        assert by_op[("dp", "psum_scatter")] == padded * (dp - 1)
        # tp: per block one all-reduce of the activations forward (fc2's output) and one
        # backward (fc1's input gradient); nothing else crosses tp
        assert by_op[("tp", "psum")] == pytest.approx(2 * 2 * 2 * activation * (tp - 1) / tp)
        assert {axis for axis, _ in by_op} == {"dp", "tp"}


# ---------------------------------------------------------------- layouts and norms


def _layout_on_rank(case: dict):
    mesh, tp, model, _, _ = _setup(case)
    shards = model.init(case["seed"])
    grads = {n: torch.full_like(t, 1.0) for n, t in shards.items()}  # padding included
    specs = model.specs
    norm = sf.optim.global_norm(grads, specs, mesh)
    gathered = sf.gather(shards, specs, mesh)  # issue 22: FsdpTpLayout (fused qkv too)
    resharded = all(torch.equal(t, shards[n]) for n, t in sf.shard(gathered, specs, mesh).items())
    axes = {n: specs[n].sharded_axes for n in ("blocks.0.attn.qkv.weight",
                                              "blocks.0.mlp.fc2.weight", "ln_f.weight")}
    tokens = torch.arange(8).reshape(1, 8) % case["vocab"]
    same_in_eval = torch.equal(model.eval().apply(shards, tokens), model.apply(shards, tokens))
    numel = sum(t.numel() for t in shards.values())
    return norm, (gathered, resharded), axes, {n: tuple(t.shape) for n, t in shards.items()}, \
        numel, same_in_eval


def test_specs_describe_both_splits_and_the_global_norm_counts_each_element_once(worlds):
    case = _gpt_case()
    fmodel = _fmodel(case)
    full = fmodel.init(case["seed"])
    tp_split = {n for n in full if ".attn." in n or ".mlp.fc" in n or n == "tok.weight"} - {
        "blocks.0.attn.proj.bias", "blocks.1.attn.proj.bias", "blocks.0.mlp.fc2.bias",
        "blocks.1.mlp.fc2.bias"}
    # memory per rank: (Psi_split / tp + Psi_replicated) / dp (no padding here)
    per_rank = sum(t.numel() // (2 if n in tp_split else 1) for n, t in full.items()) // 2
    for norm, (gathered, resharded), axes, shapes, numel, same_in_eval in worlds(4).run(
            _layout_on_rank, case):
        assert numel == per_rank
        assert same_in_eval
        # every split here is even (no padding): a gradient of ones has norm**2 = the number
        # of elements, unless a tp-split or a replicated-over-tp leaf were miscounted
        ones = {n: torch.ones_like(t) for n, t in full.items()}
        assert_close(norm, sf.optim.global_norm(ones))
        assert_close(gathered, full)  # sf.gather and sf.shard take FsdpTpLayout (issue 22)
        assert resharded
        assert axes == {"blocks.0.attn.qkv.weight": ("tp", "dp"),
                        "blocks.0.mlp.fc2.weight": ("tp", "dp"), "ln_f.weight": ("dp",)}
        assert shapes["blocks.0.attn.qkv.weight"] == (3 * 16 // 2 // 2, 16)
        assert shapes["blocks.0.mlp.fc2.weight"] == (8, 64 // 2)


def test_global_norm_refuses_a_spec_that_does_not_name_its_axes():
    with pytest.raises(ValueError, match="cannot tell over which mesh axes leaf 'w'"):
        sf.optim.global_norm({"w": torch.ones(2)}, {"w": "tp"})


# ---------------------------------------------------------------- bad input


def _bad_on_rank():
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    tp = sf.tensor_split(sf.functional(MLP(4, 8)), mesh, "tp", MLP_PLAN)
    errors = {}
    for label, call in {
        "same axis": lambda: sf.shard_params(tp, mesh, "tp"),
        "tuple with tp": lambda: sf.shard_params(tp, mesh, ("dp", "tp")),
        "unknown axis": lambda: sf.shard_params(tp, mesh, "data"),
        "replicate tp": lambda: sf.shard_params(tp, mesh, "dp", replicate_axis="tp"),
        "other mesh": lambda: sf.shard_params(tp, sf.Mesh({"dp": 4}), "dp"),
        "no unit": lambda: sf.shard_params(tp, mesh, "dp", units=["blocks.7"]),
    }.items():
        try:
            call()
            errors[label] = None
        except (ValueError, TypeError) as error:
            errors[label] = str(error)
    return errors


def test_bad_input_is_refused_clearly(worlds):
    for errors in worlds(4).run(_bad_on_rank):
        assert "'tp', the axis the model is tensor-split over" in errors["same axis"]
        assert "includes 'tp'" in errors["tuple with tp"]
        assert "'data' is not an axis of the mesh" in errors["unknown axis"]
        assert "replicate_axis 'tp'" in errors["replicate tp"]
        assert "not the mesh the model was tensor_split over" in errors["other mesh"]
        assert "'blocks.7'" in errors["no unit"]


def _dropout_losses_on_rank():
    """FSDP x TP GPT with dropout (replicated and split regions): loss twice from one seed."""
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    config = GPTConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=4, seq_len=8,
                       dropout=0.3)
    tp = sf.tensor_split(sf.functional(GPT(config)), mesh, "tp", gpt_tp_plan())
    model = sf.shard_params(tp, mesh, "dp", units=GPTBlock)
    shards = model.init(0)
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss():
        logits = model.apply(shards, tokens)
        return float(sf.vocab_parallel_cross_entropy(logits.flatten(0, 1),
                                                      tokens.roll(-1, 1).flatten(), "tp",
                                                      mesh=mesh))

    torch.manual_seed(5)
    first = loss()
    torch.manual_seed(5)
    again = loss()
    third = loss()
    return first, again, third


def test_dropout_in_split_regions_runs_under_fsdp_x_tp(worlds):
    """Split-region dropout (attn.core's SplitRNG) gets its per-rank stream inside
    FsdpTpModel.apply too: the loss is reproducible from the seed, equal across the ranks
    (the same batch everywhere), and the next draw differs."""
    results = worlds(4).run(_dropout_losses_on_rank)
    first, again, third = results[0]
    assert first == again and third != first
    assert all(r == results[0] for r in results)
