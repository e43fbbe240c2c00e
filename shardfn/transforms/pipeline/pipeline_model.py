"""``PipelineModel``: the model ``pipeline_stages`` builds, a member of the model protocol.

Its tree is this rank's leaves: those of the stages it holds (each stage model's
local leaves when stages are transformed, e.g. ZeRO-3 shards). Besides the protocol
members (:mod:`shardfn.model`) it runs a whole pipelined training step,
``value_and_grad``, since its backward is the schedule's, not autograd's over ``apply``.

Example:
    >>> pp = sf.pipeline_stages(units, mesh, balance=[2, 2], microbatches=4, loss_fn=mse)
    >>> params = pp.init(0)                          # this rank's leaves
    >>> loss, grads = pp.value_and_grad(params, x, y)
    >>> full_grads = pp.gather(grads)                # every stage's, on every pp rank
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardfn import spec
from shardfn._functional_leaves import refuse_differentiated_state
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.primitives import collectives
from shardfn.primitives.reduced import mark_held
from shardfn.transforms.pipeline._buffers import MessageBuffers
from shardfn.transforms.pipeline.batch import StageReads, as_unit_inputs, check_batch
from shardfn.transforms.pipeline.caches import caches_of
from shardfn.transforms.pipeline.forwards import step_plan
from shardfn.transforms.pipeline.guard import (
    CallGuard,
    agree_on_step,
    check_leaves,
    exclusive,
    plan_reads,
    refuse_transforms,
)
from shardfn.transforms.pipeline.inference import run_forward
from shardfn.transforms.pipeline.leaves import CLIP_HELD, gather_over_pp, stage_gather, stage_shard
from shardfn.transforms.pipeline.runtime import StepPlan, run_step
from shardfn.transforms.pipeline.schedules import Schedule
from shardfn.transforms.pipeline.shapes import ShapeCache, cache_key
from shardfn.transforms.pipeline.stage import Stage

__all__ = ["PipelineModel"]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineModel:
    """A model split into pipeline stages; made by :func:`~.api.pipeline_stages`.

    Attributes:
        mesh: the mesh.
        axis: the pp axis name.
        plan: the step plan (stages, schedule, resolved axis, loss, forwards).
        dp_axis: the axis the loss (and the gradients no stage model reduces) are
            averaged over after each step, or None.
        stage_models: this rank's stage index -> its stage model, for the stages that
            are transformed (a stage given as the split's FunctionalModel runs its units).
        reduced_axes: this rank's stage index -> the mesh axes its stage model already
            reduces its gradients over (``shard_params``' axis): ``dp_axis`` skips them.
        remat: the remat policy of the plain stages, or None.
        infer_shapes: infer the boundary shapes once per batch signature (``shapes=None``).

    The model is frozen: what its calls keep from call to call (:attr:`shape_cache`,
    :attr:`message_buffers`, :attr:`call_guard`) is its :class:`~.caches.Caches` record in
    this process, outside it (:mod:`.caches`; a new object, as ``eval()``'s, starts empty).
    """

    mesh: Mesh
    axis: str
    plan: StepPlan
    dp_axis: str | None
    stage_models: Mapping[int, Any]
    reduced_axes: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    remat: Callable | None = None
    infer_shapes: bool = False

    # ------------------------------------------------------------------ what it is
    @property
    def shape_cache(self) -> ShapeCache:
        """The boundary shapes inferred per batch signature (:mod:`.caches`)."""
        return caches_of(self).shapes

    @property
    def message_buffers(self) -> MessageBuffers:
        """The message buffers kept from one step to the next (:mod:`.caches`)."""
        return caches_of(self).buffers

    @property
    def call_guard(self) -> CallGuard:
        """One call of this model at a time (:mod:`.caches`)."""
        return caches_of(self).guard

    @property
    def functional(self) -> FunctionalModel:
        """``sf.functional(nn.Sequential(*units))``: the unsplit model this one computes."""
        return self.plan.stages.full

    @property
    def full(self) -> FunctionalModel:
        """Same as :attr:`functional` (its older name)."""
        return self.plan.stages.full

    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @property
    def rank(self) -> int:
        """This rank's index on the pp axis."""
        return self.plan.rank

    @property
    def stages(self) -> tuple[Stage, ...]:
        """This rank's stages (``virtual`` of them), in stage order."""
        return self.plan.stages.on_rank(self.rank)

    @property
    def balance(self) -> tuple[int, ...]:
        """Units per stage."""
        return tuple(len(stage.units) for stage in self.plan.stages.stages)

    @property
    def layout(self) -> dict[str, int]:
        """Every leaf of the full tree -> the pp axis index that holds it (for checkpoints)."""
        return self.plan.stages.layout()

    @property
    def names(self) -> tuple[str, ...]:
        """The leaves this rank holds, in full-tree order."""
        return self._mine(self.functional.names)

    @property
    def param_names(self) -> tuple[str, ...]:
        """This rank's parameters (trainable and frozen)."""
        return self._mine(self.functional.param_names)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """This rank's buffers."""
        return self._mine(self.functional.buffer_names)

    @property
    def trainable_names(self) -> tuple[str, ...]:
        """This rank's trainable parameters (what ``value_and_grad`` returns gradients of)."""
        return self._mine(self.functional.trainable_names)

    @property
    def frozen_names(self) -> tuple[str, ...]:
        """This rank's frozen parameters."""
        return self._mine(self.functional.frozen_names)

    @property
    def specs(self) -> dict[str, Any]:
        """This rank's leaves -> their layout over the mesh (for ``sf.checkpoint`` and
        ``sf.gather`` of this rank's leaves): the stage model's spec for a transformed
        stage, else ``P()`` (whole on this pp rank, the same on the other axes).

        Example:
            >>> sf.checkpoint.save(path, {"params": params}, mesh, {"params": pp})
        """
        found: dict[str, Any] = {}
        for model in self.stage_models.values():
            found.update(model.specs)
        return {name: found.get(name, spec.P()) for name in self.names}

    @property
    def reads(self) -> StageReads:
        """What this pp rank reads of a batch (:func:`~.guard.plan_reads`): it may pass None
        for the rest; ``sf.data.loader(..., reads=pp.reads)`` loads only these."""
        return plan_reads(self.plan)[self.rank]

    def _mine(self, names: tuple[str, ...]) -> tuple[str, ...]:
        held = {n for stage in self.stages for n in stage.names}
        return tuple(n for n in names if n in held)

    # ------------------------------------------------------------------ trees
    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's leaves, equal to ``self.shard(self.functional.init(seed))``.

        A transformed stage's model initialises its own leaves (``shard_params``: this
        rank's shards of them); the others build only their stages' leaves.

        Example:
            >>> sorted(pp.init(0)) == sorted(pp.names)
            True
        """
        plain = [str(unit) for stage in self.stages if stage.index not in self.stage_models
                 for unit in stage.units]
        leaves = self.functional.init_subset(seed, plain, device=device, recurse=True) \
            if plain else {}
        for model in self.stage_models.values():
            leaves.update(model.init(seed) if device is None else model.init(seed, device))
        return {name: leaves[name] for name in self.names}

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """This rank's leaves of full leaves, any subset (parameters, gradients, the
        trainable part); leaves of other pp ranks' stages are left out. No communication.

        Args:
            tree: ``name -> full leaf`` for any leaves of ``functional``.

        Returns:
            ``name -> this rank's leaf`` (a stage model's shard for a transformed stage),
            in ``names`` order.

        Raises:
            ValueError / TypeError: a name that is not a leaf, or a leaf that is not full.

        Example:
            >>> pp.shard(pp.functional.init(0)).keys() == pp.init(0).keys()
            True
        """
        checked = self.functional.shard(dict(tree))  # names and full shapes
        mine = {n: t for n, t in checked.items() if n in set(self.names)}
        for model in self.stage_models.values():
            mine.update(stage_shard(model, {n: mine[n] for n in model.names if n in mine}))
        return {n: mine[n] for n in self.names if n in mine}

    @exclusive
    def gather(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves of every pp rank's leaves, on every pp rank, in full-tree order.

        Each rank passes any subset of its own leaves (its parameters, its gradient
        tree, its trainable part); every pp rank returns the union. Transformed stages
        first rebuild their full leaves with the stage model's ``gather`` (the ranks of a
        stage's mesh pass the same names). Not differentiable across pp ranks (point to
        point messages).

        Example:
            >>> full = pp.gather(pp.init(0))
            >>> all(torch.equal(full[n], t) for n, t in pp.functional.init(0).items())
            True
            >>> loss, grads = pp.value_and_grad(params, x, y)
            >>> full_grads = pp.gather(grads)        # the trainable leaves of every stage
        """
        def local_full() -> Params:
            self._check_params(tree, subset=True)
            full = dict(tree)
            for model in self.stage_models.values():
                full.update(stage_gather(model, {n: tree[n] for n in model.names if n in tree}))
            return full

        return gather_over_pp(self.plan.ax, self.plan.device, self.functional.names,
                              self.layout, local_full)

    def params_from(self, module: nn.Module | list[nn.Module]) -> Params:
        """This rank's leaves of a materialised model's values (through each stage model's
        ``shard``): ``self.shard(self.functional.params_from(module))``.

        Args:
            module: the model (an ``nn.Sequential`` of the units, or the list of units).

        Example:
            >>> params = pp.params_from(nn.Sequential(*units))
        """
        if isinstance(module, (list, tuple)):
            module = nn.Sequential(*module)
        return self.shard(self.functional.params_from(module))

    def split_trainable(self, params: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """``(trainable, rest)`` of this rank's leaves (rest: buffers and frozen parameters).

        Example:
            >>> trainable, rest = pp.split_trainable(pp.init(0))
        """
        self._check_params(params)
        trainable = set(self.trainable_names)
        return ({n: params[n] for n in self.names if n in trainable},
                {n: params[n] for n in self.names if n not in trainable})

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        """Inverse of :meth:`split_trainable`: one dict in ``names`` order (names checked).

        Example:
            >>> pp.merge(*pp.split_trainable(params)).keys() == params.keys()
            True
        """
        overlap = sorted(set(trainable) & set(rest))
        if overlap:
            raise ValueError(f"pipeline merge: names present in both trainable and rest: "
                             f"{overlap}")
        both = {**rest, **trainable}
        self._check_params(both, subset=True)
        return {n: both[n] for n in self.names if n in both}

    # ------------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> PipelineModel:
        """A copy whose stages (units and stage models) are in training (or eval) mode.

        ``self`` is unchanged; the copy keeps no shape cache or message buffers of it.

        Example:
            >>> out = pp.eval().apply(params, x)        # Dropout off, BatchNorm statistics
        """
        stage_plan = self.plan.stages.train(mode)
        models = {index: model.train(mode) for index, model in self.stage_models.items()}
        plan = step_plan(stage_plan, models, self.plan.schedule, self.plan.ax,
                         self.plan.loss_fn, self.plan.declared, self.remat, self.plan.device)
        return PipelineModel(self.mesh, self.axis, plan, self.dp_axis, models,
                             self.reduced_axes, self.remat, self.infer_shapes)

    def eval(self) -> PipelineModel:
        """Same as ``train(False)``."""
        return self.train(False)

    # ------------------------------------------------------------------ running
    @property
    def _caches_shapes(self) -> bool:
        """Whether the first call per batch signature infers shapes: all (``shapes=None``),
        or with declared shapes the loss's and ``apply``'s outputs'; not ``"dynamic"``."""
        return self.infer_shapes or self.plan.declared is not None

    @exclusive
    def value_and_grad(self, params: Mapping[str, torch.Tensor], inputs: Any,
                       targets: Any, *, report: bool = False, mutable: bool = False
                       ) -> tuple[Any, ...]:
        """One pipelined forward and backward over the whole batch.

        The batch is split on dim 0 into ``microbatches`` pieces (``torch.tensor_split``:
        sizes differ by at most one, unless ``shapes=`` was declared, which needs an
        even split), every tensor of the inputs and targets alike (:mod:`.batch`). The
        loss of micro-batch ``i`` is scaled by its size over the batch, so with a
        ``loss_fn`` that is a mean over the micro-batch the total is the unsplit mean.
        Every pp rank passes the same ``inputs`` and ``targets``, or None for a side it does
        not read (:attr:`reads`: stage 0 reads the inputs, the last stage the targets).

        Args:
            params: this rank's leaves (as from :meth:`init`).
            inputs: the batch's inputs: a tensor (the first unit's argument), a tuple/list
                of tensors (its positional arguments), a dict (its keyword arguments) or a
                :class:`~.batch.UnitInputs`; values that are not tensors go whole to
                every micro-batch. None on a pp rank without stage 0.
            targets: the batch's targets: a tensor or a tuple/list/dict of them, split like
                ``inputs`` (``loss_fn`` gets each micro-batch's piece). None on a pp rank
                without the last stage.
            report: also return the :class:`~.report.StepReport` (events, live graphs).
            mutable: also return this rank's buffers (BatchNorm statistics) after the
                step: each stage's forwards update them micro-batch by micro-batch, as
                ``sf.functional(nn.Sequential(*units)).apply(..., mutable=True)`` run on
                the micro-batches in order would (with ``dp_axis``: each replica's own).

        Returns:
            ``(loss, grads)``: the whole batch's loss, equal on every pp rank, and the
            gradients of this rank's trainable leaves; with ``dp_axis`` both are
            averaged over it (a stage model that reduces over it already, such as
            ``shard_params``, is not averaged again). With ``mutable=True`` then the
            buffers (``{**params, **buffers}`` is the next step's tree); with
            ``report=True`` last the report.

        Example:
            >>> loss, grads, buffers = pp.value_and_grad(params, x, y, mutable=True)
            >>> loss, grads = pp.value_and_grad(params, {"x": x, "mask": mask}, {"y": y})
            >>> loss, grads = pp.value_and_grad(params, x, None)  # a rank without the last stage

        Raises:
            ValueError: wrong leaves, a batch smaller than the micro-batch count, an uneven
                split with declared shapes, a stage error, pp ranks given different batches or
                None for a side a rank reads (all raise). ConcurrentCallError: another thread.
        """
        refuse_transforms("value_and_grad")
        if not isinstance(mutable, bool):
            raise TypeError(f"value_and_grad: mutable must be True or False, got {mutable!r}")
        if mutable and not self.plan.mutable_forwards:
            raise ValueError("pipeline value_and_grad(mutable=True) is not supported with "
                             "remat= (a recomputed forward would update the buffers again)")

        agreed = agree_on_step(self.plan, inputs, targets, "value_and_grad")  # all raise alike
        def prepare() -> Params:  # on every rank inside the step: a bad call stops them all
            self._check_call(params, inputs, targets)
            refuse_differentiated_state(params, self.full.buffer_names, self.full.frozen_names,
                                        "pipeline value_and_grad")
            trainable = {n for stage in self.stages for n in stage.trainable}
            return {n: t.detach().requires_grad_(True) if n in trainable else t
                    for n, t in params.items()}

        key = cache_key(agreed, self.schedule.n_microbatches) if self._caches_shapes else None
        inferred = self.shape_cache.get(key)
        loss, grads, step_report = run_step(self.plan, prepare, as_unit_inputs(inputs), targets,
                                            inferred, mutable, self.message_buffers)
        if inferred is None:
            self.shape_cache.put(key, step_report.shapes)
        if self.dp_axis is not None:
            loss, grads = self._average_over_dp(loss, grads)
        mark_held(grads.values(), self.axis, "sf.pipeline_stages", CLIP_HELD)  # only this stage's
        found = (loss, grads) + ((step_report.buffers,) if mutable else ())
        return found + (step_report,) if report else found

    def _average_over_dp(self, loss: torch.Tensor, grads: Params) -> tuple[torch.Tensor, Params]:
        reduced = {n for index, axes in self.reduced_axes.items() if self.dp_axis in axes
                   for n in self.stage_models[index].names}
        todo = {n: g for n, g in grads.items() if n not in reduced}
        loss, todo = collectives.pmean((loss, todo), self.dp_axis, mesh=self.mesh)
        return loss, {n: todo.get(n, g) for n, g in grads.items()}

    @exclusive
    def apply(self, params: Mapping[str, torch.Tensor], inputs: Any, *,
              mutable: bool = False) -> Any:
        """Inference: the model's output for ``inputs``, on every pp rank (no graph).

        The batch runs through the stages in ``microbatches`` pieces; the last
        stage sends its outputs to every pp rank. The output is what the last stage
        returns: a tensor, or a tuple/list of tensors (each concatenated over the
        micro-batches on dim 0).

        Args:
            params: this rank's leaves.
            inputs: the batch's inputs (the same on every pp rank; None on one without
                stage 0): a tensor, a tuple/list or a dict of them, as for value_and_grad.
            mutable: must be False: inference updates no buffers (for the buffers after
                a training step, ``value_and_grad(..., mutable=True)``).

        Example:
            >>> out = pp.eval().apply(params, x)
        """
        if mutable is not False:
            raise ValueError("pipeline apply is inference and updates no buffers, so "
                             "mutable=True is not supported: for the buffers after a step "
                             "use pp.value_and_grad(params, inputs, targets, mutable=True)")
        refuse_transforms("apply")
        agreed = agree_on_step(self.plan, inputs, None, "apply")

        def prepare() -> Mapping[str, torch.Tensor]:
            self._check_call(params, inputs, None)
            return params

        key = cache_key(agreed, self.schedule.n_microbatches) if self._caches_shapes else None
        inferred = self.shape_cache.get(key)
        out, shapes = run_forward(self.plan, prepare, as_unit_inputs(inputs), inferred)
        if inferred is None:
            self.shape_cache.put(key, shapes)
        return out

    # ------------------------------------------------------------------ checks
    def _check_params(self, params: Mapping[str, torch.Tensor], subset: bool = False) -> None:
        check_leaves(params, self.names, self.layout, self.rank, subset)

    def _check_call(self, params: Any, inputs: Any, targets: Any) -> None:
        """This rank's leaves and batch (after :func:`~.guard.agree_on_step`)."""
        self._check_params(params)
        check_batch(inputs, targets, self.schedule.n_microbatches, self.plan.declared is not None,
                    self.reads)
