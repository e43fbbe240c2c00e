"""Leaves several pipeline stages hold: tied weights across stages, and shared buffers.

A weight two units use (GPT-2's ``wte`` and ``lm_head``, a tied Llama's embedding and
head, an ``nn.Embedding`` whose weight a plain unit's ``nn.Linear`` reuses) is one leaf
of the model. When the units sit on different stages, every stage using it holds a copy
(:meth:`~.stage.StagePlan.shared`), as Megatron's embedding group and DeepSpeed's
``TiedLayerSpec`` do:

* after each step's backward the holders' gradients are **summed** between their pp ranks
  (:func:`sum_tied`): two holders swap theirs with one ``ppermute`` and both add them in
  rank order, so both get the same bits, the gradient of the unsplit model; more holders
  use a ``psum`` over the pp axis. Every holder then applies the same update, so the copies
  stay equal (the same optimizer on the same gradients).
* ``init`` builds the leaf on every holder from its owning submodule's seed (equal copies);
  ``layout``, ``gather`` and checkpoints see **one** leaf, the owner's: the first stage
  holding it (:class:`~.tied_model.TiedPipelineModel`).
* **stage models** (``shard_params``, ``tensor_split``, ... per stage): each holder's
  gradient is its stage model's, already reduced over that stage's axes, of its own shard;
  the shards are summed between the holders like whole leaves, which is right only if
  every holder lays the leaf out alike (same layout, same axes reduced over), so
  :func:`tied_local_shapes` refuses holders that differ, naming the leaf and both layouts.

A shared buffer (rotary frequencies, a constant mask) is held alike but has no gradient:
nothing is summed, it is not a tied weight.

Cost per step: each tied weight's gradient, once each way between its two holders' ranks.

Example:
    >>> grads = sum_tied(grads, stage_plan, ax)      # in run_step, after the backward
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shardfn import spec
from shardfn.primitives import _comm
from shardfn.primitives._comm import Axis
from shardfn.transforms.pipeline.stage import StagePlan

__all__ = ["sum_tied", "tied_groups", "tied_local_shapes"]

Params = dict[str, torch.Tensor]


def tied_local_shapes(tied: Mapping[str, Sequence[int]], stage_models: Sequence[Any],
                      reduced_axes: Callable[[Any], tuple[str, ...]]
                      ) -> dict[str, tuple[int, ...]]:
    """Check that every holder of a tied leaf lays it out alike; its local shape.

    Args:
        tied: leaf -> the stages holding it (``PipelineSplit.tied_across()``).
        stage_models: every stage's model (a plain stage: the split's FunctionalModel).
        reduced_axes: a stage model -> the mesh axes it reduces its gradients over.

    Returns:
        ``leaf -> local shape`` (this rank's shard of it on every holder; the full shape
        on plain stages).

    Raises:
        ValueError: two holders with different layouts or reduced axes, naming the leaf,
            both stages and both layouts.

    Example:
        >>> tied_local_shapes({"0.weight": (0, 1)}, [split[0], split[1]], lambda m: ())
        {'0.weight': (64, 8)}
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, stages in tied.items():
        seen = []
        for stage in stages:
            model = stage_models[stage]
            layout = model.specs[name]
            full = tuple(model.param_shapes()[name].shape) \
                if hasattr(model, "param_shapes") else tuple(layout.shape)
            layout = spec.Layout(layout, full) if isinstance(layout, spec.P) else layout
            seen.append((stage, layout, reduced_axes(model), getattr(model, "mesh", None)))
        first_stage, first, first_axes, mesh = seen[0]
        for stage, layout, axes, _ in seen[1:]:
            if (layout, axes) != (first, first_axes):
                raise ValueError(
                    f"pipeline_stages: leaf {name!r} is tied across stages {list(stages)}: "
                    f"stage {first_stage} holds it as {first} (gradients reduced over "
                    f"{list(first_axes)}), stage {stage} as {layout} (reduced over "
                    f"{list(axes)}); the holders' gradients are summed shard by shard, so "
                    "they must lay it out alike: transform those stages alike (the same "
                    "transform over the same axes, e.g. stage_transform=)")
        shapes[name] = tuple(first.shape) if mesh is None else \
            tuple(spec.local_shape(tuple(first.shape), first, mesh))
    return shapes


def tied_groups(stage_plan: StagePlan) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """The trainable leaves held on more than one pp rank, grouped by their holders.

    Returns:
        ``[(ranks, names), ...]`` in a fixed order (the same on every rank).

    Example:
        >>> tied_groups(plan)
        [((0, 1), ('model.embed_tokens.weight',))]
    """
    trainable = set(stage_plan.full.trainable_names)
    dtypes = stage_plan.full.param_shapes()
    groups: dict[tuple, list[str]] = {}  # (ranks, dtype): one flat message per group
    for name, ranks in stage_plan.shared().items():
        if name in trainable:
            groups.setdefault((ranks, dtypes[name].dtype), []).append(name)
    return [(ranks, tuple(names)) for (ranks, _), names in groups.items()]


def sum_tied(grads: Mapping[str, torch.Tensor], stage_plan: StagePlan, ax: Axis,
             device: torch.device | str = "cpu") -> Params:
    """``grads`` with each tied leaf's gradient summed over the pp ranks holding it.

    Every pp rank calls it (a collective over ``ax`` when there are ties across ranks; a
    rank holding none of a group's leaves joins with an empty part).

    Args:
        grads: this rank's gradients (its stages' trainable leaves).
        stage_plan: the stages.
        ax: the resolved pp axis.
        device: where a rank holding none of a group's leaves makes its zeros.

    Returns:
        The gradients, tied ones summed (the same bits on every holder).

    Example:
        >>> grads = sum_tied(grads, stage_plan, ax)
    """
    groups = tied_groups(stage_plan) if ax.size > 1 else []
    if not groups:
        return dict(grads)
    shapes = stage_plan.full.param_shapes()
    out = dict(grads)
    for ranks, names in groups:
        mine = ax.index in ranks
        parts = [grads[n].reshape(-1) if mine else  # local: a stage model's shard
                 torch.zeros(_numel(stage_plan.tied_shapes.get(n, shapes[n].shape)),
                             dtype=shapes[n].dtype, device=device)
                 for n in names]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        if len(ranks) == 2:
            low, high = ranks
            other = _comm.ppermute(flat, ax, ((low, high), (high, low)))
            summed = flat + other if ax.index == low else other + flat  # rank order
        else:
            summed = _comm.psum(flat, ax)
        if not mine:
            continue
        start = 0
        for n in names:
            size = grads[n].numel()
            out[n] = summed[start:start + size].view_as(grads[n])
            start += size
    return out


def _numel(shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel())
