"""A sharded model's leaves as trees: init, shard, gather, split and merge.

What :class:`~.api.ShardedModel`'s tree members do (``api`` keeps the methods and
their documentation); each reads only the frozen :class:`~.plan.Plan`. A leaf's
local shard is ``sf.shard(full, plan.specs[name], mesh)``: rows of dim 0 over the
sharding axis, zero-padded (``P()`` for 0-dim parameters and buffers), the same on
every rank of an HSDP replica axis. An ignored leaf (``ignored_params=``) is its
own value on each rank (``P()``, never checked to agree: the caller may hold another
value on each). ``shard`` and ``gather`` take any subset of the leaves (a gradient
tree, the trainable part of ``split_trainable``).

Example:
    >>> shards = shard_leaves(model._plan, fmodel.init(0), "shard_params.shard")
    >>> gather_leaves(model._plan, shards, "shard_params.gather")   # == fmodel.init(0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardfn._functional_layout import check_leaves
from shardfn.primitives import consistency
from shardfn.spec import gather, shard
from shardfn.transforms.shard_params.plan import Plan

__all__ = ["gather_leaves", "init_shards", "merge", "plan_for", "shard_leaves", "split_trainable"]

Params = dict[str, torch.Tensor]


def _cut(plan: Plan, full: Mapping[str, torch.Tensor]) -> Params:
    """This rank's shards of ``full`` (fresh tensors, on the storage device); check mode
    checks that the leaves but the ignored ones agree over the data-parallel axes."""
    over = plan.all_ax.names  # (over tensor_split: the TP shards differ over tp)
    return {name: plan.place.store(shard(
        full[name], plan.specs[name], plan.mesh,
        replicated_over=() if name in plan.ignored else over).clone())
        for name in plan.names if name in full}


def _agreeing(plan: Plan, tree: Mapping[str, torch.Tensor]) -> Params:
    """The leaves of ``tree`` that must be the same on every data-parallel rank."""
    return {name: x for name, x in tree.items() if name not in plan.ignored}


def init_shards(plan: Plan, seed: int, device: torch.device | str | None) -> Params:
    """This rank's shards of ``plan.functional.init(seed)``, built one unit at a time.

    Args:
        plan: the model's plan.
        seed: as for ``FunctionalModel.init``.
        device: where to build the full leaves (None: the storage device with offload,
            else the mesh's device).

    Returns:
        ``name -> local shard`` for every leaf, in ``names`` order.

    Example:
        >>> shards = init_shards(model._plan, 0, None)
    """
    if device is None:
        device = plan.place.storage if plan.place.offload else plan.mesh.device
    out: Params = {}
    for paths in plan.init_groups:
        full = plan.functional.init_subset(seed, paths, device=device)
        consistency.check_replicated("shard_params.init", plan.all_ax, _agreeing(plan, full))
        out.update(_cut(plan, full))
        del full  # one unit's full leaves alive at a time
    return {name: out[name] for name in plan.names}


def shard_leaves(plan: Plan, tree: Mapping[str, torch.Tensor], what: str) -> Params:
    """This rank's shards of full leaves, any subset of the names (no communication).

    Args:
        plan: the model's plan.
        tree: ``name -> full Tensor`` (the shapes of ``plan.functional``'s leaves).
        what: the operation, for the messages.

    Returns:
        ``name -> local shard`` (fresh tensors, zero-padded), in ``names`` order.

    Raises:
        TypeError / ValueError: a name that is not a leaf, or a leaf that is not full.

    Example:
        >>> trainable_shards = shard_leaves(plan, fmodel.split_trainable(full)[0], "shard")
    """
    shapes = {name: tuple(layout.shape) for name, layout in plan.specs.items()}
    check_leaves(tree, shapes, what, tied=plan.functional.tied)
    consistency.check_replicated(what, plan.all_ax, _agreeing(plan, tree))
    return _cut(plan, tree)


def gather_leaves(plan: Plan, shards: Mapping[str, torch.Tensor], what: str) -> Params:
    """The full leaves from every rank's shards, any subset of the names; differentiable.

    An all-gather over the sharding axis only: over an HSDP replica axis the shards are
    the same already. With offload the shards are first copied to the compute device.
    Every rank must pass the same names.

    Args:
        plan: the model's plan.
        shards: ``name -> local shard`` for any of the leaves (a gradient tree too).
        what: the operation, for the messages.

    Returns:
        ``name -> full Tensor`` (padding removed), in ``names`` order.

    Raises:
        TypeError / ValueError: a name that is not a leaf, or a leaf whose shape is not
            its local shard's.

    Example:
        >>> full = gather_leaves(plan, shards, "shard_params.gather")
    """
    check_leaves(shards, plan.local_shapes, what, tied=plan.functional.tied,
                 kind=f"local shard (over {plan.ax.names})")
    names = [name for name in plan.names if name in shards]
    local = {name: shards[name] for name in names}
    if plan.place.offload:
        local = {name: x.to(plan.place.compute) for name, x in local.items()}
    return gather(local, {name: plan.specs[name] for name in names}, plan.mesh)


def split_trainable(plan: Plan, shards: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
    """``(trainable, rest)`` of a whole shard tree (checked), both in ``names`` order.

    Example:
        >>> trainable, rest = split_trainable(plan, shards)
    """
    plan.check_shards(shards)
    trainable = {n: shards[n] for n in plan.names if n in plan.trainable_set}
    rest = {n: shards[n] for n in plan.names if n not in plan.trainable_set}
    return trainable, rest


def merge(plan: Plan, trainable: Mapping[str, torch.Tensor],
          rest: Mapping[str, torch.Tensor]) -> Params:
    """The inverse of :func:`split_trainable`: one whole shard tree, checked.

    Raises:
        ValueError: a name in both parts, or what ``Plan.check_shards`` refuses.

    Example:
        >>> shards = merge(plan, *split_trainable(plan, shards))
    """
    overlap = sorted(set(trainable) & set(rest))
    if overlap:
        raise ValueError(f"merge: names present in both trainable and rest: {overlap}")
    both = {**rest, **trainable}
    plan.check_shards(both)
    return {name: both[name] for name in plan.names}


def plan_for(plan: Plan, variants: dict[tuple[torch.dtype, ...], Plan],
             tree: Mapping[str, Any]) -> Plan:
    """The plan for a whole tree whose leaves have ``tree``'s dtypes: ``plan`` for its own
    (master) dtypes, else a variant built once and cached in ``variants`` (float64 shards
    of a float32 module: the gathers and reductions follow the shards' dtypes).

    Args:
        plan: the model's plan.
        variants: the model's cache, ``leaf dtypes (in names order) -> Plan``.
        tree: ``name -> Tensor`` (or ``name -> torch.dtype``) for every leaf.

    Returns:
        The plan to run.

    Example:
        >>> plan_for(model._plan, model._variants, {n: x.double() for n, x in shards.items()})
    """
    dtypes = tuple(x if isinstance(x, torch.dtype) else x.dtype
                   for x in (tree[name] for name in plan.names))
    if dtypes == tuple(plan.masters[name] for name in plan.names):
        return plan
    variant = variants.get(dtypes)
    if variant is None:
        variant = variants[dtypes] = plan.for_dtypes(dtypes)
    return variant
