"""The API layer of `shard_params`: :class:`ShardedModel` and :func:`shard_params`.

What the user calls. Building a model validates the arguments and computes its
frozen :class:`~.plan.Plan`; each ``apply`` runs one :class:`~.call.ApplyCall`
through :class:`~.functions.RootFn`. The package docstring
(:mod:`shardfn.transforms.shard_params`) says what the transform does and costs.

Example:
    >>> model = shard_params(sf.functional(net), mesh, "dp", units=Block)
    >>> shards = model.init(0)
    >>> out = model.apply(shards, x)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardfn import pytree
from shardfn._functional_hf import refuse_recorded_outputs
from shardfn._functional_layout import FunctionalNames
from shardfn._functional_leaves import refuse_differentiated_state
from shardfn.functional import FunctionalModel
from shardfn.mesh import AxisName, Mesh
from shardfn.primitives import consistency
from shardfn.spec import Layout
from shardfn.transforms._fsdp_ep import ExpertParallelModel, over_expert_parallel
from shardfn.transforms._fsdp_tp import over_tensor_split
from shardfn.transforms.accumulate import accumulate_grads
from shardfn.transforms.precision import Precision, cast_floating
from shardfn.transforms.remat import Policy
from shardfn.transforms.shard_params import leaves
from shardfn.transforms.shard_params.accumulator import (
    AccumulateMode,
    check_accumulate,
    reduce_once,
)
from shardfn.transforms.shard_params.call import ApplyCall
from shardfn.transforms.shard_params.choose import IgnoredPolicy, UnitPolicy, resolve_units
from shardfn.transforms.shard_params.compiled import compiled_apply
from shardfn.transforms.shard_params.compose import take_model, take_remat
from shardfn.transforms.shard_params.functions import RootFn
from shardfn.transforms.shard_params.placement import OffloadPolicy, Placement
from shardfn.transforms.shard_params.plan import GradReduce, Plan, Reshard, Unit, make_plan
from shardfn.transforms.shard_params.prefetch import PrefetchGuess
from shardfn.transforms.shard_params.tree import TreeSpec
from shardfn.transforms.tensor_split import TensorSplitModel

__all__ = ["OffloadPolicy", "ShardedModel", "UnitPolicy", "shard_params"]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ShardedModel(FunctionalNames):
    """A functional model whose parameters are sharded over a mesh axis; see :func:`shard_params`.

    Attributes:
        functional: the unsharded :class:`~shardfn.functional.FunctionalModel`.
        mesh: the mesh.
        axis: the axis parameters are sharded over.
        replicate_axis: the HSDP replica axis (or None).
        units: paths of the unit submodules, in registration order (the root unit,
            everything outside them, is implicit).
        specs: leaf name -> :class:`~shardfn.spec.Layout` (``P(axis)`` on dim 0, or ``P()``
            for 0-dim parameters and buffers), with the global shape.
        names: leaf names, as in ``functional.names`` (and ``param_names``, ``buffer_names``,
            ``trainable_names``, ``frozen_names`` those of ``functional``).
        reshard_after_forward, prefetch, grad_reduce, precision, offload, remat: as given
            to :func:`shard_params` (``offload`` normalised to an :class:`OffloadPolicy`
            with the devices resolved, or None).
        ignored_params: the names ``ignored_params=`` chose (held whole, spec ``P()``).
    """

    functional: FunctionalModel
    mesh: Mesh
    axis: AxisName
    replicate_axis: AxisName | None
    units: tuple[str, ...]
    specs: dict[str, Layout]
    names: tuple[str, ...]
    reshard_after_forward: Reshard
    prefetch: int
    grad_reduce: GradReduce
    precision: Precision | None
    offload: OffloadPolicy | None
    remat: Policy | None
    ignored_params: frozenset[str]
    _plan: Plan  # frozen: everything an apply call reads of the model
    _guess: PrefetchGuess  # the previous forward's unit order (prefetch and overlap only)
    # the same model planned for shards of other dtypes (float64 shards of a float32
    # module): leaf dtypes (in ``names`` order) -> Plan
    _variants: dict[tuple[torch.dtype, ...], Plan]

    @property
    def _units(self) -> tuple[Unit, ...]:
        """The plan's units (read by tests that count a step's exchanges)."""
        return self._plan.units

    @property
    def _root(self) -> Unit:
        """The plan's root unit."""
        return self._plan.root

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's shards of ``functional.init(seed)``, built one unit at a time (the
        full model is never materialised: ``functional.init_subset`` of each unit).

        Args:
            seed: as for ``FunctionalModel.init``.
            device: where to build them (default: the mesh's device; with ``offload``,
                the storage device, and the shards end up there, pinned if asked).

        Returns:
            ``name -> local shard`` (buffers and 0-dim parameters whole), equal to
            ``sf.shard(functional.init(seed), model.specs, mesh)``.

        Example:
            >>> shards = model.init(0)
        """
        return leaves.init_shards(self._plan, seed, device)

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """This rank's shards (fresh tensors, zero-padded) of full leaves, any subset of them.

        Args:
            tree: ``name -> full tensor`` for any of the leaves: ``functional.init``'s
                tree, a gradient tree, the trainable part of ``split_trainable``.

        Returns:
            ``name -> local shard`` in ``names`` order (on the storage device with
            ``offload``); ``model.gather`` is its inverse.

        Example:
            >>> shards = model.shard(fmodel.init(0))
        """
        return leaves.shard_leaves(self._plan, tree, "shard_params.shard")

    def gather(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves from every rank's shards, any subset of them; differentiable.

        One all-gather per leaf over ``axis`` (HSDP: the shards are the same over
        ``replicate_axis``), as ``sf.gather(tree, model.specs, mesh)``.

        Args:
            tree: ``name -> local shard`` for any of the leaves (shards, the shard gradients
                of ``torch.func.grad``, the trainable part); every rank passes the same names.

        Returns:
            ``name -> full tensor`` in ``names`` order, equal on every rank.

        Example:
            >>> full = model.gather(model.init(0))   # == fmodel.init(0)
        """
        return leaves.gather_leaves(self._plan, tree, "shard_params.gather")

    def params_from(self, module: nn.Module) -> Params:
        """This rank's shards of a module's values: ``shard(functional.params_from(module))``.

        Example:
            >>> shards = model.params_from(net)
        """
        return self.shard(self.functional.params_from(module))

    def apply(self, shards: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """Run the model's forward on this rank's shards, gathering units just in time.

        Differentiable w.r.t. the shards (and tensor inputs) under ``torch.func``
        transforms and plain autograd; the shard gradients are already reduced
        over the data-parallel axes (see ``grad_reduce``), and only those of the
        leaves a gradient is asked for are. It computes in the dtypes of the shards
        given (float64 shards compute in float64), unless ``precision`` says otherwise.

        Buffers are per rank: each rank's forward sees its own batch (BatchNorm
        statistics of the local batch, like DDP; ``sf.sync_batch_norm`` for the axis'). Under
        ``torch.compile`` it runs ``compiled.py``'s traceable path (same values).

        Args:
            shards: ``name -> local shard`` as :meth:`init` / :meth:`shard` return.
            *args, **kwargs: passed to the module's forward.
            mutable: also return the buffers as the forward left them.

        Returns:
            Whatever the module's forward returns (floating outputs in
            ``precision.output_dtype`` if set); with ``mutable=True``,
            ``(output, new_buffers)``: ``new_buffers`` maps every buffer name (in
            ``functional.buffer_names`` order, integer ones included) to its value after
            the forward, whole (spec ``P()``), in the dtype and device it was given, so
            ``{**shards, **new_buffers}`` is the next step's tree. A recompute
            (``remat``) does not update them again.

        Raises:
            ValueError / TypeError: a missing or unexpected leaf, or one whose shape is
                not its local shard shape (a full tree, or one sharded for another mesh).

        Example:
            >>> logits = model.apply(shards, tokens)
            >>> logits, buffers = model.apply(shards, tokens, mutable=True)
            >>> shards = {**shards, **buffers}
        """
        if torch.compiler.is_compiling():  # one traceable path, same numbers: compiled.py
            return compiled_apply(self, shards, args, kwargs, mutable)
        self.check(shards)
        refuse_differentiated_state(shards, self.functional.buffer_names,
                                    self.functional.frozen_names, "shard_params.apply")
        consistency.check_call("shard_params.apply", self._plan.all_ax, (args, kwargs))
        refuse_recorded_outputs(self.functional.module, kwargs, "shard_params")
        plan = leaves.plan_for(self._plan, self._variants, shards)
        place, precision = plan.place, self.precision
        if place.offload:  # inputs go where the units compute (differentiably)
            args, kwargs = pytree.tree_map_deep(
                lambda x: x.to(place.compute) if isinstance(x, torch.Tensor) else x,
                (args, kwargs))
        if precision is not None and precision.cast_inputs:
            args, kwargs = cast_floating((args, kwargs), precision.param_dtype)
        arg_spec, arg_tensors = TreeSpec.of((args, kwargs))
        grad = torch.is_grad_enabled()
        call = ApplyCall(plan, self._guess, arg_spec, arg_tensors,
                         keep=grad and self.reshard_after_forward is False, record=grad,
                         mutable=bool(mutable), keep_root=grad and self.reshard_after_forward
                         is not True)
        outputs = RootFn.apply(call, *[shards[name] for name in self.names], *arg_tensors)
        out = call.out_spec.build(outputs[:call.n_outputs])
        if precision is not None:
            out = cast_floating(out, precision.output_dtype)
        if not mutable:
            return out
        return out, dict(zip(self.functional.buffer_names, outputs[call.n_outputs:],
                             strict=True))

    def apply_with_buffers(self, shards: Mapping[str, torch.Tensor], *args: Any,
                           **kwargs: Any) -> tuple[Any, Params]:
        """``apply(shards, *args, mutable=True, **kwargs)``: ``(output, new_buffers)``."""
        return self.apply(shards, *args, mutable=True, **kwargs)

    def split_trainable(self, shards: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """Split a shard tree into ``(trainable, rest)`` (rest: buffers and frozen parameters).

        Args:
            shards: ``name -> local shard`` (checked against the local shapes).

        Returns:
            ``(trainable, rest)`` in ``names`` order; differentiate only ``trainable``.

        Example:
            >>> train, rest = model.split_trainable(model.init(0))
            >>> grads = torch.func.grad(lambda t: loss(model.merge(t, rest)))(train)
        """
        return leaves.split_trainable(self._plan, shards)

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        """Inverse of :meth:`split_trainable`: one shard tree in ``names`` order, checked.

        Args:
            trainable, rest: disjoint ``name -> local shard`` mappings covering every leaf.

        Returns:
            The merged tree.

        Raises:
            ValueError: a name in both, a missing or unexpected name, or a leaf whose
                shape is not its local shard shape.

        Example:
            >>> shards = model.merge(*model.split_trainable(shards))
        """
        return leaves.merge(self._plan, trainable, rest)

    def accumulate_grads(self, loss_fn: Callable, num_micro_batches: int,
                         mode: AccumulateMode = "reduce_once") -> Callable:
        """``grad_and_value`` of ``loss_fn`` over ``k`` micro-batches, reduced once or each time.

        The batch (every tensor leaf, along dim 0) is split into ``k`` equal
        micro-batches; ``loss_fn(shards, micro_batch, *rest)`` (a mean over its
        micro-batch) is differentiated on each with ``torch.func.grad_and_value``, and
        the result is the mean over the micro-batches: for equal micro-batches, the
        gradient of the loss of the whole batch.

        Args:
            loss_fn: ``loss_fn(shards, batch, *rest) -> scalar`` calling :meth:`apply`.
            num_micro_batches: ``k``.
            mode: ``"reduce_once"`` (default): each unit's backward adds its *full*
                gradient to a local sum (no reduce-scatter), and every unit is
                reduce-scattered once after the last micro-batch: one reduce-scatter
                per unit (and dtype) per step, for one full gradient of the model per
                rank (master dtype) of memory. ``"reduce_each"``: every micro-batch
                reduce-scatters as usual and the shard gradients are summed: ``k``
                reduce-scatters per unit, gradient memory ``1/N``.

        Returns:
            ``fn(shards, batch, *rest) -> (grads, loss)`` like ``torch.func.grad_and_value``
            (``grads`` has the structure of ``shards``, a mapping ``name -> tensor``; it
            may hold a subset of the leaves, the rest coming from a closure).

        Raises:
            ValueError: an unknown mode, ``k < 1``, or a batch leaf not divisible by ``k``.

        Example:
            >>> step = model.accumulate_grads(loss_fn, 4, mode="reduce_once")
            >>> grads, loss = step(shards, (tokens, targets))
        """
        check_accumulate(mode, num_micro_batches)
        mean_fn = accumulate_grads(torch.func.grad_and_value(loss_fn), num_micro_batches)
        if mode == "reduce_each":  # every micro-batch reduce-scatters: sf.accumulate_grads
            return mean_fn
        return reduce_once(mean_fn, num_micro_batches, self._plan.token, lambda masters: (
            self._plan if masters is None else leaves.plan_for(self._plan, self._variants,
                                                               masters)))

    def check(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Raise a ``ValueError``/``TypeError`` naming the leaf unless ``shards`` fits ``specs``."""
        self._plan.check_shards(shards)

    def train(self, mode: bool = True) -> ShardedModel:
        """The same sharded model over ``functional.train(mode)``."""
        return shard_params(self.functional.train(mode), self.mesh, axis=self.axis,
                            units=list(self.units), prefetch=self.prefetch,
                            reshard_after_forward=self.reshard_after_forward,
                            replicate_axis=self.replicate_axis, grad_reduce=self.grad_reduce,
                            precision=self.precision, offload=self.offload, remat=self.remat,
                            ignored_params=self.ignored_params)

    def eval(self) -> ShardedModel:
        """Same as ``train(False)``."""
        return self.train(False)

    def __repr__(self) -> str:
        return (f"ShardedModel({type(self.functional.module).__name__}, axis={self.axis!r}, "
                f"{len(self.units)} units + root, reshard_after_forward="
                f"{self.reshard_after_forward}, prefetch={self.prefetch}, "
                f"replicate_axis={self.replicate_axis!r}, precision={self.precision}, "
                f"offload={self.offload}, remat={getattr(self.remat, '__name__', self.remat)})")


def shard_params(
    model: FunctionalModel,
    mesh: Mesh,
    axis: AxisName = "dp",
    *,
    units: UnitPolicy = None,
    reshard_after_forward: Reshard = True,
    prefetch: int = 1,
    replicate_axis: AxisName | None = None,
    grad_reduce: GradReduce = "mean",
    precision: Precision | None = None,
    offload: OffloadPolicy | bool | None = None,
    remat: Policy | None = None,
    ignored_params: IgnoredPolicy = None,
) -> ShardedModel:
    """Shard every parameter of ``model`` on dim 0 over ``axis`` (ZeRO-3 / FSDP; HSDP).

    Args:
        model: a functional model (``sf.functional(module)``, from a meta module too, or
            ``sf.with_precision(fm, p)``: ``precision=p``, docs/composing.md),
            or a ``sf.tensor_split`` model: FSDP + TP, a ``FsdpTpModel`` (docs/fsdp_tp.md).
        mesh: the mesh.
        axis: the mesh axis (or tuple of axes) to shard over.
        units: which submodules are gathered as one unit (the rest is the root unit):
            a module class or tuple of classes (every submodule of that class); an int
            ``n`` (bottom-up, the smallest callable submodules holding at least ``n``
            parameter elements); a list of module paths; or None (the whole model is
            one unit). Units never nest: the outermost match wins.
        reshard_after_forward: free each unit's full parameters after its forward
            (True, ZeRO-3) or keep them for backward (False: no second all-gather);
            ``"units"``: free the units', keep the root's (FSDP2's root, gathered again
            at once for backward otherwise).
        prefetch: how many units ahead to all-gather while a unit computes (0: none).
        replicate_axis: HSDP: a second axis over which the shards are replicated and
            the gradients are also reduced.
        grad_reduce: ``"mean"`` (divide by the number of data-parallel ranks) or ``"sum"``.
        precision: an ``sf.Precision`` (FSDP2 ``MixedPrecisionPolicy``): shards stay in
            their (master) dtype; each unit's floating shards are cast to
            ``param_dtype`` before its all-gather and it computes in it; gradients are
            reduce-scattered in ``reduce_dtype`` (default ``param_dtype``) and returned
            in the master dtype; ``output_dtype`` / ``cast_inputs`` as in ``with_precision``.
        offload: True or an :class:`OffloadPolicy` (ZeRO-Offload): shards (so gradients
            and optimizer state) live on the storage device; each unit's shards are
            copied to the compute device just before its all-gather, and the shard
            gradients back after the reduce-scatter (counted in ``sf.comm_stats()``
            under ``"h2d"`` / ``"d2h"``).
        remat: None (default): keep every activation backward needs (no recompute).
            A policy of ``sf.checkpoint_policies`` for each unit's (and the root's)
            activations: forward keeps the outputs the policy saves (never values
            computed from parameters alone) and backward recomputes the rest;
            ``nothing_saveable`` recomputes each unit whole (least memory).
        ignored_params: parameters left alone (FSDP2's): names or a predicate ``(name,
            ShapeDtype) -> bool``. Each rank holds its own whole value (``P()``), computes
            with it as given (cast by ``precision``) and gets its gradient unreduced.

    Returns:
        A :class:`ShardedModel`.

    Raises:
        TypeError / ValueError: a module instead of a functional model, an unknown axis,
            a unit policy that matches no submodule (the message lists what exists), or
            an ``ignored_params`` name that is no parameter (a buffer, a tied alias).

    Example:
        >>> model = shard_params(sf.functional(net), mesh, "dp", units=Block)
        >>> shards = model.init(0)
        >>> out = model.apply(shards, x)

    Communication per step: ``3 Psi (N-1)/N`` bytes per rank (``2 Psi (N-1)/N`` without
    resharding; ``"units"``: the root's parameters once less), in one all-gather /
    reduce-scatter per unit. Memory: shards plus ``prefetch + 1`` units' full parameters
    (``"units"``: and the root's), in backward two units' full gradients (one being
    reduced), and the activations ``remat`` keeps.
    """
    if isinstance(model, nn.Module):
        raise TypeError("shard_params takes a functional model: shard_params(sf.functional("
                        "module), mesh, ...)")
    model, remat = take_remat(model, remat)  # sf.remat(m, r) is remat=r: see compose.py
    model, precision = take_model(model, precision, axis, ShardedModel)  # see compose.py
    if isinstance(model, TensorSplitModel | ExpertParallelModel):  # _fsdp_tp.py, _fsdp_ep.py
        over = over_tensor_split if isinstance(model, TensorSplitModel) else over_expert_parallel
        return over(shard_params, model, mesh, axis, resolve_units(
            model.functional, units), dict(reshard_after_forward=reshard_after_forward,
            prefetch=prefetch, replicate_axis=replicate_axis, grad_reduce=grad_reduce,
            precision=precision, offload=offload, remat=remat, ignored_params=ignored_params))
    if not isinstance(model, FunctionalModel):
        raise TypeError(f"shard_params expects a FunctionalModel, a TensorSplitModel (FSDP + TP) "
                        f"or an ExpertParallelModel (FSDP x EP), got {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an sf.Mesh, got {type(mesh).__name__}")
    place = Placement.of(precision, offload)
    plan = make_plan(model, mesh, axis, units=units, replicate_axis=replicate_axis, place=place,
                     grad_reduce=grad_reduce, prefetch=prefetch,
                     reshard_after_forward=reshard_after_forward, remat=remat,
                     ignored=ignored_params)
    return ShardedModel(
        functional=model, mesh=mesh, axis=axis, replicate_axis=replicate_axis,
        units=plan.unit_paths, specs=dict(plan.specs), names=model.names,
        reshard_after_forward=plan.reshard_after_forward, prefetch=prefetch,
        grad_reduce=grad_reduce, precision=precision,
        offload=OffloadPolicy(place.storage, place.compute, place.pin) if place.offload else None,
        remat=remat, ignored_params=plan.ignored, _plan=plan,
        _guess=PrefetchGuess(len(plan.units)), _variants={})


# a public contract (tests/transforms/test_shard_params_offload.py): the function's attribute
shard_params.OffloadPolicy = OffloadPolicy  # type: ignore[attr-defined]
