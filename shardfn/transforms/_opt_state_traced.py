"""``shard_opt_state``'s two exchanges in code that ``torch.compile`` traces.

The eager exchanges (:mod:`._opt_state_exchange`) move pieces of the leaves
point to point and write in place, which dynamo cannot trace. Here each bucket
of the same :class:`~shardfn.primitives.flat.FlatPartition` is laid out as one
flat tensor of ``N`` blocks (block ``j``: the pieces rank ``j`` owns, padded to
the bucket's block length) and moved by one functional collective
(:mod:`shardfn.primitives._comm_traced`: on gloo an all-to-all, half the bytes of
gloo's all-reduce-based reduce-scatter): a reduce-scatter for the gradients, an
all-gather for the updates. Every bucket is issued before the first is waited for,
so in a compiled step each one's collective runs while the backward (or the optimizer
update) of the buckets still to come goes on (docs/compile.md, "Overlap"). The pieces,
their owners, the sum (this rank's value plus the other's, on 2 ranks the very
same additions) and the divisions are the eager ones, so the results are too.

Limits: the live (floating) leaves of one bucket must share a dtype after the
``reduce_dtype`` cast (a flat tensor has one dtype): a mixed bucket raises a
``ValueError`` naming its leaves. Non-floating leaves are not sent: their parts
and updates are zeros, as in eager.

Example:
    >>> local = reduce_scatter_traced(part, flats, frozen, param_leaves, ax, divide)
    >>> full = all_gather_traced(part, local, frozen, param_leaves, ax)
"""

from __future__ import annotations

from typing import Any

import torch

from shardfn.primitives._comm_traced import (
    FlatPending,
    all_gather_flat_start,
    psum_scatter_flat_start,
    wait_flat,
)
from shardfn.primitives.flat import FlatPartition, piece_divisors

__all__ = ["all_gather_traced", "reduce_scatter_traced"]


def _bucket_dtype(part: FlatPartition, b: int, dtypes: list[torch.dtype],
                  frozen: frozenset[int]) -> torch.dtype | None:
    """The one dtype of bucket ``b``'s live leaves (None: no live leaf), or a ValueError."""
    leaves = sorted({leaf for pieces in part.plans[b].blocks for leaf, _, _ in pieces} - frozen)
    kinds = {dtypes[leaf] for leaf in leaves}
    if len(kinds) > 1:
        shown = ", ".join(f"{part.names[leaf]!r} ({dtypes[leaf]})" for leaf in leaves[:6])
        raise ValueError(f"shard_opt_state under torch.compile: bucket {b} holds leaves of "
                         f"several dtypes ({shown}); a compiled step moves a bucket as one "
                         "flat tensor. Give the optimizer one dtype (precision.reduce_dtype) "
                         "or a bucket_bytes that separates them, or run this step eagerly")
    return kinds.pop() if kinds else None


def _padded(values: list[torch.Tensor], block: int, like: torch.Tensor,
            dtype: torch.dtype) -> list[torch.Tensor]:
    """``values`` and, where they hold fewer than ``block`` elements, zeros up to it (a
    bucket's block moves at its full size, as the eager piece exchange sends it)."""
    filled = sum(v.numel() for v in values)
    if filled < block:
        values.append(like.new_zeros(block - filled, dtype=dtype))
    return values


def reduce_scatter_traced(part: FlatPartition, flats: list[torch.Tensor], frozen: frozenset[int],
                          param_leaves: list[torch.Tensor], ax, divide: Any
                          ) -> list[torch.Tensor]:
    """This rank's summed (and divided) part of every leaf, one ``psum_scatter`` per bucket.

    Args:
        part: the partition.
        flats: every gradient leaf as a 1-D tensor (prescaled as in eager).
        frozen: the leaf numbers that are not reduced (their parts are zeros).
        param_leaves: the parameters (dtype and device of the parts).
        ax: the axis (size > 1).
        divide: None, one divisor, or one per leaf (as ``reduce_scatter_grads`` has it).

    Returns:
        One 1-D tensor per leaf: its pieces owned by this rank, in bucket order.
    """
    dtypes = [f.dtype for f in flats]
    issued: list[tuple[int, FlatPending]] = []
    # every bucket in flight before the first wait, the last bucket first: the backward
    # makes the last leaves' gradients first, and the collectives keep this order
    for b in reversed(range(len(part.plans))):
        plan = part.plans[b]
        dtype = _bucket_dtype(part, b, dtypes, frozen)
        if dtype is None:
            continue
        blocks = []
        for pieces in plan.blocks:
            blocks += _padded([flats[leaf][lo:hi] for leaf, lo, hi in pieces
                               if leaf not in frozen], plan.block, flats[0], dtype)
        issued.append((b, psum_scatter_flat_start(torch.cat(blocks), ax)))
    parts: list[list[torch.Tensor]] = [[] for _ in flats]
    for b, pending in reversed(issued):  # bucket order: a leaf's pieces in order
        plan = part.plans[b]
        mine = wait_flat(pending)
        divisors = (piece_divisors(plan, ax.index, divide) if isinstance(divide, list)
                    else [divide] * len(plan.blocks[ax.index]))
        at = 0
        for (leaf, lo, hi), divisor in zip(plan.blocks[ax.index], divisors, strict=True):
            if leaf in frozen:
                continue
            piece = mine[at:at + hi - lo].to(param_leaves[leaf].dtype)  # eager: sum into it
            at += hi - lo
            parts[leaf].append(piece / divisor if divisor is not None and divisor != 1
                               else piece)
    out = []
    for i, (n, p) in enumerate(zip(part.local_sizes, param_leaves, strict=True)):
        if i in frozen or not parts[i]:
            out.append(torch.zeros(n, dtype=p.dtype, device=p.device))
        else:
            out.append(torch.cat(parts[i]) if len(parts[i]) > 1 else parts[i][0])
    return out


def all_gather_traced(part: FlatPartition, local_leaves: list[torch.Tensor],
                      frozen: frozenset[int], param_leaves: list[torch.Tensor], ax
                      ) -> list[torch.Tensor]:
    """The full leaves from every rank's local parts, one ``all_gather`` per bucket.

    Args:
        part: the partition.
        local_leaves: this rank's part of every leaf (as ``reduce_scatter_traced`` gives).
        frozen: leaf numbers whose updates are zeros (nothing sent).
        param_leaves: the parameters (shape, dtype and device of the results).
        ax: the axis (size > 1).

    Returns:
        One tensor per leaf, shaped like its parameter.
    """
    dtypes = [p.dtype for p in param_leaves]
    issued: list[tuple[int, FlatPending]] = []
    for b, plan in enumerate(part.plans):  # every bucket in flight before the first wait
        dtype = _bucket_dtype(part, b, dtypes, frozen)
        if dtype is None:
            continue
        own = _padded([local_leaves[leaf][at:at + hi - lo] for (leaf, lo, hi), at
                       in zip(plan.blocks[ax.index], part.local_slots[b], strict=True)
                       if leaf not in frozen], plan.block, param_leaves[0], dtype)
        issued.append((b, all_gather_flat_start(torch.cat(own).to(dtype), ax)))
    segments: list[list[torch.Tensor]] = [[] for _ in param_leaves]
    for b, pending in issued:
        plan = part.plans[b]
        gathered = wait_flat(pending)
        for j, pieces in enumerate(plan.blocks):
            at = j * plan.block
            for leaf, lo, hi in pieces:
                if leaf in frozen:
                    continue
                segments[leaf].append(gathered[at:at + hi - lo])
                at += hi - lo
    out = []
    for i, p in enumerate(param_leaves):
        if i in frozen or not segments[i]:
            out.append(torch.zeros(p.shape, dtype=p.dtype, device=p.device))
        else:
            flat = torch.cat(segments[i]) if len(segments[i]) > 1 else segments[i][0]
            out.append(flat.view(p.shape))
    return out
