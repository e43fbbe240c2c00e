"""Expert parallelism composed: with data parallelism on a {"dp": 2, "ep": 2} mesh (every
rank sees its own tokens; expert gradients reduced over the ranks holding the same experts,
the others over all four), checkpoints saved at ep=2 and loaded at ep=1 and ep=4, and
FairScale's rank-local experts inside a parameter-sharded model (no expert byte moved but
the tokens')."""

from __future__ import annotations

import math

import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.transforms.experts import expert_parallel
from tests.moe import _moe_cases as cases
from tests.moe._moe_cases import Case

CASE = Case(experts=4, top_k=2, capacity_factor=1.25, tokens=(5, 9, 3, 7), skew=3.0, seed=4)
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def _dp_ep_step(dp_mean: bool):
    """This rank's gathered gradients after ``sf.data_parallel`` over "dp" of the ep model's
    (``dp_mean=False``: the dp reduction left out, a mutant the test must catch)."""
    import torch.distributed as dist

    mesh = sf.Mesh({"dp": 2, "ep": 2})
    fm = cases.model(CASE)
    ep = expert_parallel(fm, mesh, "ep")
    leaves = ep.shard(cases.params(CASE, fm))
    x = cases.tokens(CASE, dist.get_rank())
    grads = torch.func.grad(lambda t: cases.loss(ep, t, x))(leaves)
    if dp_mean:
        grads = sf.data_parallel(mesh, "dp").reduce_grads(grads)
    return ep.gather(grads)


@pytest.mark.parametrize("dp_mean", [True, False])
def test_expert_and_data_parallel(worlds, dp_mean):
    """Gradients equal the unsplit model's of the mean of the four ranks' losses; without
    the dp reduction they are not (so the comparison can fail)."""
    _, (reference, _) = cases.reference(CASE)
    results = worlds(4).run(_dp_ep_step, dp_mean)
    if dp_mean:
        for gathered in results:
            torch.testing.assert_close(gathered, reference)
    else:
        assert not torch.allclose(results[0]["gate.weight"], reference["gate.weight"])


def _state(ep_size: int, zero: bool):
    """``(state, layouts, mesh)``: params and AdamW moments of the ep model over ``ep_size``."""
    mesh = sf.Mesh({"ep": ep_size})
    fm = cases.model(CASE)
    model = expert_parallel(fm, mesh, "ep")
    full = cases.params(CASE, fm)
    if zero:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    params = model.shard(full)
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)
    state = state._replace(mu={k: 2 * v + 1 for k, v in params.items()})
    return {"params": params, "opt": state}, {"params": model, "opt": opt}, mesh


def _save(path: str):
    state, layouts, mesh = _state(2, zero=False)
    return ck.save(path, state, mesh, layouts)


def _load(path: str, ep_size: int):
    like, layouts, mesh = _state(ep_size, zero=True)
    out = ck.load(path, like, mesh, layouts)
    model = layouts["params"]
    return model.gather(out["params"]), model.gather(out["opt"].mu)


@pytest.mark.parametrize("ep_size", [1, 4])
def test_checkpoint_reshards_experts(worlds, tmp_path, ep_size):
    """Saved with the experts split over 2 ranks, loaded with them on 1 or split over 4:
    the gathered parameters and moments are the saved ones."""
    path = str(tmp_path / "ckpt")
    worlds(2).run(_save, path)
    loaded = worlds(ep_size).run(_load, path, ep_size)[0] if ep_size > 1 else _load(path, 1)
    full = cases.params(CASE, cases.model(CASE))
    torch.testing.assert_close(loaded[0], full)
    torch.testing.assert_close(loaded[1], {k: 2 * v + 1 for k, v in full.items()})


def _rank_local_experts_in_a_sharded_model(case: Case, shape: dict, axis):
    """This rank's ``(gathered grads, local leaves, comm bytes of the step by (axis, op))``
    with the ep model sharded by shard_params over axes holding "ep"."""
    import torch.distributed as dist

    mesh = sf.Mesh(shape)
    fm = cases.model(case)
    model = sf.shard_params(expert_parallel(fm, mesh, "ep"), mesh, axis)
    leaves = model.shard(cases.params(case, fm))
    x = cases.tokens(case, dist.get_rank())
    sf.reset_comm_stats()
    grads = torch.func.grad(lambda t: cases.loss(model, t, x))(leaves)
    comm = sf.comm_stats().by_op
    return model.gather(grads), leaves, comm


@pytest.mark.parametrize("shape, axis", [({"ep": 2}, "ep"), ({"dp": 2, "ep": 2}, ("dp", "ep"))])
def test_rank_local_experts_inside_a_sharded_model(worlds, shape, axis):
    """FairScale's MoE property: experts stay rank-local (a rank stores exactly its block of
    E/ep experts, replicated over "dp") while the other parameters are sharded (ZeRO-3)
    over the same ranks; no expert byte is gathered or scattered: the step's all-gathers
    (forward and backward) and reduce-scatter over the sharding axes carry the router only,
    and the expert gradients are psummed over "dp" alone; gradients equal the unsplit
    model's."""
    n, ep = math.prod(shape.values()), shape["ep"]
    case = CASE._replace(tokens=(7,) * n)  # shard_params (check mode): equal batches
    _, (reference, _) = cases.reference(case)
    full = cases.params(case, cases.model(case))
    key = "+".join(axis) if isinstance(axis, tuple) else axis
    router = -(-full["gate.weight"].shape[0] // n) * full["gate.weight"].shape[1] * 4 * (n - 1)
    experts = sum(full[k].numel() // ep * 4 for k in EXPERTS)  # a rank's expert bytes
    for rank, (gathered, leaves, comm) in enumerate(worlds(n).run(
            _rank_local_experts_in_a_sharded_model, case, shape, axis)):
        torch.testing.assert_close(gathered, reference)
        for name in EXPERTS:
            torch.testing.assert_close(leaves[name], full[name].chunk(ep)[rank % ep])
        torch.testing.assert_close(leaves["gate.weight"], full["gate.weight"].chunk(n)[rank])
        assert comm[(key, "all_gather")] == 2 * router and comm[(key, "psum_scatter")] == router
        assert comm.get(("dp", "psum"), 0) == (experts if "dp" in shape else 0)
        assert set(comm) <= {(key, "all_gather"), (key, "psum_scatter"), ("dp", "psum"),
                             ("ep", "all_to_all"), ("ep", "all_to_all_v")}  # nothing else
