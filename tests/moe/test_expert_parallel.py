"""Expert parallelism equals the unsplit MoE layer: property tests over experts (2-8), top-k
(1, 2), capacity (dropless, 1.0, 1.25), ep sizes 1-4, uneven token counts per rank and
skewed routing, under torch.func.grad, vjp and autograd; the model protocol's conformance
suite; the all-to-all volumes against the formula; per-rank expert memory; errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn.models.moe import MoE, dispatch_order
from shardfn.models.moe_router import route
from shardfn.transforms.experts import expert_parallel
from tests.moe import _moe_cases as cases
from tests.moe._moe_cases import Case


@st.composite
def _cases(draw) -> Case:
    ep = draw(st.sampled_from([2, 4, 3, 1]))  # distributed sizes first (shrinks to 2)
    experts = ep * draw(st.integers(max(1, -(-2 // ep)), 8 // ep))  # 2..8, divisible by ep
    return Case(experts, draw(st.sampled_from([1, 2])), draw(st.sampled_from([None, 1.0, 1.25])),
                tuple(draw(st.lists(st.integers(0, 12), min_size=ep, max_size=ep))),
                draw(st.sampled_from([0.0, 3.0])), draw(st.integers(0, 1000)))


def _run(worlds, case: Case, mode: str):
    ep = len(case.tokens)
    return worlds(ep).run(cases.on_rank, case, mode) if ep > 1 else [cases.on_rank(case, mode)]


@settings(max_examples=12, deadline=None)
@given(case=_cases(), mode=st.sampled_from(["grad", "vjp", "autograd"]))
@example(case=Case(4, 2, 1.25, (9, 3), 3.0, 1), mode="grad")  # skewed: tokens dropped
@example(case=Case(8, 2, None, (12, 0, 5, 7), 3.0, 2), mode="autograd")  # a rank with none
@example(case=Case(6, 1, 1.0, (4, 11, 6), 3.0, 3), mode="vjp")
@example(case=Case(2, 2, 1.0, (7, 7), 3.0, 4), mode="vjp")
def test_expert_parallel_equals_one_process(worlds, case, mode):
    """Each rank's output and losses are the unsplit layer's on its tokens; the gathered
    gradients are those of the mean of every rank's loss, each input's that of its rank's loss;
    each rank holds E/ep experts."""
    outs, grads = cases.reference(case)
    ep = len(case.tokens)
    for rank, (out, aux, gathered, _, local) in enumerate(_run(worlds, case, mode)):
        torch.testing.assert_close(out, outs[rank][0])
        torch.testing.assert_close(tuple(aux), tuple(outs[rank][1]))
        torch.testing.assert_close(gathered[0], grads[0])
        # the input's gradient is that of this rank's own loss, as under DDP: ep x the mean's
        torch.testing.assert_close(gathered[1], ep * grads[1][rank])
        for name, shape in local.items():
            assert shape[0] == case.experts // ep, (name, shape)


def _rows_between(case: Case) -> tuple[list[int], list[int]]:
    """Per rank: rows sent to other ranks and rows received from them, from the routing."""
    fm = cases.model(case)
    gate = cases.params(case, fm)["gate.weight"]
    ep, local = len(case.tokens), case.experts // len(case.tokens)
    to = torch.zeros(ep, ep, dtype=torch.long)  # to[src, dst]
    for rank in range(ep):
        routing = route(cases.tokens(case, rank) @ gate.t(), case.top_k, case.capacity_factor)
        for e, count in enumerate(dispatch_order(routing)[2]):
            to[rank, e // local] += count
    off = to * (1 - torch.eye(ep, dtype=torch.long))
    return off.sum(1).tolist(), off.sum(0).tolist()


def test_all_to_all_bytes_match_the_formula(worlds):
    """Per step and rank: the counts (8 E (ep-1)/ep bytes), the rows sent to other ranks R
    and received from them R' (4 H bytes each), each way in forward and again in backward:
    2 (R + R') 4 H; and the router's gradient psum 2 B (ep-1)/ep."""
    case = Case(experts=4, top_k=2, capacity_factor=None, tokens=(9, 4), skew=3.0, seed=2)
    sent, received = _rows_between(case)
    assert sent != received  # uneven traffic
    for rank, (*_, stats, _) in enumerate(worlds(2).run(cases.on_rank, case, "autograd")):
        assert stats[("ep", "all_to_all")] == 8 * 4 // 2
        assert stats[("ep", "all_to_all_v")] == 2 * (sent[rank] + received[rank]) * 4 * cases.DIM
        assert stats[("ep", "psum")] == 2 * 4 * case.experts * cases.DIM // 2


class _Stack(torch.nn.Module):
    """Two MoE layers with residuals between linear layers, and a LayerNorm: nested names,
    more than one layer, inputs that need a gradient."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = torch.nn.Linear(6, 6), torch.nn.LayerNorm(6), \
            torch.nn.Linear(6, 3)
        self.blocks = torch.nn.ModuleList([MoE(6, 8, num_experts=4, top_k=2),
                                           MoE(6, 8, num_experts=4, top_k=1,
                                               capacity_factor=1.0, normalize=False)])

    def forward(self, x):
        h, aux = self.inp(x), 0.0
        for block in self.blocks:
            y, a = block(self.norm(h))
            h, aux = h + y, aux + a.loss
        return self.out(h), aux


def _conforms(stack: bool):
    import torch.distributed as dist

    torch.manual_seed(0)
    fm = sf.functional(_Stack() if stack else MoE(6, 8, num_experts=4, top_k=2,
                                                   capacity_factor=1.25, z_loss_coef=0.1))
    model = expert_parallel(fm, sf.Mesh({"ep": dist.get_world_size()}), "ep")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 3 if stack else 6, generator=g)
    def loss_fn(out, t):
        return (out[0] - t).square().mean() + getattr(out[1], "loss", out[1])

    report = sf.testing.check_model(model, (x,), loss_fn=loss_fn, targets=y)
    return report.checked


@pytest.mark.parametrize("ep,stack", [(2, False), (4, False), (2, True)])
def test_model_protocol_conformance(worlds, ep, stack):
    """The conformance suite (members, init, leaves, apply, train/eval, gathered gradients
    against the unsplit model) on one layer, and on two layers in a small network."""
    for checked in worlds(ep).run(_conforms, stack):
        assert {"members", "init", "gather", "apply", "grads"} <= set(checked)


def test_errors_name_what_is_wrong():
    fm = sf.functional(MoE(4, 8, num_experts=3))
    mesh = sf.Mesh({"ep": 1})
    with pytest.raises(ValueError, match="axis 'dp' is not an axis"):
        expert_parallel(fm, mesh, "dp")
    with pytest.raises(ValueError, match="holds no shardfn.models.MoE layer"):
        expert_parallel(sf.functional(torch.nn.Linear(2, 2)), mesh, "ep")
    with pytest.raises(TypeError, match="takes a FunctionalModel"):
        expert_parallel(expert_parallel(fm, mesh, "ep"), mesh, "ep")
    ep = expert_parallel(fm, mesh, "ep")
    leaves = ep.init(0)
    leaves["experts.down_proj"] = leaves["experts.down_proj"][:2]
    with pytest.raises(ValueError, match=r"leaf 'experts.down_proj' has shape \(2, 4, 8\)"):
        ep.apply(leaves, torch.randn(3, 4))


def _indivisible():
    fm = sf.functional(MoE(4, 8, num_experts=3))
    expert_parallel(fm, sf.Mesh({"ep": 2}), "ep")


def test_experts_must_divide_by_ep(worlds):
    with pytest.raises(sf.testing.RankError, match="E=3 experts, not divisible by ep=2"):
        worlds(2).run(_indivisible)


def _in_check_mode(router_differs: bool):
    import torch.distributed as dist

    case = Case(experts=4, top_k=2, capacity_factor=1.0, tokens=(9, 4), skew=3.0, seed=2)
    fm = cases.model(case)
    ep = expert_parallel(fm, sf.Mesh({"ep": 2}), "ep")
    leaves = ep.shard(cases.params(case, fm))
    if router_differs:  # a replicated leaf that is not the same on every rank
        leaves["gate.weight"] = leaves["gate.weight"] + dist.get_rank()
    x = cases.tokens(case, dist.get_rank())
    sf.check_consistency(True)
    try:
        return ep.gather(torch.func.grad(lambda t: cases.loss(ep, t, x))(leaves))
    finally:
        sf.check_consistency(False)


def test_check_mode(worlds):
    """Check mode passes a correct step, and names a router that differs across ranks."""
    case = Case(experts=4, top_k=2, capacity_factor=1.0, tokens=(9, 4), skew=3.0, seed=2)
    _, (reference, _) = cases.reference(case)
    for gathered in worlds(2).run(_in_check_mode, False):
        torch.testing.assert_close(gathered, reference)
    with pytest.raises(sf.testing.RankError, match="pvary"):
        worlds(2).run(_in_check_mode, True)


def _without_regrouping(case: Case):
    """A mutant dispatch: rows computed in arrival order (by source rank), not regrouped by
    local expert."""
    from shardfn.models import moe_dispatch

    saved = moe_dispatch.expert_major_order
    moe_dispatch.expert_major_order = lambda received: torch.arange(int(received.sum()))
    try:
        return cases.on_rank(case, "grad")
    finally:
        moe_dispatch.expert_major_order = saved


def test_the_property_catches_a_wrong_dispatch(worlds):
    """The comparison above can fail: without the regrouping by expert the outputs differ."""
    case = Case(experts=4, top_k=2, capacity_factor=None, tokens=(9, 4), skew=0.0, seed=2)
    outs, _ = cases.reference(case)
    results = worlds(2).run(_without_regrouping, case)
    assert any(not torch.allclose(out, outs[rank][0]) for rank, (out, *_) in enumerate(results))
