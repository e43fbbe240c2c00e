"""A mixture-of-experts feed-forward layer (Mixtral's layout), its routing and auxiliary losses.

``MoE(dim, hidden, num_experts, top_k)`` replaces a transformer's MLP: a router
(``gate``, ``Linear(dim, E, bias=False)``) sends each token to its ``top_k`` experts, each
a SwiGLU MLP, and sums their outputs weighted by the router. Its parameters are named and
shaped as Hugging Face's ``MixtralSparseMoeBlock`` (``gate.weight [E, H]``,
``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``), so a Mixtral block's
state dict loads 1:1 and, dropless with ``top_k=2``, the layer computes what that block
computes.

Routing (:mod:`shardfn.models.moe_router`): float32 softmax, top-k, weights renormalised
over the k (``normalize=True``, Mixtral) or the raw probabilities (Switch); with
``capacity_factor`` each expert takes at most ``ceil(T k / E cf)`` assignments of the
``T`` tokens of the call (GShard's order: first choices before second ones), the others
are dropped. The forward returns ``(output, MoEAux)``: the Switch/GShard load-balancing
loss (Hugging Face's ``load_balancing_loss_func`` on this call's logits), the router
z-loss, and ``loss``, their weighted sum to add to the training loss.

The experts run through the layer's ``dispatch`` (:mod:`shardfn.models.moe_dispatch`):
all here, or over an expert-parallel mesh axis once ``sf.expert_parallel`` installed its
dispatch on a copy of the model. Each call routes its own tokens (under expert
parallelism: each rank's), so outputs and losses are those of the unsplit layer on that
rank's batch.

Example:
    >>> moe = MoE(dim=8, hidden=16, num_experts=4, top_k=2)
    >>> out, aux = moe(torch.randn(2, 5, 8))
    >>> out.shape, aux.loss.shape
    (torch.Size([2, 5, 8]), torch.Size([]))
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import nn

from shardfn._torch_internals import TransformType, in_transform
from shardfn.models.moe_dispatch import LOCAL, Dispatch
from shardfn.models.moe_router import Routing, load_balancing_loss, route, router_z_loss

__all__ = ["Experts", "MoE", "MoEAux", "dispatch_order", "run_experts"]

AuxLoss = Literal["switch", "none"]


class MoEAux(NamedTuple):
    """The auxiliary losses of one MoE call (0-dim float32 tensors).

    Attributes:
        loss: ``aux_loss_coef * load_balancing + z_loss_coef * z_loss``: add it to the loss.
        load_balancing: Switch/GShard's ``E * sum_e f_e P_e`` (zero with ``aux_loss="none"``).
        z_loss: ``mean(logsumexp(logits)^2)``.
    """

    loss: torch.Tensor
    load_balancing: torch.Tensor
    z_loss: torch.Tensor


class Experts(nn.Module):
    """``E`` SwiGLU experts stored as 3-D parameters (Hugging Face's ``MixtralExperts``).

    Attributes:
        gate_up_proj: ``[E, 2 * hidden, dim]``: rows ``[:hidden]`` the gate, the rest up.
        down_proj: ``[E, dim, hidden]``.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initialises its weight: U(-1/sqrt(fan_in), +)."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Expert ``e`` of those held here applied to its ``counts[e]`` consecutive rows.

        Args:
            rows: ``[sum(counts), dim]`` sorted by expert.
            counts: one count per expert held here (``gate_up_proj.shape[0]``).

        Returns:
            ``[sum(counts), dim]`` outputs, same order.
        """
        return run_experts(rows, counts, self.gate_up_proj, self.down_proj,
                           nn.functional.silu, "Experts.run")


def run_experts(rows: torch.Tensor, counts: list[int], gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, act, who: str) -> torch.Tensor:
    """The gated MLP of expert ``e`` (``gate_up_proj[e]``, ``down_proj[e]``, activation
    ``act`` on the gate half) on its ``counts[e]`` consecutive rows; shared by
    :class:`Experts` and Hugging Face's experts under expert parallelism.

    Args:
        rows: ``[sum(counts), dim]`` sorted by expert.
        counts: one count per expert held (``gate_up_proj.shape[0]``).
        gate_up_proj: ``[E, 2I, H]``; down_proj: ``[E, H, I]``.
        act: the activation (``silu`` for Mixtral).
        who: the caller, for the error.

    Returns:
        ``[sum(counts), dim]`` outputs, same order.

    Example:
        >>> run_experts(torch.ones(3, 2), [1, 2], torch.ones(2, 4, 2), torch.ones(2, 2, 2),
        ...             torch.nn.functional.silu, "demo").shape
        torch.Size([3, 2])
    """
    if len(counts) != gate_up_proj.shape[0]:
        raise ValueError(f"{who}: {len(counts)} counts for {gate_up_proj.shape[0]} experts "
                         f"held here")
    outputs = []
    for e, block in enumerate(rows.split(counts)):
        gate, up = nn.functional.linear(block, gate_up_proj[e]).chunk(2, dim=-1)
        outputs.append(nn.functional.linear(act(gate) * up, down_proj[e]))
    return torch.cat(outputs) if outputs else rows.new_zeros(rows.shape)


def dispatch_order(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The kept assignments sorted by expert (stable: tokens in order within an expert).

    Args:
        routing: the router's decision.

    Returns:
        ``(token, choice, counts)``: each assignment's token and choice index (int64,
        sorted by expert) and the number of assignments per expert.

    Example:
        >>> token, choice, counts = dispatch_order(route(torch.randn(6, 4), top_k=2))
        >>> sum(counts)
        12
    """
    token, choice = routing.kept.nonzero(as_tuple=True)
    expert = routing.experts[token, choice]
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=routing.logits.shape[-1]).tolist()
    return token[order], choice[order], counts


class MoE(nn.Module):
    """A top-k mixture of SwiGLU experts; ``forward(x) -> (output, MoEAux)``.

    Args:
        dim: model width ``H`` (the last dim of the input).
        hidden: each expert's hidden width ``I``.
        num_experts: ``E``.
        top_k: experts per token (1 or 2; any ``k <= E`` works).
        capacity_factor: None (dropless, the default) or ``cf`` (each expert takes
            ``ceil(T k / E cf)`` assignments of a call's ``T`` tokens; the rest are dropped).
        aux_loss: ``"switch"`` (Switch/GShard load balancing, as Hugging Face computes it)
            or ``"none"``.
        aux_loss_coef: weight of the load-balancing loss in ``MoEAux.loss`` (Mixtral's
            ``router_aux_loss_coef`` is 0.02, Switch's 0.01).
        z_loss_coef: weight of the router z-loss in ``MoEAux.loss`` (ST-MoE: 0.001).
        normalize: renormalise the k weights to sum to 1 (Mixtral); False: the softmax
            probabilities (Switch's top-1).

    Example:
        >>> fm = sf.functional(MoE(8, 16, num_experts=4, top_k=1, capacity_factor=1.25))
        >>> out, aux = fm.apply(fm.init(0), torch.randn(10, 8))
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2, *,
                 capacity_factor: float | None = None, aux_loss: AuxLoss = "switch",
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0, normalize: bool = True):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k must be in 1..num_experts={num_experts}, got {top_k}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be None (dropless) or > 0, "
                             f"got {capacity_factor}")
        if aux_loss not in ("switch", "none"):
            raise ValueError(f"MoE: aux_loss must be 'switch' or 'none', got {aux_loss!r}")
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor, self.aux_loss, self.normalize = capacity_factor, aux_loss, normalize
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden)
        self.dispatch: Dispatch = LOCAL

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        if hidden_states.shape[-1] != self.dim:
            raise ValueError(f"MoE: input's last dim is {hidden_states.shape[-1]}, expected "
                             f"dim={self.dim}")
        if in_transform(TransformType.Vmap):
            raise RuntimeError("MoE does not run under torch.func.vmap: how many tokens each "
                               "expert gets is data (the experts run on groups of those sizes); "
                               "vmap the code around the layer, or loop over the batch")
        x = hidden_states.reshape(-1, self.dim)
        routing = route(self.gate(x), self.top_k, self.capacity_factor, self.normalize)
        token, choice, counts = dispatch_order(routing)
        outputs = self.dispatch(self.experts, x[token], counts)
        weighted = outputs * routing.weights[token, choice].to(outputs.dtype)[:, None]
        out = x.new_zeros(x.shape).index_add(0, token, weighted.to(x.dtype))
        return out.reshape(hidden_states.shape), self.losses(routing)

    def losses(self, routing: Routing) -> MoEAux:
        """The :class:`MoEAux` of one call's routing."""
        z_loss = router_z_loss(routing.logits)
        if self.aux_loss == "switch":
            balance = load_balancing_loss(routing.probs, routing.experts, self.num_experts)
        else:
            balance = torch.zeros((), dtype=torch.float32, device=routing.logits.device)
        return MoEAux(self.aux_loss_coef * balance + self.z_loss_coef * z_loss, balance, z_loss)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, aux_loss={self.aux_loss!r}")
