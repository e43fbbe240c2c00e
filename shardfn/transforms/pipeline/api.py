"""``pipeline_stages``: a sequence of units split into stages over the mesh's "pp" axis.

See docs/pipeline.md. The pieces: :mod:`.stage` (which units and leaves each
stage has), :mod:`.schedules` (the order of actions), :mod:`.runtime` (one rank
running its actions), :mod:`._p2p` (the messages between pp ranks).

Example:
    >>> pp = sf.pipeline_stages(nn.Sequential(a, b, c, d), mesh, axis="pp", balance=[2, 2],
    ...                         schedule="1f1b", microbatches=4,
    ...                         loss_fn=lambda out, tgt: F.mse_loss(out, tgt))
    >>> params = pp.init(0)                  # this rank's leaves only
    >>> loss, grads = pp.value_and_grad(params, x, y)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardfn import spec
from shardfn._functional_leaves import refuse_differentiated_state
from shardfn._torch_internals import get_interpreter_stack
from shardfn.functional import FunctionalModel, functional
from shardfn.mesh import Mesh
from shardfn.primitives import collectives
from shardfn.primitives._comm import resolve
from shardfn.transforms.pipeline._p2p import MessageBuffers, Messenger
from shardfn.transforms.pipeline.guard import CallGuard, agree_on_batch, check_batch, exclusive
from shardfn.transforms.pipeline.inference import run_forward
from shardfn.transforms.pipeline.runtime import StepPlan, run_step, settle_and_raise
from shardfn.transforms.pipeline.schedules import SCHEDULES, Schedule, make_schedule
from shardfn.transforms.pipeline.shapes import ShapeCache, parse_shapes, signature
from shardfn.transforms.pipeline.simulate import validate
from shardfn.transforms.pipeline.stage import (
    Stage,
    as_units,
    plan_stages,
    resolve_balance,
    stage_module,
)
from shardfn.transforms.shard_params import ShardedModel

__all__ = ["PipelineModel", "pipeline_stages"]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineModel:
    """A model split into pipeline stages; made by :func:`pipeline_stages`.

    Attributes:
        mesh: the mesh.
        axis: the pp axis name.
        plan: the step plan (stages, schedule, resolved axis, loss, forwards).
        dp_axis: the axis gradients and loss are averaged over after each step, or None.
        stage_models: this rank's stage index -> its ``stage_transform``-ed model
            (empty without a ``stage_transform``).
        infer_shapes: infer the boundary shapes once per batch signature (``shapes=None``).
        shape_cache: the inferred shapes (:class:`~.shapes.ShapeCache`).
        message_buffers: activation and gradient message buffers kept from one
            ``value_and_grad`` to the next (:class:`~._buffers.MessageBuffers`).
        call_guard: one call at a time (:class:`~.guard.CallGuard`: a second thread raises).
    """

    mesh: Mesh
    axis: str
    plan: StepPlan
    dp_axis: str | None
    stage_models: Mapping[int, Any]
    infer_shapes: bool = False
    shape_cache: ShapeCache = dataclasses.field(default_factory=ShapeCache, repr=False)
    message_buffers: MessageBuffers = dataclasses.field(default_factory=MessageBuffers,
                                                        repr=False)
    call_guard: CallGuard = dataclasses.field(default_factory=CallGuard, repr=False)

    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @property
    def _caches_shapes(self) -> bool:
        """Whether the first call per batch signature infers shapes: all (``shapes=None``),
        or with declared shapes the loss's and ``apply``'s outputs'; not ``"dynamic"``."""
        return self.infer_shapes or self.plan.declared is not None

    @property
    def full(self) -> FunctionalModel:
        """``sf.functional(nn.Sequential(*units))``: the unsplit model's names and init."""
        return self.plan.stages.full

    @property
    def rank(self) -> int:
        """This rank's index on the pp axis."""
        return self.plan.rank

    @property
    def stages(self) -> tuple[Stage, ...]:
        """This rank's stages (``virtual`` of them), in stage order."""
        return self.plan.stages.on_rank(self.rank)

    @property
    def names(self) -> tuple[str, ...]:
        """The leaves this rank holds, in full-tree order."""
        mine = {n for stage in self.stages for n in stage.names}
        return tuple(n for n in self.full.names if n in mine)

    @property
    def layout(self) -> dict[str, int]:
        """Every leaf of the full tree -> the pp axis index that holds it (for checkpoints)."""
        return self.plan.stages.layout()

    @property
    def specs(self) -> dict[str, Any]:
        """This rank's leaves -> their layout over the mesh (for ``sf.checkpoint`` and
        ``sf.gather``): the stage model's spec under a ``stage_transform``, else ``P()``
        (whole on this pp rank, the same on every rank of the other axes).

        Example:
            >>> sf.checkpoint.save(path, {"params": params}, mesh, {"params": pp})
        """
        found: dict[str, Any] = {}
        for model in self.stage_models.values():
            found.update(model.specs)
        return {name: found.get(name, spec.P()) for name in self.names}

    @property
    def balance(self) -> tuple[int, ...]:
        """Units per stage."""
        return tuple(len(stage.units) for stage in self.plan.stages.stages)

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's leaves, equal to the same leaves of ``self.full.init(seed)``.

        With a ``stage_transform`` each stage's model initialises its own leaves
        (``shard_params``: this rank's shards of them).

        Example:
            >>> sorted(pp.init(0)) == sorted(pp.names)
            True
        """
        if not self.stage_models:
            return self.plan.stages.init(seed, self.rank, device)
        leaves: Params = {}
        for model in self.stage_models.values():
            leaves.update(model.init(seed) if device is None else model.init(seed, device))
        return {name: leaves[name] for name in self.names}

    @exclusive
    def value_and_grad(self, params: Mapping[str, torch.Tensor], inputs: torch.Tensor,
                       targets: Any, *, report: bool = False, mutable: bool = False
                       ) -> tuple[Any, ...]:
        """One pipelined forward and backward over the whole batch.

        The batch is split on dim 0 into ``microbatches`` pieces (``torch.tensor_split``:
        sizes differ by at most one, unless ``shapes=`` was declared, which needs an
        even split). The loss of micro-batch ``i`` is scaled by its size over the
        batch, so with a ``loss_fn`` that is a mean over the micro-batch the total is
        the unsplit mean. Every pp rank passes the same ``inputs`` and ``targets``
        (only stage 0 reads the inputs' values, only the last stage the targets).

        Args:
            params: this rank's leaves (as from :meth:`init`).
            inputs: the batch's inputs (one tensor).
            targets: the batch's targets (a tensor split like ``inputs``, or None).
            report: also return the :class:`~.report.StepReport` (events, live graphs).
            mutable: also return this rank's buffers (BatchNorm statistics) after the
                step: each stage's forwards update them micro-batch by micro-batch, as
                ``sf.functional(nn.Sequential(*units)).apply(..., mutable=True)`` run on
                the micro-batches in order would (with ``dp_axis``: each replica's own).

        Returns:
            ``(loss, grads)``: the whole batch's loss, equal on every pp rank, and the
            gradients of this rank's trainable leaves; with ``dp_axis`` both are
            averaged over it. With ``mutable=True`` then the buffers
            (``{**params, **buffers}`` is the next step's tree); with ``report=True``
            last the report.

        Example:
            >>> loss, grads, buffers = pp.value_and_grad(params, x, y, mutable=True)

        Raises:
            ValueError: wrong leaves, a batch smaller than the micro-batch count, an
                uneven split with declared shapes, a stage error, or pp ranks given different
                batches (every rank raises). ConcurrentCallError: another thread's call.
        """
        _refuse_transforms("value_and_grad")
        if not isinstance(mutable, bool):
            raise TypeError(f"value_and_grad: mutable must be True or False, got {mutable!r}")
        if mutable and not self.plan.mutable_forwards:
            raise ValueError("pipeline value_and_grad(mutable=True) is not supported with "
                             "remat= (a recomputed forward would update the buffers again)")

        def prepare() -> Params:  # on every rank inside the step: a bad call stops them all
            agree_on_batch(self.plan.ax, inputs, targets, self.schedule.n_microbatches,
                           self.plan.device)
            self._check_params(params)
            self._check_batch(inputs, targets)
            refuse_differentiated_state(params, self.full.buffer_names, self.full.frozen_names,
                                        "pipeline value_and_grad")
            trainable = {n for stage in self.stages for n in stage.trainable}
            return {n: t.detach().requires_grad_(True) if n in trainable else t
                    for n, t in params.items()}

        key = signature(inputs, targets, self.schedule.n_microbatches) \
            if self._caches_shapes else None
        inferred = self.shape_cache.get(key)
        loss, grads, step_report = run_step(self.plan, prepare, inputs, targets, inferred,
                                            mutable, self.message_buffers)
        if inferred is None:
            self.shape_cache.put(key, step_report.shapes)
        if self.dp_axis is not None and self.stage_models:  # the transform reduced them
            loss = collectives.pmean(loss, self.dp_axis, mesh=self.mesh)
        elif self.dp_axis is not None:
            loss, grads = collectives.pmean((loss, grads), self.dp_axis, mesh=self.mesh)
        found = (loss, grads) + ((step_report.buffers,) if mutable else ())
        return found + (step_report,) if report else found

    @exclusive
    def apply(self, params: Mapping[str, torch.Tensor], inputs: torch.Tensor) -> Any:
        """Inference: the model's output for ``inputs``, on every pp rank (no graph).

        The batch runs through the stages in ``microbatches`` pieces; the last
        stage sends its outputs to every pp rank. The output is what the last stage
        returns: a tensor, or a tuple/list of tensors (each concatenated over the
        micro-batches on dim 0).
        """
        _refuse_transforms("apply")

        def prepare() -> Mapping[str, torch.Tensor]:
            agree_on_batch(self.plan.ax, inputs, None, self.schedule.n_microbatches,
                           self.plan.device, "apply")
            self._check_params(params)
            self._check_batch(inputs, None)
            return params

        key = signature(inputs, None, self.schedule.n_microbatches) if self._caches_shapes \
            else None
        inferred = self.shape_cache.get(key)
        out, shapes = run_forward(self.plan, prepare, inputs, inferred)
        if inferred is None:
            self.shape_cache.put(key, shapes)
        return out

    @exclusive
    def gather(self, params: Mapping[str, torch.Tensor]) -> Params:
        """The full tree (every stage's leaves) on every pp rank, in full-tree order.

        Example:
            >>> full = pp.gather(pp.init(0))
            >>> all(torch.equal(full[n], t) for n, t in pp.full.init(0).items())
            True
        """
        layout, names = self.layout, self.full.names
        ax, mine = self.plan.ax, self.rank
        messenger = Messenger(ax, lambda key: key[2], device=self.plan.device)
        owed = [(("leaf", 0, k), peer) for k, n in enumerate(names) if layout[n] == mine
                for peer in range(ax.size) if peer != mine]
        expected = [(("leaf", 0, k), layout[n]) for k, n in enumerate(names)
                    if layout[n] != mine]
        full: Params = {}
        try:
            self._check_params(params)
            params = self._full_stage_leaves(params)
            for index, name in enumerate(names):
                if layout[name] == mine:
                    for peer in range(ax.size):
                        if peer != mine:
                            messenger.send(("leaf", 0, index), peer, params[name])
            for index, name in enumerate(names):
                holder = layout[name]
                full[name] = params[name] if holder == mine else \
                    messenger.recv(("leaf", 0, index), holder)
            messenger.finish()
        except BaseException as error:  # the others stop too (error headers), then raise
            settle_and_raise(messenger, owed, expected, error, f"pipeline gather on pp rank "
                             f"{mine}")
        return full

    def _full_stage_leaves(self, params: Mapping[str, torch.Tensor]) -> Mapping[str, Any]:
        """This rank's leaves unsharded by each stage model's own gather (if transformed)."""
        if not self.stage_models:
            return params
        full: Params = {}
        for model in self.stage_models.values():
            mine = {n: params[n] for n in model.names}
            gather_params = getattr(model, "gather_params", None)
            full.update(gather_params(mine) if gather_params is not None
                        else spec.gather(mine, model.specs, model.mesh))
        return full

    def _check_params(self, params: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(f"pipeline params must be a dict of this rank's leaves, got "
                            f"{type(params).__name__}")
        names = set(self.names)
        missing = [n for n in self.names if n not in params]
        unexpected = sorted(n for n in params if n not in names)
        if missing or unexpected:
            others = [f"{n} (pp rank {self.layout[n]})" for n in unexpected if n in self.layout]
            raise ValueError(f"pipeline params on pp rank {self.rank}: missing {missing}, "
                             f"unexpected {unexpected}" +
                             (f"; held by other ranks: {others}" if others else "") +
                             "; pass this rank's leaves (pp.init(seed))")

    def _check_batch(self, inputs: Any, targets: Any) -> None:
        check_batch(inputs, targets, self.schedule.n_microbatches, self.plan.declared is not None)


def _refuse_transforms(what: str) -> None:
    if get_interpreter_stack():
        raise RuntimeError(f"pipeline {what} runs a whole pipelined step with its own autograd "
                           "and messages between ranks; it cannot run under torch.func "
                           "transforms (grad, vmap, ...): call it directly")


def pipeline_stages(model: nn.Sequential | Sequence[nn.Module], mesh: Mesh, axis: str = "pp",
                    *, balance: Sequence[int] | str | None = None, schedule: str = "1f1b",
                    microbatches: int, loss_fn: Callable[[Any, Any], torch.Tensor],
                    virtual: int = 1, shapes: Any = None, remat: Callable | None = None,
                    dp_axis: str | None = None, sample: Any = None,
                    stage_transform: Callable[[FunctionalModel, Mesh], Any] | None = None
                    ) -> PipelineModel:
    """Split ``model``'s units into pipeline stages over ``axis`` and run them by ``schedule``.

    Stage ``s`` holds ``balance[s]`` consecutive units and lives on pp rank ``s % p``
    (``p * virtual`` stages, looped). Only activations (forward) and their
    gradients (backward) travel between neighbouring stages, point to point.

    Memory per rank: its stages' parameters and gradients, plus the activations
    of the micro-batches in flight (GPipe: all ``m``; 1F1B: at most ``p`` per
    stage). Communication per step: each stage boundary sends one activation
    and one gradient per micro-batch; the loss is sent to every pp rank.

    Args:
        model: an ``nn.Sequential`` or a list of modules (the units).
        mesh: the mesh; ``axis`` must be one of its axes.
        axis: the pipeline axis.
        balance: units per stage (``p * virtual`` positive counts summing to the
            number of units), or ``"params"`` / ``"time"`` (by parameter count /
            measured time; ``sample`` is the input to time with).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``
            (:data:`~.schedules.SCHEDULES`).
        microbatches: micro-batches per step ``m``.
        loss_fn: ``loss_fn(out, targets) -> scalar``, a mean over the micro-batch.
        virtual: stages per rank (interleaved schedules).
        shapes: None (default): inferred at the first call for each batch signature
            (headers first), then declared from the cache; ``"dynamic"``: a shape
            header before every payload, always; or the declared per-micro-batch
            output shapes of the stages (one shape, ``(shape, dtype)`` or
            ``sf.ShapeDtype`` for every boundary, or one per boundary, a tuple of them
            for a tuple output). A stage output that differs from the declared or
            inferred shapes raises on the sending rank, and every rank stops.
        remat: a remat policy (``sf.checkpoint_policies.*``): each stage's forward
            runs under ``sf.remat`` (activations recomputed in backward).
        dp_axis: average the gradients and the loss over this axis once per step
            (pp x dp: each dp replica passes its own batch).
        sample: the input ``balance="time"`` times the units with.
        stage_transform: ``fn(stage_fmodel, stage_mesh) -> model`` applied to each stage
            of this rank: ``stage_fmodel`` is ``sf.functional`` of its units (leaves named
            as in the full tree), ``stage_mesh`` the mesh without the pp axis (this
            rank's slice: the stage's replicas). E.g.
            ``lambda f, m: sf.shard_params(f, m, "dp")`` (ZeRO-3 inside a stage) or
            ``lambda f, m: sf.tensor_split(f, m, "tp", plan)``. The model must have
            ``init``, ``apply``, ``names`` and ``specs`` (``gather_params`` if
            ``sf.gather`` cannot rebuild its leaves). Its gradients are its own: with
            ``dp_axis`` only the loss is averaged (``shard_params`` reduces over its axis).

    Returns:
        The :class:`PipelineModel`.

    Raises:
        ValueError: an unknown schedule or axis, a bad balance, bad ``shapes``.
        NotImplementedError: a schedule that is not written yet.

    Example:
        >>> pp = sf.pipeline_stages([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)],
        ...                         sf.Mesh({"pp": 2}), balance=[2, 1], schedule="gpipe",
        ...                         microbatches=2, loss_fn=lambda o, t: ((o - t) ** 2).mean())
        >>> loss, grads = pp.value_and_grad(pp.init(0), torch.randn(4, 4), torch.randn(4, 1))
    """
    units = as_units(model)
    if schedule not in SCHEDULES:
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
    ax = resolve(axis, mesh)
    n_stages = ax.size * virtual
    counts = resolve_balance(balance, units, n_stages, sample, mesh)
    plan = make_schedule(schedule, ax.size, microbatches, virtual)
    validate(plan)  # a malformed schedule would hang: refuse it here
    stage_plan = plan_stages(units, counts, ax.size)
    models = {}
    if stage_transform is not None:
        if remat is not None:
            raise ValueError("pipeline_stages: remat= and stage_transform= together: give the "
                             "transform its own remat (sf.shard_params(..., remat=policy))")
        others = [a for a in mesh.axis_names if a != axis]
        if not others:
            raise ValueError("pipeline_stages: stage_transform needs a mesh axis besides "
                             f"{axis!r} to work over (e.g. {{'pp': 2, 'dp': 2}})")
        stage_mesh = mesh.submesh(others)
        models = {stage.index: stage_transform(functional(stage_module(units, stage)),
                                               stage_mesh)
                  for stage in stage_plan.on_rank(ax.index)}
        if plan.split_backward and any(isinstance(m, ShardedModel) for m in models.values()):
            raise ValueError(f"pipeline_stages: schedule {schedule!r} splits backward (B, then "
                             "W through the same graph), but shard_params frees a stage's "
                             "graph after one backward: use 'gpipe', '1f1b' or 'interleaved'")
    forwards = tuple(_transformed_forward(models[stage.index]) if stage.index in models
                     else _stage_forward(stage_plan, stage, remat)
                     for stage in stage_plan.stages)
    plain = tuple(remat is None and stage.index not in models for stage in stage_plan.stages)
    mutable_forwards = () if remat is not None else tuple(
        _transformed_forward(models[stage.index], mutable=True) if stage.index in models
        else functools.partial(stage_plan.forward_mutable, stage) for stage in stage_plan.stages)
    step = StepPlan(stage_plan, plan, ax, loss_fn, forwards, parse_shapes(shapes, n_stages - 1),
                    plain, mesh.device, mutable_forwards)
    return PipelineModel(mesh, axis, step, dp_axis, models, infer_shapes=shapes is None)


def _transformed_forward(model: Any, mutable: bool = False):
    if mutable:
        return lambda leaves, x: model.apply({n: leaves[n] for n in model.names}, x,
                                             mutable=True)
    return lambda leaves, x: model.apply({n: leaves[n] for n in model.names}, x)


def _stage_forward(stage_plan, stage: Stage, policy: Callable | None):
    fn = stage_plan.stage_forward(stage)
    if policy is None:
        return fn
    from shardfn.transforms.remat import remat

    recomputed = remat(fn, policy)
    return lambda leaves, x: recomputed({n: leaves[n] for n in stage.names}, x)
