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

Class weights (``weight=[V]``, as ``F.cross_entropy``): each token's loss is scaled by
its target's weight, looked up locally (the targets are global ids).

Communication per call: an all-gather of ``n`` values per token and one
all-reduce of 2 values per token; never the ``[tokens, V]`` logits.
"""

from __future__ import annotations

import math

import torch

from shardfn._torch_internals import assert_async, unwrap_functorch
from shardfn.mesh import Mesh
from shardfn.primitives import all_gather, axis_index, axis_size, psum_invariant

__all__ = ["vocab_parallel_causal_lm_loss", "vocab_parallel_cross_entropy"]

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
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross entropy of logits split on their last (vocabulary) dim over ``axis``.

    Equals ``torch.nn.functional.cross_entropy`` of the full logits (flattened to
    ``[tokens, V]``) with the same ``ignore_index``, ``reduction`` and ``weight``, on
    every rank.
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
        weight: class weights ``[V]`` over the whole vocabulary (replicated, as
            ``F.cross_entropy``'s ``weight``): each token's loss is scaled by the weight
            of its target, and ``"mean"`` divides by the sum of those weights (not the
            count). No extra communication: the targets are global ids.

    Returns:
        The loss, replicated over ``axis`` (the gradient counts it once).

    Raises:
        ValueError: shapes that do not match, a ``vocab_size`` inconsistent with
            ``V_local``, a ``weight`` that is not ``[V]``, an out-of-range target, an
            unknown reduction.

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
    if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1
                               or weight.shape[0] != vocab or not weight.is_floating_point()):
        raise ValueError(f"vocab_parallel_cross_entropy: weight must be a floating tensor of "
                         f"the whole vocabulary's class weights [{vocab}] (not this rank's "
                         f"slice of {local_vocab}), got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    valid = targets != ignore_index
    if torch.compiler.is_compiling():  # no host sync in a graph: fails the step when it runs
        out_of_range = valid & ((targets < 0) | (targets >= vocab))
        assert_async(~out_of_range.any(), f"vocab_parallel_cross_entropy: a target is "
                     f"outside [0, {vocab}) and is not ignore_index={ignore_index}")
    plain = targets if torch.compiler.is_compiling() else unwrap_functorch(targets)
    out_of_range = (plain != ignore_index) & ((plain < 0) | (plain >= vocab))
    if not torch.compiler.is_compiling() and bool(out_of_range.any()):
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
    index = torch.where(owned, local_target, 0).long()
    # indexing, not torch.gather: its backward saves no input and fills one zero buffer in
    # place (gather's saves `shifted` and scatter-adds out of place: two logits-sized buffers)
    rows = torch.arange(index.numel(), device=index.device)
    picked = shifted.reshape(-1, shifted.shape[-1])[rows, index.reshape(-1)].view(index.shape)
    picked = torch.where(owned, picked, 0.0)
    sums = psum_invariant(torch.stack([shifted.exp().sum(dim=-1), picked], dim=-1), axis,
                          mesh=mesh)
    per_token = torch.where(valid, sums[..., 0].log() - sums[..., 1], 0.0)
    if weight is None:
        count = valid.sum()
    else:  # as F.cross_entropy: the target's weight scales its loss and the mean's divisor
        target_weight = torch.where(valid, weight.to(per_token.dtype)[torch.where(
            valid, targets, 0).long()], 0.0)
        per_token = per_token * target_weight
        count = target_weight.sum()

    if reduction == "none":
        loss = per_token
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token.sum() / count
    return loss.to(out_dtype)


def vocab_parallel_causal_lm_loss(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    axis: str = "tp",
    *,
    mesh: Mesh | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``) of vocab-parallel logits.

    As ``model(input_ids, labels=labels).loss``: the labels are shifted by one inside
    (position ``t`` predicts ``labels[t + 1]``; the last position predicts nothing),
    ``ignore_index`` labels add nothing, the logits are upcast to float32, and the loss is
    the mean over the counted tokens, or their sum divided by ``num_items_in_batch``
    (the tokens of the whole accumulated batch, as HF's ``Trainer`` passes it).

    Args:
        local_logits: ``[batch, seq, V_local]``, this rank's vocabulary slice (a colwise
            ``lm_head`` without ``gather_output``).
        labels: ``[batch, seq]`` token ids or ``ignore_index`` (unshifted, as HF takes them).
        axis: the mesh axis the vocabulary is split over.
        mesh: overrides the current mesh.
        vocab_size: the true vocabulary size when padded (see
            :func:`vocab_parallel_cross_entropy`).
        ignore_index: labels with this value are not counted.
        num_items_in_batch: divide the summed loss by this instead of taking the mean.
        shift_labels: labels already shifted (HF's ``shift_labels``); ``labels`` is then
            not used.

    Returns:
        The float32 loss, replicated over ``axis``; equal to HF's loss of the full logits.

    Raises:
        ValueError: as :func:`vocab_parallel_cross_entropy` (shapes, out-of-range labels).

    Example:
        >>> logits = tp.apply(params, input_ids=ids).logits        # lm_head "colwise"
        >>> loss = sf.vocab_parallel_causal_lm_loss(logits, ids, "tp")
    """
    if shift_labels is None:
        padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = vocab_parallel_cross_entropy(local_logits.float(), shift_labels, axis, mesh=mesh,
                                        vocab_size=vocab_size, ignore_index=ignore_index,
                                        reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
