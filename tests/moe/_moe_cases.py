"""What the expert-parallel tests share: the layer, each rank's tokens, the loss, and the
unsplit reference (every rank's loss averaged, computed on one process)."""

from __future__ import annotations

from typing import NamedTuple

import torch

import shardfn as sf
from shardfn.models.moe import MoE
from shardfn.transforms.experts import expert_parallel

DIM, HIDDEN = 6, 10


class Case(NamedTuple):
    """One drawn configuration."""

    experts: int
    top_k: int
    capacity_factor: float | None
    tokens: tuple[int, ...]  # tokens on each rank (uneven)
    skew: float  # added to expert 0's router row: skewed routing, uneven counts
    seed: int


def model(case: Case) -> sf.FunctionalModel:
    torch.manual_seed(0)
    return sf.functional(MoE(DIM, HIDDEN, case.experts, case.top_k,
                             capacity_factor=case.capacity_factor, z_loss_coef=0.01))


def params(case: Case, fm: sf.FunctionalModel) -> dict[str, torch.Tensor]:
    """The full init, with the router biased towards expert 0 by ``skew``."""
    full = fm.init(case.seed)
    full["gate.weight"] = full["gate.weight"].clone()
    full["gate.weight"][0] += case.skew
    return full


def tokens(case: Case, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed * 7 + rank)
    return torch.randn(case.tokens[rank], DIM, generator=g) + 0.5


def loss(model, leaves, x: torch.Tensor) -> torch.Tensor:
    out, aux = model.apply(leaves, x)
    return out.square().sum() / 10 + aux.loss


def reference(case: Case):
    """Per rank ``(output, aux)`` of the unsplit layer on that rank's tokens, and the
    gradients (parameters, and each rank's tokens) of the mean over ranks of their losses."""
    fm = model(case)
    full = params(case, fm)
    xs = [tokens(case, r) for r in range(len(case.tokens))]
    outs = [fm.apply(full, x) for x in xs]
    grads = torch.func.grad(
        lambda t, xs: sum(loss(fm, t, x) for x in xs) / len(xs), argnums=(0, 1))(full, xs)
    return outs, grads


def on_rank(case: Case, mode: str):
    """This rank's ``(output, aux, (gathered gradients, input gradient), comm stats, local
    expert shapes)`` under expert parallelism
    over all ranks; ``mode``: "grad" (torch.func.grad), "vjp" or "autograd"."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = sf.Mesh({"ep": len(case.tokens)})
    fm = model(case)
    ep = expert_parallel(fm, mesh, "ep")
    leaves = ep.shard(params(case, fm))
    x = tokens(case, rank)
    sf.reset_comm_stats()
    out, aux = ep.apply(leaves, x)
    if mode == "grad":
        grads = torch.func.grad(lambda t, x: loss(ep, t, x), argnums=(0, 1))(leaves, x)
    elif mode == "vjp":
        _, pull = torch.func.vjp(lambda t, x: loss(ep, t, x), leaves, x)
        grads = pull(torch.tensor(1.0))
    else:
        live = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        x.requires_grad_()
        sf.reset_comm_stats()
        loss(ep, live, x).backward()
        grads = ({k: v.grad for k, v in live.items()}, x.grad)
    stats = sf.comm_stats().by_op
    local_experts = {k: tuple(v.shape) for k, v in leaves.items() if k in ep.experts}
    return out, aux, (ep.gather(grads[0]), grads[1]), stats, local_experts
