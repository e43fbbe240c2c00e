"""Cross entropy over vocab-parallel logits, without gathering them (Megatron's loss).

Rank ``r`` of ``axis`` (size ``n``) holds the logit columns of vocabulary rows
``[r * V_local, (r + 1) * V_local)``, ``V_local = ceil(V / n)``: the vocabulary
is padded to ``n * V_local`` and the padded columns (global index ``>= V``) are
masked to ``-inf`` here, so they take no probability and get no gradient.

The loss of a token with target ``t`` is ``log(sum_j exp(z_j - m)) - (z_t - m)``
with ``m`` the global max (a constant: it cancels, so it carries no gradient):

1. ``m``: each rank's row max, all-gathered (``n`` numbers per token) and maxed;
2. each rank sums ``exp(z - m)`` over its columns and picks ``z_t - m`` if it
   owns ``t`` (0 otherwise); one ``psum_invariant`` of both gives the global sum
   and the target logit on every rank.

``psum_invariant`` (backward: the identity) is the Megatron ``g``: the loss is
replicated and counted once, so the gradient w.r.t. the local logits is
``softmax(z)_local - onehot(t)_local`` (times ``1 / count`` for ``"mean"``),
computed by autograd from these differentiable collectives: correct under
``torch.func.grad`` / ``vjp`` and plain autograd.

Communication per call: an all-gather of ``n`` values per token and one
all-reduce of 2 values per token; never the ``[tokens, V]`` logits.
"""

from __future__ import annotations

import math

import torch

from shardfn._torch_internals import unwrap_functorch
from shardfn.mesh import Mesh
from shardfn.primitives import all_gather, axis_index, axis_size, psum_invariant

__all__ = ["vocab_parallel_cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    axis: str = "tp",
    *,
    mesh: Mesh | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy of logits split on their last (vocabulary) dim over ``axis``.

    Equals ``torch.nn.functional.cross_entropy`` of the full logits (flattened to
    ``[tokens, V]``) with the same ``ignore_index`` and ``reduction``, on every rank.
    fp16/bf16 logits are computed in float32 and the loss returned in their dtype.

    Args:
        local_logits: ``[..., V_local]``, this rank's vocabulary slice.
        targets: ``[...]`` global token ids in ``[0, V)`` or ``ignore_index``.
        axis: the mesh axis the vocabulary is split over.
        mesh: overrides the current mesh.
        vocab_size: the true ``V`` when it is not ``n * V_local`` (padded vocabulary:
            ``V_local`` must be ``ceil(V / n)``); default ``n * V_local``.
        ignore_index: targets with this value add nothing to the loss or the count.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``
            (shape of ``targets``, 0 where ignored).

    Returns:
        The loss, replicated over ``axis`` (the gradient counts it once).

    Raises:
        ValueError: shapes that do not match, a ``vocab_size`` inconsistent with
            ``V_local``, an out-of-range target, an unknown reduction.

    Example:
        >>> with sf.Mesh({"tp": 2}):
        ...     loss = sf.vocab_parallel_cross_entropy(local_logits, targets, "tp")
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be one of "
                         f"{REDUCTIONS}, got {reduction!r}")
    if not local_logits.is_floating_point() or local_logits.dim() < 1:
        raise ValueError(f"vocab_parallel_cross_entropy: local_logits must be a floating "
                         f"tensor [..., V_local], got {local_logits.dtype} "
                         f"{tuple(local_logits.shape)}")
    if targets.is_floating_point() or targets.shape != local_logits.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: targets must be integer ids of shape "
                         f"{tuple(local_logits.shape[:-1])} (local_logits without its vocab "
                         f"dim), got {targets.dtype} {tuple(targets.shape)}")
    n, rank = axis_size(axis, mesh=mesh), axis_index(axis, mesh=mesh)
    local_vocab = local_logits.shape[-1]
    vocab = n * local_vocab if vocab_size is None else vocab_size
    if not isinstance(vocab, int) or vocab <= 0 or math.ceil(vocab / n) != local_vocab:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size={vocab_size!r} does not fit "
                         f"V_local={local_vocab} on axis {axis!r} of size {n}: V_local must be "
                         f"ceil(vocab_size / {n}), i.e. vocab_size in "
                         f"({(local_vocab - 1) * n}, {local_vocab * n}]")
    valid = targets != ignore_index
    plain = unwrap_functorch(targets)  # under vmap: every batch element's ids, checked at once
    out_of_range = (plain != ignore_index) & ((plain < 0) | (plain >= vocab))
    if bool(out_of_range.any()):
        bad = plain[out_of_range][0].item()
        raise ValueError(f"vocab_parallel_cross_entropy: target {bad} is outside [0, {vocab}) "
                         f"and is not ignore_index={ignore_index}")

    # as F.cross_entropy: the logits' dtype, but float32 under autocast (an fp32 op there)
    autocast = torch.is_autocast_enabled(local_logits.device.type)
    out_dtype = torch.float32 if autocast else local_logits.dtype
    logits = local_logits.float() if local_logits.dtype in (torch.float16, torch.bfloat16) \
        else local_logits
    start = rank * local_vocab
    if start + local_vocab > vocab:  # padded columns of the last ranks
        column = torch.arange(start, start + local_vocab, device=logits.device)
        logits = torch.where(column < vocab, logits, float("-inf"))

    # 1. the global max of each row: a constant shift, no gradient through it
    local_max = logits.detach().amax(dim=-1, keepdim=True)
    global_max = all_gather(local_max, axis, dim=-1, mesh=mesh).amax(dim=-1, keepdim=True)
    shifted = logits - global_max

    # 2. local sum of exp and the owned target logit, summed over the axis at once
    local_target = targets - start
    owned = valid & (local_target >= 0) & (local_target < local_vocab)
    index = torch.where(owned, local_target, 0).long().unsqueeze(-1)
    picked = torch.gather(shifted, -1, index).squeeze(-1)
    picked = torch.where(owned, picked, 0.0)
    sums = psum_invariant(torch.stack([shifted.exp().sum(dim=-1), picked], dim=-1), axis,
                          mesh=mesh)
    per_token = torch.where(valid, sums[..., 0].log() - sums[..., 1], 0.0)

    if reduction == "none":
        loss = per_token
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token.sum() / valid.sum()
    return loss.to(out_dtype)
