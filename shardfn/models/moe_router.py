"""Top-k routing for a mixture of experts: choices, capacity, token dropping, auxiliary losses.

Pure functions over a router's logits ``[tokens, experts]`` (one group of tokens: a
rank's batch under expert parallelism, as GShard and Switch route each group alone):

* :func:`route`: softmax in float32, top-k experts per token, their weights (renormalised
  over the k, as Mixtral does, or the raw probabilities, as Switch does for k=1), and which
  assignments fit the experts' capacity;
* :func:`expert_capacity`: ``ceil(tokens * k / experts * capacity_factor)`` (GShard/Switch);
* :func:`load_balancing_loss`: Switch/GShard's ``E * sum_e f_e * P_e`` exactly as Hugging
  Face's ``load_balancing_loss_func`` (``f_e``: share of the top-k assignments that chose
  ``e``, before dropping, so ``sum f = k``; ``P_e``: mean router probability of ``e``);
* :func:`router_z_loss`: ST-MoE's ``mean(logsumexp(logits)^2)``.

Dropping follows GShard: every token's first choice is placed before any second choice,
tokens in order, and an assignment whose place in its expert's queue is ``>= capacity`` is
dropped (its weight is not renormalised over the kept ones; a token whose every choice was
dropped gets zeros, left to the residual connection around the layer).

Example:
    >>> logits = torch.tensor([[2.0, 0.0], [1.0, 0.5], [3.0, 0.0]])
    >>> r = route(logits, top_k=1, capacity_factor=1.0)    # capacity ceil(3 * 1 / 2) = 2
    >>> r.experts.flatten().tolist(), r.kept.flatten().tolist()
    ([0, 0, 0], [True, True, False])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["Routing", "expert_capacity", "load_balancing_loss", "route", "router_z_loss"]


class Routing(NamedTuple):
    """The router's decision for one group of tokens.

    Attributes:
        logits: ``[T, E]`` the router's logits (the layer's dtype).
        probs: ``[T, E]`` their softmax, float32.
        experts: ``[T, k]`` int64, the chosen experts, best first.
        weights: ``[T, k]`` float32, each choice's weight in the combination.
        kept: ``[T, k]`` bool, the choices that fit their expert's capacity (all True
            when dropless).
    """

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor


def expert_capacity(tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float | None) -> int | None:
    """Assignments each expert takes from a group: ``ceil(tokens * k / E * cf)``; None: dropless.

    Args:
        tokens: tokens in the group.
        num_experts: experts ``E``.
        top_k: choices per token ``k``.
        capacity_factor: ``cf`` (1.0: exactly an even share; above 1.0: slack); None: no limit.

    Returns:
        The capacity, or None when dropless.

    Example:
        >>> expert_capacity(10, 4, 2, 1.25)
        7
    """
    if capacity_factor is None:
        return None
    return math.ceil(tokens * top_k / num_experts * capacity_factor)


def _positions(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, k]``: each assignment's place in its expert's queue, first choices first."""
    by_choice = experts.t().reshape(-1)  # choice-major: all first choices, then the seconds
    hits = torch.nn.functional.one_hot(by_choice, num_experts)
    place = (hits.cumsum(0) - 1).gather(1, by_choice[:, None])[:, 0]
    return place.reshape(experts.shape[1], experts.shape[0]).t()


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None = None,
          normalize: bool = True) -> Routing:
    """Choose ``top_k`` experts per token and the assignments that fit the capacity.

    Args:
        logits: ``[T, E]`` router logits of one group of tokens.
        top_k: 1 or 2 (any ``k <= E`` works).
        capacity_factor: None (dropless) or the factor of :func:`expert_capacity`.
        normalize: weights renormalised to sum to 1 over the k choices (Mixtral,
            Qwen2-MoE's ``norm_topk_prob``); False: the softmax probabilities (Switch).

    Returns:
        A :class:`Routing`.

    Example:
        >>> route(torch.zeros(4, 3), top_k=2).weights[0]
        tensor([0.5000, 0.5000])
    """
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k must be in 1..{num_experts} (the experts), got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)
    top_probs, experts = torch.topk(probs, top_k, dim=-1)
    weights = top_probs / top_probs.sum(-1, keepdim=True) if normalize else top_probs
    capacity = expert_capacity(logits.shape[0], num_experts, top_k, capacity_factor)
    if capacity is None:
        kept = torch.ones_like(experts, dtype=torch.bool)
    else:
        kept = _positions(experts, num_experts) < capacity
    return Routing(logits, probs, experts, weights, kept)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """Switch/GShard load-balancing loss, as Hugging Face's ``load_balancing_loss_func``.

    ``E * sum_e f_e * P_e`` with ``f_e`` the top-k assignments to ``e`` over the tokens
    (before capacity dropping) and ``P_e`` the mean probability of ``e``; 1.0 (times k)
    when routing is uniform.

    Args:
        probs: ``[T, E]`` router probabilities.
        experts: ``[T, k]`` the chosen experts.
        num_experts: ``E``.

    Returns:
        A 0-dim float32 tensor, differentiable through ``probs``.

    Example:
        >>> load_balancing_loss(torch.full((4, 2), 0.5), torch.tensor([[0], [1], [0], [1]]), 2)
        tensor(1.)
    """
    tokens = max(probs.shape[0], 1)
    counts = torch.nn.functional.one_hot(experts.reshape(-1), num_experts).sum(0)
    fraction = counts.to(torch.float32) / tokens
    return num_experts * (fraction * probs.float().sum(0) / tokens).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean over tokens of logsumexp(logits)^2`` (float32).

    Args:
        logits: ``[T, E]``.

    Returns:
        A 0-dim float32 tensor.

    Example:
        >>> router_z_loss(torch.zeros(2, 4))   # log(4)^2
        tensor(1.9218)
    """
    if logits.shape[0] == 0:
        return logits.float().sum()
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
