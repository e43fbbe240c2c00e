"""Each stage's forward: the plain unit chain, under remat, or a stage model's ``apply``.

:func:`step_plan` builds the :class:`~.runtime.StepPlan` of a pipeline from its
stages and the stage models of this rank; ``pipeline_stages`` calls it once, and
``PipelineModel.train(mode)`` again over the stages and models in that mode.

Example:
    >>> plan = step_plan(stage_plan, {}, schedule, ax, mse, None, None, mesh.device)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardfn.transforms.pipeline.batch import call_unit
from shardfn.transforms.pipeline.schedules import Schedule
from shardfn.transforms.pipeline.stage import Stage, StagePlan
from shardfn.transforms.pipeline.step_plan import StepPlan

__all__ = ["step_plan"]


def step_plan(stage_plan: StagePlan, models: Mapping[int, Any], schedule: Schedule, ax: Any,
              loss_fn: Callable[[Any, Any], torch.Tensor], declared: Any,
              remat: Callable | None, device: torch.device) -> StepPlan:
    """The step plan: per stage its forward (and its ``mutable=True`` forward).

    Args:
        stage_plan: the stages.
        models: this rank's stage index -> its stage model (stages not in it run
            their units: ``stage_plan.forward``).
        schedule: the schedule.
        ax: the resolved pp axis.
        loss_fn: ``loss_fn(out, targets) -> scalar``.
        declared: the parsed ``shapes=`` (None: inferred or dynamic).
        remat: a remat policy for the plain stages, or None.
        device: where messages live.

    Returns:
        The :class:`~.runtime.StepPlan`.
    """
    forwards = tuple(_model_forward(models[stage.index]) if stage.index in models
                     else _stage_forward(stage_plan, stage, remat)
                     for stage in stage_plan.stages)
    plain = tuple(remat is None and stage.index not in models for stage in stage_plan.stages)
    mutable_forwards = () if remat is not None else tuple(
        _model_forward(models[stage.index], mutable=True) if stage.index in models
        else functools.partial(stage_plan.forward_mutable, stage) for stage in stage_plan.stages)
    return StepPlan(stage_plan, schedule, ax, loss_fn, forwards, declared, plain, device,
                    mutable_forwards)


def _model_forward(model: Any, mutable: bool = False):
    """A stage model's forward over this rank's leaves; stage 0's several inputs (a
    :class:`~.batch.UnitInputs`) spread into its ``apply``."""
    options = {"mutable": True} if mutable else {}
    return lambda leaves, x: call_unit(model.apply, {n: leaves[n] for n in model.names}, x,
                                       **options)


def _stage_forward(stage_plan: StagePlan, stage: Stage, policy: Callable | None):
    fn = stage_plan.stage_forward(stage)
    if policy is None:
        return fn
    from shardfn.transforms.remat import remat

    recomputed = remat(fn, policy)
    return lambda leaves, x: recomputed({n: leaves[n] for n in stage.names}, x)
