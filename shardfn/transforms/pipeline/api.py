"""``pipeline_stages``: a model's stages placed over the mesh's "pp" axis, run by a schedule.

See docs/pipeline.md. The pieces: :mod:`.split` (``pipeline_split``: the stage
models), :mod:`.stage` (which units and leaves each stage has),
:mod:`.pipeline_model` (the :class:`~.pipeline_model.PipelineModel` it returns),
:mod:`.schedules` (the order of actions), :mod:`.runtime` (one rank running its
actions), :mod:`._p2p` (the messages between pp ranks).

Composition by type (docs/composing.md): the stages are models of their own. Split,
transform each stage, pipeline the stage models; ``stage_transform=fn`` is that, in
one call. A pipeline is never a stage, and no model transform takes a pipeline.

Example:
    >>> pp = sf.pipeline_stages(nn.Sequential(a, b, c, d), mesh, axis="pp", balance=[2, 2],
    ...                         schedule="1f1b", microbatches=4,
    ...                         loss_fn=lambda out, tgt: F.mse_loss(out, tgt))
    >>> params = pp.init(0)                  # this rank's leaves only
    >>> loss, grads = pp.value_and_grad(params, x, y)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.primitives._comm import resolve
from shardfn.transforms._fsdp_tp import FsdpTpModel
from shardfn.transforms._pp_ep import check_expert_stages, reduced_axes
from shardfn.transforms.pipeline.balance import BalanceBy
from shardfn.transforms.pipeline.forwards import step_plan
from shardfn.transforms.pipeline.hf_units import (
    HFPipelineModel,
    hf_loss,
    hf_units,
    is_pretrained,
)
from shardfn.transforms.pipeline.pipeline_model import PipelineModel
from shardfn.transforms.pipeline.schedules import SCHEDULES, Schedule, ScheduleName
from shardfn.transforms.pipeline.shapes import parse_shapes
from shardfn.transforms.pipeline.split import PipelineSplit, find_split, pipeline_split
from shardfn.transforms.pipeline.stage import ModelUnits, model_units, resolve_balance
from shardfn.transforms.pipeline.tied_model import TiedPipelineModel
from shardfn.transforms.pipeline.ties import tied_local_shapes
from shardfn.transforms.pipeline.written import resolve_schedule
from shardfn.transforms.precision import takes_precision
from shardfn.transforms.shard_params import ShardedModel

__all__ = ["PipelineModel", "pipeline_stages"]


def pipeline_stages(model: nn.Sequential | Sequence[nn.Module] | Sequence[Any], mesh: Mesh,
                    axis: str = "pp", *, balance: Sequence[int] | BalanceBy | None = None,
                    schedule: ScheduleName | Schedule = "1f1b", microbatches: int,
                    loss_fn: Callable[[Any, Any], torch.Tensor] | str | None = None,
                    virtual: int = 1, shapes: Any = None, remat: Callable | None = None,
                    dp_axis: str | None = None, sample: Any = None,
                    stage_transform: Callable[[FunctionalModel, Mesh], Any] | None = None
                    ) -> PipelineModel:
    """Place a model's stages on the ranks of ``axis`` and run them by ``schedule``.

    Stage ``s`` lives on pp rank ``s % p`` (``p * virtual`` stages, looped; ``"zbv"`` and a
    written schedule place them by their ``placement``). Only
    activations (forward) and their gradients (backward) travel between
    neighbouring stages, point to point.

    Memory per rank: its stages' parameters and gradients, plus the activations
    of the micro-batches in flight (GPipe: all ``m``; 1F1B: at most ``p`` per
    stage). Communication per step: each stage boundary sends one activation
    and one gradient per micro-batch; the loss is sent to every pp rank.

    Args:
        model: the units (an ``nn.Sequential`` or a list of modules), split by
            ``balance``; or the stage models, one per stage (``p * virtual``), in stage
            order: ``sf.pipeline_split(units, balance)`` or a model built from each of
            its entries (``sf.shard_params``, ``sf.tensor_split``, FSDP x TP,
            ``sf.with_precision``, ``sf.remat``), over ``mesh.submesh([...])`` without
            ``axis`` (this rank's slice). A stage model's gradients are its own:
            ``dp_axis`` does not average them again where it reduces over that axis
            (``shard_params``). Or a Hugging Face model (``PreTrainedModel``: a decoder,
            or BERT): cut into units keeping its leaf names (:func:`~.hf_units.hf_units`;
            the result is an :class:`~.hf_units.HFPipelineModel` taking HF's
            ``input_ids``, ``attention_mask``, ``position_ids``, ``token_type_ids``,
            ``labels``); or
            :class:`~.stage.ModelUnits` (units cut from a model, keeping its names).
            Weights tied across units (an embedding and its head) are held by every stage
            using them, their gradients summed between those ranks (:mod:`.ties`). Stage
            models of these (``stage_transform=``, or ``sf.pipeline_split(hf_model,
            balance)``'s stages transformed) are named, initialised and planned like the
            model (:mod:`.named_stage`: PP x FSDP, ``tensor_split(plan="auto")``); a tied
            weight must be laid out alike by every stage holding it (else refused).
        mesh: the mesh; ``axis`` must be one of its axes.
        axis: the pipeline axis.
        balance: with units: units per stage (``p * virtual`` positive counts summing to
            the number of units), or ``"params"`` / ``"time"`` (by parameter count /
            measured time; ``sample`` is the input to time with). With stage models:
            None, or their split's.
        schedule: a name of :data:`~.schedules.SCHEDULES` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved"``, ``"zb-h1"``, ``"interleaved_zb"``, ``"zbv"``), or a
            :class:`~.schedules.Schedule` (``schedule_from_actions``) whose ranks,
            micro-batches and ``virtual`` match; its placement says where stages live.
        microbatches: micro-batches per step ``m``.
        loss_fn: ``loss_fn(out, targets) -> scalar``, a mean over the micro-batch. For a
            Hugging Face model also ``"causal_lm"`` (the default for a decoder), ``"masked_lm"``
            or ``"sequence_classification"`` (BERT's heads): the model's own
            ``loss_function`` over the whole batch's tokens (HF's loss, with padding too).
        virtual: stages per rank (interleaved schedules).
        shapes: None (default): inferred at the first call for each batch signature
            (headers first), then declared from the cache; ``"dynamic"``: a shape
            header before every payload, always; or the declared per-micro-batch
            output shapes of the stages (one shape, ``(shape, dtype)`` or
            ``sf.ShapeDtype`` for every boundary, or one per boundary, a tuple of them
            for a tuple output). A stage output that differs from the declared or
            inferred shapes raises on the sending rank, and every rank stops.
        remat: a remat policy (``sf.checkpoint_policies.*``): each plain stage's forward
            runs under ``sf.remat`` (for stage models: ``sf.remat(stage, policy)`` or
            their own ``remat=``).
        dp_axis: average the loss and the gradients over this axis once per step
            (pp x dp: each dp replica passes its own batch).
        sample: the input ``balance="time"`` times the units with.
        stage_transform: sugar: ``fn(stage_fmodel, stage_mesh) -> model`` makes the stage
            models, ``pipeline_stages([fn(s, mesh.submesh(others)) for s in
            sf.pipeline_split(units, balance)], mesh, axis, ...)`` (``others``: the axes
            but ``axis``).

    Returns:
        The :class:`~.pipeline_model.PipelineModel`.

    Raises:
        ValueError: an unknown schedule or axis, a bad balance, bad ``shapes``; stage
            models that are not one split's stages in order, or whose mesh is not this
            rank's slice without ``axis``; a tied weight whose holding stages lay it out
            differently (naming the leaf and both layouts).
        TypeError: a stage model that is a pipeline (a pipeline is never a stage).

    Example:
        >>> split = sf.pipeline_split(units, balance=[2, 3])
        >>> stages = [sf.shard_params(s, mesh.submesh(["dp"]), "dp") for s in split]
        >>> pp = sf.pipeline_stages(stages, mesh, "pp", schedule="1f1b", microbatches=4,
        ...                         loss_fn=mse, dp_axis="dp")
        >>> loss, grads = pp.value_and_grad(pp.init(0), x, y)
        >>> pp = sf.pipeline_stages(llama, mesh, "pp", balance=[2, 2], microbatches=4,
        ...                         dp_axis="dp",   # PP x FSDP, torchtitan's Llama recipe
        ...                         stage_transform=lambda s, m: sf.shard_params(s, m, "dp"))
    """
    pretrained = is_pretrained(model)
    given = None if pretrained or isinstance(model, ModelUnits) else _stage_models_given(model)
    split = None if given is None else find_split(given)
    hf = pretrained or (split is not None and split.hf)  # stage models cut from a HF model
    if hf:
        loss_fn, counts_tokens = _hf_loss(model if pretrained else split.full.module, loss_fn)
    _check_options(mesh, axis, schedule, microbatches, virtual, dp_axis, loss_fn)
    ax = resolve(axis, mesh)
    n_stages = ax.size * virtual
    if given is None:
        units = hf_units(model) if pretrained else model_units(model)
        split = pipeline_split(model if pretrained else units,  # HF: cut again, same units
                               resolve_balance(balance, units.units, n_stages, sample, mesh),
                               n_stages=n_stages)
        if stage_transform is None:
            given = tuple(split)
        else:  # the sugar: transform each stage, then the stage-models path below
            if remat is not None:
                raise ValueError("pipeline_stages: remat= and stage_transform= together: give "
                                 "the transform its own remat (sf.remat(stage, policy), or "
                                 "sf.shard_params(..., remat=policy))")
            given = tuple(stage_transform(s, _stage_mesh(mesh, axis)) for s in split)
    elif stage_transform is not None:
        raise ValueError("pipeline_stages: stage_transform= with stage models: transform the "
                         "stages yourself ([fn(s, stage_mesh) for s in split]) or pass the "
                         "units with stage_transform=")
    split = find_split(given)
    if balance is not None and not isinstance(balance, str) and \
            tuple(balance) != split.balance:
        raise ValueError(f"pipeline_stages: balance={list(balance)}, but the stage models "
                         f"are a split with balance {list(split.balance)}: leave balance= out")
    built = _build(split, given, mesh, axis, ax, schedule, microbatches, loss_fn, virtual,
                   shapes, remat, dp_axis)
    if hf:
        return HFPipelineModel(*_fields(built), counts_tokens=counts_tokens)
    if split.named_by_root or split.tied_across():
        return TiedPipelineModel(*_fields(built))
    return built


def _fields(model: PipelineModel) -> list[Any]:
    return [getattr(model, f.name) for f in dataclasses.fields(PipelineModel)]


def _hf_loss(model: nn.Module, loss_fn: Any) -> tuple[Callable, Any]:
    """A Hugging Face model's ``loss_fn``: by default its own loss over the whole batch
    (``"causal_lm"``, ``"masked_lm"``, ``"sequence_classification"``; labels packed with
    the token count); a callable is used as given (:func:`~.hf_batch.hf_loss`)."""
    return hf_loss(model, loss_fn)


def _build(split: PipelineSplit, given: Sequence[Any], mesh: Mesh, axis: str, ax: Any,
           schedule: Any, microbatches: int, loss_fn: Callable, virtual: int, shapes: Any,
           remat: Callable | None, dp_axis: str | None) -> PipelineModel:
    """The pipeline of ``split``'s stages, stage ``s`` computed by ``given[s]``."""
    n_stages = ax.size * virtual
    if len(split) != n_stages:
        raise ValueError(f"pipeline_stages: {len(split)} stage models (balance "
                         f"{list(split.balance)}), but the pipeline has {n_stages} stages "
                         f"(pp size {ax.size} x virtual {virtual}): split into {n_stages}")
    transformed = {s: m for s, m in enumerate(given) if m is not split[s]}
    for index, stage_model in transformed.items():
        _check_stage_model(index, stage_model, mesh, axis)
    check_expert_stages(transformed, dp_axis)  # pp x ep: dp_axis is the ep axis (_pp_ep)
    if remat is not None and transformed:
        raise ValueError(f"pipeline_stages: remat= applies to plain stages; stages "
                         f"{sorted(transformed)} are models of their own: give them their "
                         "remat (sf.remat(stage, policy), or sf.shard_params(..., "
                         "remat=policy))")
    plan = resolve_schedule(schedule, ax.size, microbatches, virtual)  # validated: no hang
    if plan.split_backward:
        sharded = [s for s, m in transformed.items() if _sharded(m) is not None]
        if sharded:
            raise ValueError(f"pipeline_stages: schedule {plan.name!r} splits backward (B, "
                             "then W through the same graph), but shard_params frees a "
                             f"stage's graph after one backward (stages {sharded}): use "
                             "'gpipe', '1f1b' or 'interleaved'")
    shapes_of_ties = tied_local_shapes(split.tied_across(), given, _reduced_axes)
    stage_plan = dataclasses.replace(split.plan(ax.size).placed(plan.rank_of),
                                     tied_shapes=shapes_of_ties)
    mine = {stage.index for stage in stage_plan.on_rank(ax.index)}
    models = {s: m for s, m in transformed.items() if s in mine}
    reduced = {s: _reduced_axes(m) for s, m in models.items()}
    step = step_plan(stage_plan, models, plan, ax, loss_fn, parse_shapes(shapes, n_stages - 1),
                     remat, mesh.device)
    return PipelineModel(mesh, axis, step, dp_axis, models, reduced, remat,
                         infer_shapes=shapes is None)


def _check_options(mesh: Mesh, axis: str, schedule: str | Schedule, microbatches: int, virtual: int,
                   dp_axis: str | None, loss_fn: Any) -> None:
    if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {sorted(SCHEDULES)}")
    for name, value in (("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline_stages: {name} must be an int >= 1, got {value!r}")
    if axis not in mesh.axis_names:
        raise ValueError(f"pipeline_stages: axis {axis!r} is not in the mesh "
                         f"{dict(zip(mesh.axis_names, mesh.shape, strict=True))}")
    if dp_axis is not None and dp_axis not in mesh.axis_names:
        raise ValueError(f"pipeline_stages: dp_axis {dp_axis!r} is not in the mesh")
    if not callable(loss_fn):
        raise TypeError("pipeline_stages: loss_fn must be callable(out, targets) -> scalar")


def _stage_models_given(model: Any) -> tuple[Any, ...] | None:
    """The stage models, if ``model`` is a sequence of them (None: units)."""
    if isinstance(model, PipelineSplit):
        return tuple(model)
    if isinstance(model, nn.Module) or not isinstance(model, (list, tuple)):
        if isinstance(model, PipelineModel):
            raise TypeError("pipeline_stages: the model is a PipelineModel; a pipeline is "
                            "not pipelined again. Give the units, or the stage models: "
                            "pipeline_stages([transform(s) for s in sf.pipeline_split(units, "
                            "balance)], mesh, 'pp', ...)")
        return None  # units (as_units says what else is wrong)
    modules = [isinstance(entry, nn.Module) for entry in model]
    if all(modules):
        return None
    if any(modules):
        first = modules.index(True)
        raise TypeError(f"pipeline_stages: entry {first} is an nn.Module but entry "
                        f"{modules.index(False)} is a {type(model[modules.index(False)]).__name__}"
                        ": give the units (modules) or the stage models, not both")
    return tuple(model)


def _stage_mesh(mesh: Mesh, axis: str) -> Mesh:
    others = [a for a in mesh.axis_names if a != axis]
    if not others:
        raise ValueError("pipeline_stages: stage_transform needs a mesh axis besides "
                         f"{axis!r} to work over (e.g. {{'pp': 2, 'dp': 2}})")
    return mesh.submesh(others)


def _check_stage_model(index: int, model: Any, mesh: Mesh, axis: str) -> None:
    """A stage model's mesh is this rank's slice of ``mesh`` over axes other than ``axis``."""
    stage_mesh = getattr(model, "mesh", None)
    if stage_mesh is None:
        return
    names = tuple(stage_mesh.axis_names)
    if axis in names:
        raise ValueError(f"pipeline_stages: stage model {index} is over a mesh with the "
                         f"pipeline axis {axis!r} ({stage_mesh!r}); build stage models over "
                         f"this rank's slice without it: mesh.submesh("
                         f"{[a for a in mesh.axis_names if a != axis]})")
    if not set(names) <= set(mesh.axis_names) or stage_mesh != mesh.submesh(names):
        raise ValueError(f"pipeline_stages: stage model {index} is over {stage_mesh!r}, not "
                         f"this rank's slice of the pipeline's {mesh!r}: build it over "
                         f"mesh.submesh({list(names)})")


def _sharded(model: Any) -> ShardedModel | None:
    """The ``shard_params`` model inside a stage model (under precision/remat wrappers,
    FSDP x TP), or None."""
    for _ in range(8):
        if isinstance(model, FsdpTpModel):
            model = model.sharded
        if isinstance(model, ShardedModel):
            return model
        model = getattr(model, "inner", None)
        if model is None:
            return None
    return None


def _reduced_axes(model: Any) -> tuple[str, ...]:
    """The mesh axes a stage model reduces its gradients over (``shard_params``: its axis
    and ``replicate_axis``; ``expert_parallel``: its ep axis); ``dp_axis`` does not average
    those gradients again."""
    sharded = _sharded(model)
    if sharded is None:
        return reduced_axes(model)  # an expert_parallel stage: its ep axis (_pp_ep)
    axes: tuple[str, ...] = ()
    for value in (sharded.axis, sharded.replicate_axis):
        if value is not None:
            axes += (value,) if isinstance(value, str) else tuple(value)
    return axes


def _refuse_precision(model: PipelineModel, policy: Any) -> Any:
    raise ValueError(f"with_precision over a PipelineModel: its step is value_and_grad, which "
                     f"a precision wrapper cannot reach. Apply the policy to each stage: "
                     f"pipeline_stages([sf.with_precision(s, {policy}) for s in "
                     f"sf.pipeline_split(units, balance)], mesh, 'pp', ...)")


takes_precision(PipelineModel, lambda model: None, _refuse_precision)
