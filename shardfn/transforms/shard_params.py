"""`shard_params`: ZeRO-3 / FSDP full parameter sharding over a mesh axis (and HSDP).

Every parameter is split on dim 0 over ``axis`` (zero-padded to whole rows,
exactly ``sf.shard(full, model.specs, mesh)``), so a rank holds ``1/N`` of the
model and its shards form an ordinary tree: any ``sf.optim`` optimizer runs on
it directly and its state is ``1/N`` too. 0-dim parameters and buffers are
replicated (``P()``).

The model is cut into *units* (submodules chosen by ``units=``; what lies
outside every unit is the *root unit*). ``apply`` is one ``autograd.Function``
(``RootFn``). Its forward gathers the root's parameters and runs the root's
forward, recording a plain autograd graph; each unit call inside it all-gathers
that unit's shards (point-to-point, straight into the unit's full parameters:
``_unit_exchange.py``), runs the unit recording its own graph, *releases* the
storage of the full parameters (the graph keeps their aliases) and enters the
root's graph through a second ``autograd.Function`` (``UnitFn``). The backward
runs the root's graph: each ``UnitFn.backward`` refills its unit's parameter
storage (all-gathers again into the same place), runs the unit's recorded
backward and reduce-scatters the parameter gradient; finally the root's own
gradient is reduce-scattered. Nothing is recomputed, and only the outer
Function meets ``torch.func``, so the same code runs under ``torch.func.grad`` /
``grad_and_value`` / ``vjp`` and plain ``loss.backward()``.

With a ``remat=`` policy forward runs without a graph instead (recording what the
policy saves) and backward recomputes: the root's forward under
``torch.func.vjp`` with each unit call *replaying* its forward output, and each
unit under ``torch.func.vjp`` with its forward's RNG state, replaying the saved
values (``remat=nothing_saveable``: ZeRO-3 with activation checkpointing at unit
boundaries).

Overlap: while a unit computes, the all-gathers of the next ``prefetch`` units
are in flight (forward: in the order recorded by the previous call, at first
the registration order, where a wrong guess wastes a gather but never gives a
wrong result; backward: the reverse of this call's forward order). A unit's
reduce-scatter is waited only in the backward of the unit before it, which
returns that gradient (it takes the later unit's shards as extra inputs); the
root waits for the first unit's and for any left unclaimed.

Gradients (``grad_reduce``): ``"mean"`` (default, DDP/FSDP semantics) divides
the reduce-scatter by the number of data-parallel ranks, so a per-rank loss on
the rank's micro-batch gives the gradient of the global mean loss. ``"sum"``
is JAX's transpose rule (all_gather -> psum_scatter). With ``replicate_axis``
(HSDP) the shard gradients are also summed over that axis (the mean divides by
both sizes). In fp16/bf16 the gradients are divided before the sum and after it
(FSDP2's ``divide_factors``), so a mean that fits the dtype does not overflow.
"mean" is the mean of the per-rank gradients: the full-batch mean only for equal
per-rank batches (check mode compares the batch shapes; ``"sum"`` with a loss
divided by the global count weights unequal batches exactly). Only the leaves a
gradient is asked for are reduced. Frozen parameters and buffers get no gradient
(None; zeros under ``torch.func``).

Dtypes and buffers: ``apply`` computes in the dtypes of the shards given (float64
shards of a float32 module compute in float64) unless ``precision`` says otherwise.
``apply(..., mutable=True)`` also returns every buffer as the forward left it
(BatchNorm statistics of this rank's batch: buffers are per rank); a recompute does
not update them again, and recomputes run under the forward's autocast state.

Parameters tied across units belong to the root unit: they
are gathered once with it, passed to the units as full tensors, and their
gradient (the sum over all uses) is reduce-scattered once.

Cost per step with N ranks on ``axis`` and Psi = parameter bytes padded to
whole rows (a dim-0 size d becomes ``N * ceil(d / N)``): communication
``3 Psi (N-1)/N`` per rank (all-gather in forward, again in backward,
reduce-scatter), ``2 Psi (N-1)/N`` with ``reshard_after_forward=False`` (the
forward's full parameters are kept for backward, like ZeRO-2). Frozen
parameters are gathered but not reduce-scattered. Memory: ``Psi / N`` of
shards, plus up to ``prefetch + 1`` units' full parameters (and the root's),
plus during backward the current unit's full gradient and one reduction in flight
(the previous unit's), plus the activations (all of them by default;
with ``remat=nothing_saveable`` those at unit boundaries and one unit's inner
activations). The root unit stays gathered through forward and through backward.

The code is split by job: this module (the public API), ``_unit_plan.py``
(choosing units, what each owns), ``_unit_step.py`` (one ``apply`` call: forward,
backward, the two Functions), ``_unit_exchange.py`` (a unit's collectives) and
``_units.py`` (precision and offload placement, remat recording, accumulation).

Large-model options:

* ``precision=sf.Precision(...)`` (FSDP2 ``MixedPrecisionPolicy``): each unit's floating
  shards are cast to ``param_dtype`` as they are packed for the all-gather (bf16 halves
  its bytes) and the unit computes in it; the full gradients are reduce-scattered in
  ``reduce_dtype`` (default ``param_dtype``) and come back in the shards' own (master)
  dtype. Floating buffers and 0-dim parameters are cast too, like ``with_precision``.
* ``offload=True`` / ``OffloadPolicy(storage, compute)`` (ZeRO-Offload): shards, their
  gradients and so the optimizer state live on the storage device; a unit's shards are
  copied to the compute device just before its all-gather, gradient shards back after
  the reduce-scatter; bytes are counted in ``sf.comm_stats()`` under ``"h2d"``/``"d2h"``.
* ``remat=policy``: the unit's (and root's) forward records the outputs the policy saves
  (never values computed from the gathered parameters alone) and the backward recomputes
  the rest, replaying them; ``nothing_saveable`` recomputes each unit whole.
* ``model.accumulate_grads(loss_fn, k, mode)``: ``k`` micro-batches per step with one
  reduce-scatter per unit (``"reduce_once"``: full gradients accumulate locally) or
  ``k`` of them (``"reduce_each"``: shard gradients accumulate).

Example:
    >>> fmodel = sf.functional(net)
    >>> model = shard_params(fmodel, mesh, axis="dp", units=Block)
    >>> shards = model.init(0)                       # this rank's shards only
    >>> loss = lambda p, x, y: F.cross_entropy(model.apply(p, x), y)
    >>> grads, value = torch.func.grad_and_value(loss)(shards, x_local, y_local)
    >>> full = sf.gather(shards, model.specs, mesh)  # == fmodel.init(0)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from shardfn import pytree
from shardfn.functional import FunctionalModel
from shardfn.mesh import AxisName, Mesh
from shardfn.primitives import _comm, consistency
from shardfn.spec import Layout, P, local_shape, shard
from shardfn.transforms._unit_exchange import TagCounter
from shardfn.transforms._unit_plan import (
    Unit,
    UnitPolicy,
    build_units,
    init_groups,
    resolve_units,
    suggest,
)
from shardfn.transforms._unit_step import Reduce, RootFn, Step, TreeSpec
from shardfn.transforms._units import Accumulator, OffloadPolicy, Placement
from shardfn.transforms.accumulate import split_batch
from shardfn.transforms.precision import Precision, cast_floating
from shardfn.transforms.remat import Policy, nothing_saveable

__all__ = ["OffloadPolicy", "ShardedModel", "UnitPolicy", "shard_params"]

Params = dict[str, torch.Tensor]


# ================================================================ public API


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ShardedModel:
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
        names: leaf names, as in ``functional.names``.
        reshard_after_forward, prefetch, grad_reduce, precision, offload, remat: as given
            to :func:`shard_params` (``offload`` normalised to an :class:`OffloadPolicy`
            with the devices resolved, or None).
    """

    functional: FunctionalModel
    mesh: Mesh
    axis: AxisName
    replicate_axis: AxisName | None
    units: tuple[str, ...]
    specs: dict[str, Layout]
    names: tuple[str, ...]
    reshard_after_forward: bool
    prefetch: int
    grad_reduce: str
    precision: Precision | None
    offload: OffloadPolicy | None
    remat: Policy | None
    _policy: Policy | None  # what UnitRecorder records (None: nothing)
    _save: bool  # units keep their activations: backward runs the vjp built in forward
    _units: tuple[Unit, ...]
    _root: Unit
    _ax: _comm.Axis
    _replicate_ax: _comm.Axis | None
    _all_ax: _comm.Axis
    _local_shapes: dict[str, tuple[int, ...]]
    _buffer_set: frozenset[str]
    _trainable_set: frozenset[str]
    _unit_trainable: tuple[str, ...]
    _init_groups: tuple[tuple[str, ...], ...]
    _order_hint: list[int]  # unit order of the previous forward (a prefetch guess only)
    _token: object
    _place: Placement  # dtypes and devices (precision, offload)
    _masters: dict[str, torch.dtype]  # each leaf's own (master) dtype
    # the same model planned for shards of other dtypes (float64 shards of a float32
    # module): leaf dtypes -> ShardedModel, shared by all of them
    _variants: dict[tuple[torch.dtype, ...], ShardedModel]

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's shards of ``functional.init(seed)``, built one unit at a time.

        The full model is never materialised: each unit's leaves are initialised
        with ``functional.init_subset`` and sharded before the next unit's.

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
        if device is None:
            device = self._place.storage if self._place.offload else self.mesh.device
        out: Params = {}
        for paths in self._init_groups:
            full = self.functional.init_subset(seed, paths, device=device)
            consistency.check_replicated("shard_params.init", self._all_ax, full)
            out.update(self._shard_leaves(full))
            del full  # one unit's full leaves alive at a time
        return {name: out[name] for name in self.names}

    def shard(self, full_params: Mapping[str, torch.Tensor]) -> Params:
        """This rank's shards (fresh tensors, zero-padded) of a full params tree.

        Args:
            full_params: ``name -> full tensor`` as ``functional.init`` returns.

        Returns:
            ``name -> local shard`` (on the storage device with ``offload``).

        Example:
            >>> shards = model.shard(fmodel.init(0))
        """
        self.functional.check(full_params)
        consistency.check_replicated("shard_params.shard", self._all_ax, full_params)
        return self._shard_leaves(full_params)

    def apply(self, shards: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """Run the model's forward on this rank's shards, gathering units just in time.

        Differentiable w.r.t. the shards (and tensor inputs) under ``torch.func``
        transforms and plain autograd; the shard gradients are already reduced
        over the data-parallel axes (see ``grad_reduce``), and only those of the
        leaves a gradient is asked for are. It computes in the dtypes of the shards
        given (float64 shards compute in float64), unless ``precision`` says otherwise.

        Buffers are per rank: each rank's forward sees its own batch (BatchNorm
        statistics of the local batch, like DDP without SyncBatchNorm; see
        ``sf.sync_batch_norm`` for statistics over the axis).

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
        self.check(shards)
        consistency.check_call("shard_params.apply", self._all_ax, (args, kwargs))
        model = self._for_dtypes(shards)
        place, precision = self._place, self.precision
        if place.offload:  # inputs go where the units compute (differentiably)
            args, kwargs = pytree.tree_map(
                lambda x: x.to(place.compute) if isinstance(x, torch.Tensor) else x,
                (args, kwargs))
        if precision is not None and precision.cast_inputs:
            args, kwargs = cast_floating((args, kwargs), precision.param_dtype)
        arg_spec, arg_tensors = TreeSpec.of((args, kwargs))
        grad = torch.is_grad_enabled()
        step = Step(model, arg_spec, arg_tensors, keep=grad and not self.reshard_after_forward,
                    record=grad, mutable=bool(mutable))
        outputs = RootFn.apply(step, *[shards[name] for name in self.names], *arg_tensors)
        out = step.out_spec.build(outputs[:step.n_outputs])
        if precision is not None:
            out = cast_floating(out, precision.output_dtype)
        if not mutable:
            return out
        return out, dict(zip(self.functional.buffer_names, outputs[step.n_outputs:],
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
        self.check(shards)
        trainable = {n: shards[n] for n in self.names if n in self._trainable_set}
        rest = {n: shards[n] for n in self.names if n not in self._trainable_set}
        return trainable, rest

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
        overlap = sorted(set(trainable) & set(rest))
        if overlap:
            raise ValueError(f"merge: names present in both trainable and rest: {overlap}")
        both = {**rest, **trainable}
        self.check(both)
        return {name: both[name] for name in self.names}

    def _for_dtypes(self, shards: Mapping[str, torch.Tensor]) -> ShardedModel:
        """This model planned for the dtypes of ``shards`` (``self`` for the module's own)."""
        masters = self._masters
        if all(shards[name].dtype == masters[name] for name in self.names):
            return self
        return self._variant(tuple(shards[name].dtype for name in self.names))

    def _variant(self, key: tuple[torch.dtype, ...]) -> ShardedModel:
        """This model planned for leaves of the dtypes ``key`` (in ``names`` order)."""
        if key == tuple(self._masters[name] for name in self.names):
            return self
        variant = self._variants.get(key)
        if variant is None:
            dtypes = dict(zip(self.names, key, strict=True))
            units, root = build_units(self.functional, self.units, self._ax.size, self._token,
                                      self._place, dtypes)
            variant = dataclasses.replace(self, _units=units, _root=root, _masters=dtypes)
            self._variants[key] = variant
        return variant

    def accumulate_grads(self, loss_fn: Callable, num_micro_batches: int,
                         mode: str = "reduce_once") -> Callable:
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
        if mode not in ("reduce_once", "reduce_each"):
            raise ValueError(f"accumulate_grads: mode must be 'reduce_once' or 'reduce_each', "
                             f"got {mode!r}")
        if (isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int)
                or num_micro_batches < 1):
            raise ValueError(f"accumulate_grads: num_micro_batches must be an int >= 1, got "
                             f"{num_micro_batches!r}")
        grad_fn = torch.func.grad_and_value(loss_fn)
        k = num_micro_batches

        def fn(shards: Any, batch: Any, *rest: Any) -> tuple[Any, torch.Tensor]:
            if mode == "reduce_once" and not isinstance(shards, Mapping):
                raise TypeError(f"accumulate_grads(mode='reduce_once') needs the shards as a "
                                f"mapping name -> tensor, got {type(shards).__name__}")
            micro_batches = split_batch(batch, k)
            total = None
            with (Accumulator(self._token) if mode == "reduce_once"
                  else contextlib.nullcontext()) as accumulator:
                for micro in micro_batches:
                    out = grad_fn(shards, micro, *rest)
                    total = out if total is None else pytree.tree_map(torch.add, total, out)
                    del out  # only the running sum stays alive between micro-batches
            grads, loss = total
            if accumulator is not None:
                grads = dict(grads)
                for name, grad in self._reduce_accumulated(accumulator, grads).items():
                    if name in grads:
                        grads[name] = grads[name] + grad
            return pytree.tree_map(lambda t: t / k, (grads, loss))

        return fn

    def _reduce_accumulated(self, accumulator: Accumulator,
                            names: Collection[str]) -> Params:
        """Reduce every unit's summed full gradients of ``names`` once: ``name -> shard
        gradient`` (planned for the dtypes the micro-batches ran in)."""
        model = self if accumulator.masters is None else self._variant(
            tuple(accumulator.masters[name] for name in self.names))
        some = [g for grads in accumulator.grads.values() for g in grads.values()]
        tags = TagCounter()
        device = some[0].device if some else (self._place.compute or self.mesh.device)
        wanted = frozenset(n for n in self._trainable_set if n in names)
        wanted = None if len(wanted) == len(self._trainable_set) else wanted
        out: Params = {}
        for unit in (*model._units, model._root):  # every rank reduces every unit, in order
            grads = accumulator.grads.pop(unit.index, {})
            for name in unit.owned_grads:  # a unit no micro-batch called: zeros
                if name not in grads and (wanted is None or name in wanted):
                    grads[name] = torch.zeros(self.specs[name].shape,
                                              dtype=model._masters[name], device=device)
            out.update(Reduce(model, unit, grads, tags(), wanted).wait())
        return out

    def check(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Raise a ``ValueError``/``TypeError`` naming the leaf unless ``shards`` fits ``specs``."""
        if not isinstance(shards, Mapping):
            raise TypeError(f"shards must be a mapping name -> Tensor (as model.init returns), "
                            f"got {type(shards).__name__}")
        if shards.keys() != self._local_shapes.keys():
            missing = [n for n in self.names if n not in shards]
            unexpected = [n for n in shards if n not in self._local_shapes]
            raise ValueError(f"shards do not match the model: missing {missing}, unexpected "
                             f"{unexpected}" + suggest(unexpected, self.names))
        for name, expected in self._local_shapes.items():
            value = shards[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"shards[{name!r}] must be a Tensor, got {type(value).__name__}")
            got = tuple(value.shape)
            if got == expected:
                continue
            layout = self.specs[name]
            mesh = dict(zip(self.mesh.axis_names, self.mesh.shape, strict=True))
            if got == layout.shape:
                raise ValueError(
                    f"shards[{name!r}] has the full shape {got}, but model.apply takes this "
                    f"rank's shards (local shape {expected} under {layout.spec} on mesh {mesh}); "
                    f"shard the tree first: shards = model.shard(full_params)"
                )
            raise ValueError(
                f"shards[{name!r}] has shape {got}, but {layout.spec} of global shape "
                f"{layout.shape} on mesh {mesh} gives the local shape {expected}; was the tree "
                f"sharded for another mesh or axis?"
            )

    def train(self, mode: bool = True) -> ShardedModel:
        """The same sharded model over ``functional.train(mode)``."""
        return shard_params(self.functional.train(mode), self.mesh, axis=self.axis,
                            units=list(self.units) or None, prefetch=self.prefetch,
                            reshard_after_forward=self.reshard_after_forward,
                            replicate_axis=self.replicate_axis, grad_reduce=self.grad_reduce,
                            precision=self.precision, offload=self.offload, remat=self.remat)

    def eval(self) -> ShardedModel:
        """Same as ``train(False)``."""
        return self.train(False)

    def _shard_leaves(self, full: Mapping[str, torch.Tensor]) -> Params:
        return {name: self._place.store(shard(x, self.specs[name], self.mesh).clone())
                for name, x in full.items()}

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
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    replicate_axis: AxisName | None = None,
    grad_reduce: str = "mean",
    precision: Precision | None = None,
    offload: OffloadPolicy | bool | None = None,
    remat: Policy | None = None,
) -> ShardedModel:
    """Shard every parameter of ``model`` on dim 0 over ``axis`` (ZeRO-3 / FSDP; HSDP).

    Args:
        model: a functional model (``sf.functional(module)``; may come from a meta module).
        mesh: the mesh.
        axis: the mesh axis (or tuple of axes) to shard over.
        units: which submodules are gathered as one unit (the rest is the root unit):
            a module class or tuple of classes (every submodule of that class); an int
            ``n`` (bottom-up, the smallest callable submodules holding at least ``n``
            parameter elements); a list of module paths; or None (the whole model is
            one unit). Units never nest: the outermost match wins.
        reshard_after_forward: free each unit's full parameters after its forward
            (True, ZeRO-3) or keep them for backward (False: no second all-gather).
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

    Returns:
        A :class:`ShardedModel`.

    Raises:
        TypeError / ValueError: a module instead of a functional model, an unknown axis,
            or a unit policy that matches no submodule (the message lists what exists).

    Example:
        >>> model = shard_params(sf.functional(net), mesh, "dp", units=Block)
        >>> shards = model.init(0)
        >>> out = model.apply(shards, x)

    Communication per step: ``3 Psi (N-1)/N`` bytes per rank (``2 Psi (N-1)/N`` without
    resharding), in one all-gather / reduce-scatter per unit. Memory: shards plus
    ``prefetch + 1`` units' full parameters, in backward two units' full gradients
    (one being reduced), and the activations ``remat`` keeps.
    """
    if isinstance(model, nn.Module):
        raise TypeError("shard_params takes a functional model: shard_params(sf.functional("
                        "module), mesh, ...)")
    if not isinstance(model, FunctionalModel):
        raise TypeError(f"shard_params expects a FunctionalModel, got {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an sf.Mesh, got {type(mesh).__name__}")
    if grad_reduce not in ("mean", "sum"):
        raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if remat is not None and not callable(remat):
        raise TypeError(f"remat must be a policy (op, name) -> bool, e.g. "
                        f"sf.checkpoint_policies.dots_saveable; got {remat!r}")
    # None: keep every activation (no recompute); nothing_saveable: recompute each unit whole
    # (nothing to record); another policy: record what it saves, recompute the rest
    policy = None if remat is None or remat is nothing_saveable else remat
    place = Placement.of(precision, offload)
    ax = _comm.resolve(axis, mesh)
    replicate_ax = None
    all_names = ax.names
    if replicate_axis is not None:
        replicate_ax = _comm.resolve(replicate_axis, mesh)
        if set(replicate_ax.names) & set(ax.names):
            raise ValueError(f"replicate_axis {replicate_axis!r} overlaps axis {axis!r}")
        all_names = ax.names + replicate_ax.names
    all_ax = _comm.resolve(all_names, mesh)

    paths = resolve_units(model, units)
    token = object()
    unit_plans, root = build_units(model, paths, ax.size, token, place)
    shapes = model.param_shapes()
    specs, local_shapes = {}, {}
    for name in model.names:
        shape = tuple(shapes[name].shape)
        spec = P(axis) if name in model.param_names and len(shape) >= 1 else P()
        specs[name] = Layout(spec, shape)
        local_shapes[name] = local_shape(shape, spec, mesh)
    trainable = frozenset(model.trainable_names)
    in_units = tuple(n for u in unit_plans for n in u.grad_inputs if n not in u.external)
    return ShardedModel(
        functional=model, mesh=mesh, axis=axis, replicate_axis=replicate_axis,
        units=paths, specs=specs, names=model.names,
        reshard_after_forward=bool(reshard_after_forward), prefetch=prefetch,
        grad_reduce=grad_reduce, precision=precision,
        offload=OffloadPolicy(place.storage, place.compute, place.pin) if place.offload else None,
        remat=remat, _policy=policy, _save=remat is None, _units=unit_plans, _root=root, _ax=ax,
        _replicate_ax=replicate_ax, _all_ax=all_ax,
        _local_shapes=local_shapes, _buffer_set=frozenset(model.buffer_names),
        _trainable_set=trainable, _unit_trainable=in_units,
        _init_groups=init_groups(model, paths), _order_hint=[], _token=token,
        _place=place, _masters={name: shapes[name].dtype for name in model.names},
        _variants={},
    )


# ``sf.transforms.shard_params`` is this function (the package re-exports it over the module
# name), so the policy class is reachable from it as well: shard_params.OffloadPolicy(...)
shard_params.OffloadPolicy = OffloadPolicy  # type: ignore[attr-defined]


