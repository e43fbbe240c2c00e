"""Expert parallelism under shard_params (ZeRO-3 / FSDP x EP): a property test over dp and
ep sizes (1, 2), experts (2, 4), top-k (1, 2), remat / resharding / "sum", and the sharding
axes ("dp": experts split over ep then over dp; "ep" with HSDP over "dp", both, or "dp"
replicated over "ep": each rank's E/ep experts held whole, the other leaves sharded)
against one process; a mutant without the ep reduction is caught; the model
protocol's conformance suite with one unit per MoE layer; checkpoints saved under
{"dp": 2, "ep": 2} load into plain expert parallelism and into one process; errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.models.moe import MoE
from shardfn.transforms._fsdp_ep import FsdpEpLayout, FsdpEpModel
from shardfn.transforms.experts import expert_parallel
from tests.moe import _moe_cases as cases
from tests.moe._moe_cases import Case
from tests.moe.test_expert_parallel import _Stack


def _sharded(case: Case, dp: int, ep: int, over, **options):
    """``(model, mesh, fm)``: the case's layer, expert_parallel over "ep", then shard_params."""
    mesh = sf.Mesh({"dp": dp, "ep": ep})
    fm = cases.model(case)
    return sf.shard_params(expert_parallel(fm, mesh, "ep"), mesh, over, **options), mesh, fm


def _on_rank(case: Case, dp: int, ep: int, over, options=None, mode: str = "grad",
             enter_ep: bool = True):
    """This rank's ``(output, aux, grads by model.gather, by sf.gather, init == shard,
    global norm of the grads over model.specs, rows of its expert leaves)``;
    ``mode``: "grad" (torch.func.grad) or "autograd"; ``enter_ep=False``: the mutant that
    skips the ep reduction (ShardedModel.apply direct)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    model, mesh, fm = _sharded(case, dp, ep, over, **(options or {}))
    leaves = model.shard(cases.params(case, fm))
    x = cases.tokens(case, rank)
    out, aux = model.apply(leaves, x)
    apply = SimpleNamespace(apply=model.apply if enter_ep else model.sharded.apply)
    if mode == "grad":
        grads = torch.func.grad(lambda t: cases.loss(apply, t, x))(leaves)
    else:
        live = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        cases.loss(apply, live, x).backward()
        grads = {k: v.grad for k, v in live.items()}
    inits = model.init(case.seed), model.shard(fm.init(case.seed))
    same_init = all(torch.equal(inits[0][k], inits[1][k]) for k in inits[0])
    norm = sf.optim.global_norm(grads, model.specs, mesh)
    rows = {leaves[k].shape[0] for k in model.experts}
    return (out, aux, model.gather(grads), sf.gather(grads, model.specs, mesh), same_init, norm,
            rows)


def _run(worlds, case: Case, dp: int, ep: int, over, options=None, mode="grad",
         enter_ep: bool = True):
    args = (case, dp, ep, over, options, mode, enter_ep)
    return [_on_rank(*args)] if dp * ep == 1 else worlds(dp * ep).run(_on_rank, *args)


OPTIONS = [{}, {"remat": sf.checkpoint_policies.nothing_saveable},
           {"reshard_after_forward": False, "grad_reduce": "sum"}]
LAYOUTS = [("dp", None), ("ep", "dp"), (("dp", "ep"), None), ("dp", "ep")]


@st.composite
def _setups(draw):
    dp, ep = draw(st.sampled_from([2, 1])), draw(st.sampled_from([2, 1]))
    # (axis, replicate_axis): experts split over ep then dp; or the unsplit leaves sharded
    # over the axis holding ep (HSDP over dp), over both, or over dp replicated over ep
    over, replicate = draw(st.sampled_from(LAYOUTS))
    experts, top_k = draw(st.sampled_from([4, 2])), draw(st.sampled_from([2, 1]))
    # shard_params' check mode wants equal batches over its axes: with over="dp" the ep
    # ranks (rank = dp index * ep + ep index) may differ, else every rank has one count
    counts = draw(st.lists(st.integers(1, 9), min_size=ep, max_size=ep))
    varied = (over, replicate) == ("dp", None)
    tokens = tuple(counts[r % ep] if varied else counts[0] for r in range(dp * ep))
    case = Case(experts, top_k, draw(st.sampled_from([None, 1.25])), tokens,
                draw(st.sampled_from([0.0, 3.0])), draw(st.integers(0, 100)))
    options = draw(st.sampled_from(OPTIONS))
    if replicate:
        options = {**options, "replicate_axis": replicate}
    return case, dp, ep, over, options, draw(st.sampled_from(["grad", "autograd"]))


@settings(max_examples=6, deadline=None)
@given(setup=_setups())
@example(setup=(Case(4, 2, None, (5, 9, 5, 9), 3.0, 1), 2, 2, "dp", OPTIONS[1], "autograd"))
@example(setup=(Case(2, 1, 1.25, (6, 6, 6, 6), 0.0, 2), 2, 2, "ep",
                 {**OPTIONS[2], "replicate_axis": "dp"}, "grad"))
@example(setup=(Case(2, 2, None, (5, 5, 5, 5), 3.0, 5), 2, 2, "dp", {"replicate_axis": "ep"},
                 "autograd"))
@example(setup=(Case(4, 2, None, (4, 4, 4, 4), 3.0, 3), 2, 2, ("dp", "ep"), {}, "autograd"))
@example(setup=(Case(4, 1, None, (3, 8, 3, 8), 3.0, 4), 2, 2, "dp", OPTIONS[2], "grad"))
def test_ep_under_shard_params_equals_one_process(worlds, setup):
    """Each rank's output and losses are the unsplit layer's on its tokens; the gathered
    gradients (model.gather and sf.gather with model.specs; torch.func.grad or autograd;
    remat, no resharding) are those of the mean of every rank's loss (grad_reduce="sum":
    of the sum); init is the shard of the unsplit init; the global norm over model.specs
    counts every element once; with "ep" among the sharding axes a rank holds its E/ep
    experts whole."""
    case, dp, ep, over, options, mode = setup
    outs, (grads, _) = cases.reference(case)
    if options.get("grad_reduce") == "sum":
        grads = {k: v * len(case.tokens) for k, v in grads.items()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    inside = "ep" in (over, options.get("replicate_axis")) or over == ("dp", "ep")
    for rank, (out, aux, gathered, by_specs, same_init, got_norm, rows) in enumerate(
            _run(worlds, case, dp, ep, over, options, mode)):
        torch.testing.assert_close(out, outs[rank][0])
        torch.testing.assert_close(tuple(aux), tuple(outs[rank][1]))
        torch.testing.assert_close(gathered, grads)
        torch.testing.assert_close(by_specs, grads)
        assert same_init
        torch.testing.assert_close(got_norm, norm)
        assert rows == {case.experts // ep if inside else -(-case.experts // ep // dp)}


def test_without_the_ep_reduction_is_caught(worlds):
    """The mutant (shard_params' own apply: no psum over ep of the non-expert shards, no
    1/ep) gives other gradients, so the property above can fail."""
    case = Case(4, 2, None, (5, 9), 3.0, 1)
    _, (grads, _) = cases.reference(case)
    got = _run(worlds, case, 1, 2, "dp", enter_ep=False)[0][2]
    assert not torch.allclose(got["gate.weight"], grads["gate.weight"])


def _shapes_and_specs():
    model, _, _ = _sharded(Case(4, 2, None, (3, 3, 3, 3), 0.0, 0), 2, 2, "dp")
    leaves = model.init(0)
    return ({k: tuple(v.shape) for k, v in leaves.items()},
            {k: v.sharded_axes for k, v in model.specs.items()})


def test_expert_leaves_split_over_ep_then_dp(worlds):
    """{"dp": 2, "ep": 2} sharded over "dp": a rank stores E/4 experts (their FsdpEpLayout:
    ep, then dp) and half of every other leaf."""
    shapes, axes = worlds(4).run(_shapes_and_specs)[0]
    assert shapes["experts.down_proj"] == (1, cases.DIM, cases.HIDDEN)
    assert shapes["gate.weight"] == (2, cases.DIM)
    assert axes["experts.down_proj"] == ("ep", "dp") and axes["gate.weight"] == ("dp",)


def _conforms(over):
    torch.manual_seed(0)
    mesh = sf.Mesh({"dp": 1, "ep": 2})
    model = sf.shard_params(expert_parallel(sf.functional(_Stack()), mesh, "ep"), mesh, over,
                            units=MoE)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 3, generator=g)

    def loss_fn(out, t):
        return (out[0] - t).square().mean() + out[1]

    assert isinstance(model, FsdpEpModel) and len(model.units) == 2
    return sf.testing.check_model(model, (x,), loss_fn=loss_fn, targets=y).checked


@pytest.mark.parametrize("over", ["dp", "ep"])
def test_model_protocol_conformance(worlds, over):
    """The conformance suite on two MoE layers in a small network, each layer a unit."""
    for checked in worlds(2).run(_conforms, over):
        assert {"members", "init", "gather", "apply", "grads"} <= set(checked)


CKPT = Case(4, 2, None, (3, 3, 3, 3), 3.0, 5)


def _save(path: str, over):
    model, mesh, fm = _sharded(CKPT, 2, 2, over)
    params = model.shard(cases.params(CKPT, fm))
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)._replace(mu={k: 2 * v + 1 for k, v in params.items()})
    ck.save(path, {"params": params, "opt": state}, mesh, {"params": model, "opt": opt})


def _load_ep(path: str):
    mesh = sf.Mesh({"ep": 2})
    model = expert_parallel(cases.model(CKPT), mesh, "ep")
    like = {k: torch.zeros_like(v) for k, v in model.init(0).items()}
    opt = sf.optim.adamw(1e-2)
    out = ck.load(path, {"params": like, "opt": opt.init(like)}, mesh, {"params": model,
                                                                        "opt": opt})
    return model.gather(out["params"]), model.gather(out["opt"].mu)


@pytest.mark.parametrize("over", ["dp", ("dp", "ep")])
def test_checkpoint_from_fsdp_x_ep_to_ep_and_one_process(worlds, tmp_path, over):
    """Saved under {"dp": 2, "ep": 2} (FsdpEpLayout: dp rows of the ep block; or the ep
    block whole, replicated over dp, the router over both), loaded into expert_parallel on
    {"ep": 2} and into one process: the saved values."""
    path = str(tmp_path / "fsdp_ep")
    worlds(4).run(_save, path, over)
    full = cases.params(CKPT, cases.model(CKPT))
    mu = {k: 2 * v + 1 for k, v in full.items()}
    for params, moments in worlds(2).run(_load_ep, path):
        torch.testing.assert_close(params, full)
        torch.testing.assert_close(moments, mu)
    like = {k: torch.zeros_like(v) for k, v in full.items()}
    out = ck.load(path, {"params": like, "opt": sf.optim.adamw(1e-2).init(like)})
    torch.testing.assert_close(out["params"], full)
    torch.testing.assert_close(out["opt"].mu, mu)


def test_layout_and_errors():
    """FsdpEpLayout is read as FSDP x TP's; another mesh or an unknown axis is refused."""
    case = Case(2, 1, None, (3,), 0.0, 0)
    model, mesh, fm = _sharded(case, 1, 1, "dp")
    layout = model.specs["experts.gate_up_proj"]
    assert isinstance(layout, FsdpEpLayout) and layout.ep == layout.tp
    ep = expert_parallel(fm, mesh, "ep")
    with pytest.raises(ValueError, match="not the mesh the model was expert_parallel over"):
        sf.shard_params(ep, sf.Mesh({"dp": 1}), "dp")
    with pytest.raises(ValueError, match="axis 'tp' is not an axis of the mesh"):
        sf.shard_params(ep, mesh, "tp")
