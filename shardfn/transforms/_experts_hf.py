"""Hugging Face MoE blocks (Mixtral, Qwen2-MoE) under expert parallelism: their experts
dispatched over a mesh axis, their router reused as it is.

A Hugging Face sparse MoE block (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``)
holds a router module (``gate``: ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter``: float32
softmax, top-k, renormalised when ``norm_topk_prob``) and an experts module (``experts``:
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``); Qwen2-MoE adds a
dense ``shared_expert`` and its sigmoid ``shared_expert_gate``. :func:`split_hf_experts`,
called by ``sf.expert_parallel`` on its copy of the model, replaces each experts module by
:class:`HFExpertsOverAxis`, which holds the *same* parameters under the same names and
sends the router's assignments through shardfn's dispatch
(:class:`~shardfn.models.moe_dispatch.AllToAllExperts`: counts first, then the rows with
variable splits, and back). Everything else, the router and the shared expert included,
runs as Hugging Face wrote it, so each rank's logits, ``router_logits`` and ``aux_loss``
are those of the unsplit model on that rank's tokens.

The auxiliary loss (``output_router_logits=True``) is Hugging Face's
``load_balancing_loss_func`` over this rank's router logits of every layer: a product of
two means over the rank's tokens, so the mean of the ranks' aux losses is *not* the aux
loss of all ranks' tokens in one batch (GShard and DeepSpeed-MoE also balance each group
of tokens alone). The gradient ``sf.expert_parallel`` gives is that of the mean over the
axis of every rank's loss, aux loss included.

Example:
    >>> hf = MixtralForCausalLM(MixtralConfig(hidden_size=32, num_local_experts=4, ...))
    >>> ep = sf.expert_parallel(sf.functional(hf), sf.Mesh({"ep": 2}), "ep")
    >>> out = ep.apply(ep.init(0), input_ids=ids, labels=ids, output_router_logits=True)
"""

from __future__ import annotations

import torch
from torch import nn

from shardfn.mesh import Mesh
from shardfn.models.moe import run_experts
from shardfn.models.moe_dispatch import LOCAL, AllToAllExperts, Dispatch

__all__ = ["HFExpertsOverAxis", "hf_sort_assignments", "is_hf_experts", "split_hf_experts"]


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face experts module this adapter can split.

    Hugging Face's 3-D experts (``MixtralExperts``, ``Qwen2MoeExperts`` and the others made
    by ``@use_experts_implementation``): ``num_experts``, ``act_fn``, and 3-D
    ``gate_up_proj``/``down_proj`` parameters.

    Example:
        >>> is_hf_experts(MixtralForCausalLM(config).model.layers[0].mlp.experts)
        True
    """
    if isinstance(module, HFExpertsOverAxis):
        return False
    params = dict(module.named_parameters(recurse=False))
    return (hasattr(module, "num_experts") and hasattr(module, "act_fn")
            and {"gate_up_proj", "down_proj"} <= set(params)
            and params["gate_up_proj"].dim() == params["down_proj"].dim() == 3)


def _refuse_unsupported(path: str, module: nn.Module) -> None:
    """A clear error for an experts layout other than Mixtral's (bias, transposed...)."""
    layout = {"has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_gate": True, "has_post_expert_norm": False}
    odd = {k: getattr(module, k) for k, want in layout.items()
           if getattr(module, k, want) != want}
    if odd:
        raise ValueError(f"expert_parallel: Hugging Face experts {path!r} "
                         f"({type(module).__name__}) use a layout this adapter does not "
                         f"split ({odd}); supported: Mixtral's (concatenated [gate; up], "
                         f"not transposed, no bias)")


def hf_sort_assignments(top_k_index: torch.Tensor,
                        num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The router's ``[T, k]`` assignments sorted by expert (stable: tokens in order).

    Args:
        top_k_index: ``[T, k]`` int, each token's chosen experts.
        num_experts: ``E``, the experts of the layer (all ranks together).

    Returns:
        ``(token, choice, counts)``: int64 token and choice index of each assignment,
        sorted by expert, and the assignments per expert (a list of ``E`` ints).

    Raises:
        ValueError: an index outside ``0..E-1``.

    Example:
        >>> hf_sort_assignments(torch.tensor([[1, 0], [1, 2]]), 3)
        (tensor([0, 0, 1, 1]), tensor([1, 0, 0, 1]), [1, 2, 1])
    """
    tokens, top_k = top_k_index.shape
    expert = top_k_index.reshape(-1).to(torch.int64)
    if expert.numel() and not 0 <= int(expert.min()) <= int(expert.max()) < num_experts:
        raise ValueError(f"expert_parallel: the router chose expert indices "
                         f"{int(expert.min())}..{int(expert.max())}, outside 0..{num_experts - 1}")
    order = torch.argsort(expert, stable=True)
    device = top_k_index.device
    token = torch.arange(tokens, device=device).repeat_interleave(top_k)[order]
    choice = torch.arange(top_k, device=device).repeat(tokens)[order]
    counts = torch.bincount(expert, minlength=num_experts).tolist()
    return token, choice, counts


class HFExpertsOverAxis(nn.Module):
    """A Hugging Face experts module whose experts are reached through ``dispatch``.

    Holds the source module's ``gate_up_proj`` and ``down_proj`` (the same parameters,
    so leaf names are unchanged) and its ``act_fn``; ``forward`` keeps Hugging Face's
    signature and result.

    Attributes:
        num_experts: ``E``, all ranks' experts.
        dispatch: how rows reach the experts (:data:`LOCAL` or ``AllToAllExperts``).
    """

    def __init__(self, source: nn.Module, dispatch: Dispatch = LOCAL):
        super().__init__()
        self.gate_up_proj = source.gate_up_proj
        self.down_proj = source.down_proj
        self.act_fn = source.act_fn
        self.num_experts = int(source.num_experts)
        self.dispatch = dispatch

    def run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Expert ``e`` of those held here on its ``counts[e]`` consecutive rows (as Hugging
        Face's eager loop computes one expert)."""
        return run_experts(rows, counts, self.gate_up_proj, self.down_proj, self.act_fn,
                           "HFExpertsOverAxis.run")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        token, choice, counts = hf_sort_assignments(top_k_index, self.num_experts)
        outputs = self.dispatch(self, hidden_states[token], counts)
        weighted = outputs * top_k_weights[token, choice, None]
        return torch.zeros_like(hidden_states).index_add(
            0, token, weighted.to(hidden_states.dtype))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, dispatch={type(self.dispatch).__name__}"


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def split_hf_experts(skeleton: nn.Module, mesh: Mesh, axis: str) -> dict[str, int]:
    """Replace every Hugging Face experts module of ``skeleton`` (in place) by one that
    dispatches over ``axis``.

    Called by ``sf.expert_parallel`` on its copy of the model; the routers are untouched.

    Args:
        skeleton: the module to change (a copy: this mutates it).
        mesh: the mesh.
        axis: the expert-parallel axis; each layer's ``num_experts`` must divide by its size.

    Returns:
        ``leaf name -> experts`` for the split leaves (empty when the model has none).

    Raises:
        ValueError: experts that do not divide by the axis size, or a layout other than
            Mixtral's (both name the module).

    Example:
        >>> split_hf_experts(skeleton, sf.Mesh({"ep": 2}), "ep")
        {'model.layers.0.mlp.experts.gate_up_proj': 4, ...}
    """
    ep = mesh.size(axis)
    found: dict[str, int] = {}
    for path, module in [(p, m) for p, m in skeleton.named_modules() if is_hf_experts(m)]:
        _refuse_unsupported(path, module)
        if module.num_experts % ep:
            raise ValueError(f"expert_parallel: Hugging Face experts {path!r} have "
                             f"E={module.num_experts} experts, not divisible by ep={ep} (the "
                             f"size of axis {axis!r}); choose an ep that divides E")
        _set_submodule(skeleton, path, HFExpertsOverAxis(module, AllToAllExperts(mesh, axis)))
        for leaf in ("gate_up_proj", "down_proj"):
            found[f"{path}.{leaf}" if path else leaf] = int(module.num_experts)
    return found

