"""`shard_params`: ZeRO-3 / FSDP full parameter sharding over a mesh axis (and HSDP).

Every parameter is split on dim 0 over ``axis`` (zero-padded to whole rows,
exactly ``sf.shard(full, model.specs, mesh)``), so a rank holds ``1/N`` of the
model and its shards form an ordinary tree: any ``sf.optim`` optimizer runs on
it directly and its state is ``1/N`` too. 0-dim parameters and buffers are
replicated (``P()``).

The model is cut into *units* (submodules chosen by ``units=``; what lies
outside every unit is the *root unit*). ``apply`` is one ``autograd.Function``
(``_RootFn``). Its forward gathers the root's parameters and runs the root's
forward, recording a plain autograd graph; each unit call inside it all-gathers
that unit's shards (point-to-point, straight into the unit's full parameters:
``_unit_exchange.py``), runs the unit recording its own graph, *releases* the
storage of the full parameters (the graph keeps their aliases) and enters the
root's graph through a second ``autograd.Function`` (``_UnitFn``). The backward
runs the root's graph: each ``_UnitFn.backward`` refills its unit's parameter
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
both sizes). Frozen parameters and buffers get no gradient (None; zeros under
``torch.func``). Parameters tied across units belong to the root unit: they
are gathered once with it, passed to the units as full tensors, and their
gradient (the sum over all uses) is reduce-scattered once.

Cost per step with N ranks on ``axis`` and Psi = parameter bytes padded to
whole rows (a dim-0 size d becomes ``N * ceil(d / N)``): communication
``3 Psi (N-1)/N`` per rank (all-gather in forward, again in backward,
reduce-scatter), ``2 Psi (N-1)/N`` with ``reshard_after_forward=False`` (the
forward's full parameters are kept for backward, like ZeRO-2). Frozen
parameters are gathered but not reduce-scattered. Memory: ``Psi / N`` of
shards, plus up to ``prefetch + 1`` units' full parameters (and the root's),
plus two reductions in flight, plus the activations (all of them by default;
with ``remat=nothing_saveable`` those at unit boundaries and one unit's inner
activations). The root unit stays gathered through forward and through backward.

Large-model options (helpers in ``_units.py``):

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
import copy
import dataclasses
import difflib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfn import pytree
from shardfn.functional import FunctionalModel
from shardfn.mesh import AxisName, Mesh
from shardfn.primitives import _comm, stats
from shardfn.primitives.flat import all_reduce_async
from shardfn.spec import Layout, P, local_shape, shard
from shardfn.transforms._unit_exchange import TagCounter, UnitGather, UnitReduce, no_functorch
from shardfn.transforms._units import (
    Accumulator,
    NoReduce,
    OffloadPolicy,
    Placement,
    UnitRecorder,
    UnitReplayer,
)
from shardfn.transforms.accumulate import split_batch
from shardfn.transforms.precision import Precision, cast_floating
from shardfn.transforms.remat import Policy, nothing_saveable

__all__ = ["OffloadPolicy", "ShardedModel", "UnitPolicy", "shard_params"]

_ops = torch.ops._c10d_functional
_ACTIVE: list[_Step] = []  # apply() calls whose root forward is running, innermost last

UnitPolicy = type | tuple[type, ...] | int | Sequence[str] | None
"""A module class (or tuple of classes), a minimum parameter count, module paths, or None."""

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
    _units: tuple[_Unit, ...]
    _root: _Unit
    _ax: _comm.Axis
    _replicate_ax: _comm.Axis | None
    _all_ax: _comm.Axis
    _scale: float
    _local_shapes: dict[str, tuple[int, ...]]
    _buffer_set: frozenset[str]
    _trainable_set: frozenset[str]
    _unit_trainable: tuple[str, ...]
    _init_groups: tuple[tuple[str, ...], ...]
    _order_hint: list[int]  # unit order of the previous forward (a prefetch guess only)
    _token: object
    _place: Placement  # dtypes and devices (precision, offload)
    _masters: dict[str, torch.dtype]  # each leaf's own (master) dtype

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
            out.update(self._shard_leaves(self.functional.init_subset(seed, paths, device=device)))
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
        return self._shard_leaves(full_params)

    def apply(self, shards: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward on this rank's shards, gathering units just in time.

        Differentiable w.r.t. the shards (and tensor inputs) under ``torch.func``
        transforms and plain autograd; the shard gradients are already reduced
        over the data-parallel axes (see ``grad_reduce``).

        Args:
            shards: ``name -> local shard`` as :meth:`init` / :meth:`shard` return.
            *args, **kwargs: passed to the module's forward.

        Returns:
            Whatever the module's forward returns (floating outputs in
            ``precision.output_dtype`` if set).

        Raises:
            ValueError / TypeError: a missing or unexpected leaf, or one whose shape is
                not its local shard shape (a full tree, or one sharded for another mesh).

        Example:
            >>> logits = model.apply(shards, tokens)
        """
        self.check(shards)
        place, precision = self._place, self.precision
        if place.offload:  # inputs go where the units compute (differentiably)
            args, kwargs = pytree.tree_map(
                lambda x: x.to(place.compute) if isinstance(x, torch.Tensor) else x,
                (args, kwargs))
        if precision is not None and precision.cast_inputs:
            args, kwargs = cast_floating((args, kwargs), precision.param_dtype)
        arg_spec, arg_tensors = _TreeSpec.of((args, kwargs))
        grad = torch.is_grad_enabled()
        step = _Step(self, arg_spec, keep=grad and not self.reshard_after_forward, record=grad)
        # inputs a gradient may be asked for (the root's vjp is built in forward)
        step.arg_wants = [_is_float(t) and (t.requires_grad or _is_wrapped(t))
                          for t in arg_tensors]
        outputs = _RootFn.apply(step, *[shards[name] for name in self.names], *arg_tensors)
        out = step.out_spec.build(outputs)
        return cast_floating(out, precision.output_dtype) if precision is not None else out

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
                for name, grad in self._reduce_accumulated(accumulator).items():
                    if name in grads:
                        grads[name] = grads[name] + grad
            return pytree.tree_map(lambda t: t / k, (grads, loss))

        return fn

    def _reduce_accumulated(self, accumulator: Accumulator) -> Params:
        """Reduce every unit's summed full gradients once: ``name -> shard gradient``."""
        some = [g for grads in accumulator.grads.values() for g in grads.values()]
        tags = TagCounter()
        device = some[0].device if some else (self._place.compute or self.mesh.device)
        out: Params = {}
        for unit in (*self._units, self._root):  # every rank reduces every unit, in order
            grads = accumulator.grads.pop(unit.index, {})
            for name in unit.owned_grads:  # a unit no micro-batch called: zeros
                if name not in grads:
                    grads[name] = torch.zeros(self.specs[name].shape, dtype=self._masters[name],
                                              device=device)
            out.update(_Reduce(self, unit, grads, tags()).wait())
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
                             f"{unexpected}" + _suggest(unexpected, self.names))
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
    ``prefetch + 1`` units' full parameters, two reductions in flight, and the
    activations ``remat`` keeps.
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

    paths = _resolve_units(model, units)
    token = object()
    unit_plans, root = _build_units(model, paths, ax.size, token, place)
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
        _scale=1.0 / all_ax.size if grad_reduce == "mean" else 1.0,
        _local_shapes=local_shapes, _buffer_set=frozenset(model.buffer_names),
        _trainable_set=trainable, _unit_trainable=in_units,
        _init_groups=_init_groups(model, paths), _order_hint=[], _token=token,
        _place=place, _masters={name: shapes[name].dtype for name in model.names},
    )


# ``sf.transforms.shard_params`` is this function (the package re-exports it over the module
# name), so the policy class is reachable from it as well: shard_params.OffloadPolicy(...)
shard_params.OffloadPolicy = OffloadPolicy  # type: ignore[attr-defined]


# ================================================================ choosing units


def _resolve_units(model: FunctionalModel, units: UnitPolicy) -> tuple[str, ...]:
    named = dict(model.module.named_modules())
    if units is None:
        return ()
    if isinstance(units, type) or (isinstance(units, tuple) and units
                                   and all(isinstance(u, type) for u in units)):
        classes = units if isinstance(units, tuple) else (units,)
        chosen = [p for p, m in named.items() if p and isinstance(m, classes)]
        what = f"units={'/'.join(c.__name__ for c in classes)}"
    elif isinstance(units, int) and not isinstance(units, bool):
        if units < 1:
            raise ValueError(f"units={units}: a minimum parameter count must be >= 1")
        chosen = []
        _by_size("", model.module, units, chosen)
        what = f"units={units} (min parameters per unit)"
    elif isinstance(units, Sequence) and not isinstance(units, str) and all(
            isinstance(p, str) for p in units):
        for path in units:
            if path == "":
                raise ValueError("units: '' is the root, which is always the root unit")
            if path not in named:
                raise ValueError(f"units: no submodule at path {path!r}"
                                 + _suggest([path], list(named)))
        chosen = list(units)
        what = f"units={list(units)}"
    else:
        raise TypeError(f"units must be a module class, a tuple of classes, an int (min "
                        f"parameters) or a list of module paths; got {units!r}")
    chosen = [p for p in named if p in set(chosen)]  # registration order
    outermost = [p for p in chosen if not any(p.startswith(q + ".") for q in chosen if q != p)]
    if not outermost:
        kinds = sorted({type(m).__name__ for p, m in named.items() if p})
        raise ValueError(f"{what} matches no submodule of {type(model.module).__name__}; its "
                         f"submodule classes are {kinds}")
    for path in outermost:
        if not _callable(named[path]):
            raise ValueError(f"unit {path!r} is a {type(named[path]).__name__}, which has no "
                             f"forward to run; choose the modules inside it")
    return tuple(outermost)


def _callable(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _by_size(path: str, module: nn.Module, min_numel: int, chosen: list[str]) -> bool:
    """Post-order: a callable module with no unit inside holding >= min_numel becomes one."""
    inside = False
    for name, child in module.named_children():
        inside |= _by_size(f"{path}.{name}" if path else name, child, min_numel, chosen)
    if not inside and path and _callable(module):
        if sum(p.numel() for p in module.parameters()) >= min_numel:
            chosen.append(path)
            return True
    return inside


# ================================================================ the plan of each unit


@dataclasses.dataclass(frozen=True)
class _Flat:
    """One flat buffer of a unit: its dim-0-sharded leaves of one dtype, end to end."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # global shapes
    local_shapes: tuple[tuple[int, ...], ...]  # padded shard shapes
    offsets: tuple[int, ...]  # start of each shard in this rank's chunk
    chunk: int  # elements per rank
    dtype: torch.dtype  # what the collective moves (param_dtype / reduce_dtype)
    master: torch.dtype  # the leaves' own dtype


@dataclasses.dataclass(frozen=True, eq=False)
class _Unit:
    """A unit: the module ``functional_call`` runs and the leaves it owns or uses."""

    index: int  # position in ShardedModel.units; -1 for the root unit
    path: str  # "" for the root
    module: nn.Module  # the unit's submodule; for the root, the skeleton with units wrapped
    rel: tuple[tuple[str, str], ...]  # (leaf name, name inside ``module``) of each leaf used
    sharded: tuple[str, ...]  # owned parameters split on dim 0 (gathered)
    replicated: tuple[str, ...]  # owned 0-dim parameters
    external: tuple[str, ...]  # root-owned parameters it uses (tied across units), full
    grad_inputs: tuple[str, ...]  # trainable: owned sharded, owned replicated, external
    owned_grads: tuple[str, ...]  # trainable owned: the gradients its reduction returns
    gather: tuple[_Flat, ...]  # all sharded leaves
    scatter: tuple[_Flat, ...]  # trainable sharded leaves

    @property
    def label(self) -> str:
        return repr(self.path) if self.path else "<root>"


class _UnitCall(nn.Module):
    """Stands in for a unit inside the root skeleton and hands the call to the running step."""

    def __init__(self, index: int, inner: nn.Module, token: object):
        super().__init__()
        self.__dict__["_shardfn_inner"] = inner  # not registered: its leaves are the unit's
        self.__dict__["_shardfn_token"] = token
        self._shardfn_index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        step = _ACTIVE[-1] if _ACTIVE else None
        if step is None or step.model._token is not self.__dict__["_shardfn_token"]:
            raise RuntimeError("a shard_params unit was called outside its model's apply()")
        return step.call_unit(self._shardfn_index, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # attributes the root reads (never parameters)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_shardfn_inner"], name)


def _build_units(model: FunctionalModel, paths: tuple[str, ...], n: int, token: object,
                 place: Placement) -> tuple[tuple[_Unit, ...], _Unit]:
    skeleton = copy.deepcopy(model.module)  # meta: free; the wrapping must not touch `model`
    inner = [skeleton.get_submodule(p) for p in paths]
    used: dict[int, dict[str, str]] = {}  # unit index -> leaf name -> its name in the module
    for index, (path, module) in enumerate(zip(paths, inner, strict=True)):
        used[index] = _leaf_names(module, model, path)
    for index, path in enumerate(paths):
        parent, _, key = path.rpartition(".")
        skeleton.get_submodule(parent)._modules[key] = _UnitCall(index, inner[index], token)
    used[-1] = _leaf_names(skeleton, model, "")

    users: dict[str, set[int]] = {}
    for index, leaves in used.items():
        for name in leaves:
            users.setdefault(name, set()).add(index)
    params, shapes = set(model.param_names), model.param_shapes()
    trainable = set(model.trainable_names)
    owner = {name: (min(who) if len(who) == 1 else -1) for name, who in users.items()
             if name in params}

    def plan(index: int, path: str, module: nn.Module) -> _Unit:
        owned = [name for name in model.names if owner.get(name) == index]
        sharded = tuple(x for x in owned if len(shapes[x].shape) >= 1)
        replicated = tuple(x for x in owned if len(shapes[x].shape) == 0)
        external = tuple(x for x in model.names if x in used[index] and owner.get(x) == -1
                         and index != -1)
        grad_inputs = tuple(x for x in sharded + replicated + external if x in trainable)
        dims = {x: tuple(shapes[x].shape) for x in sharded}
        gather = {x: (place.compute_dtype(shapes[x].dtype), shapes[x].dtype) for x in sharded}
        scatter = {x: (place.comm_reduce_dtype(shapes[x].dtype), shapes[x].dtype)
                   for x in sharded}
        owned_grads = tuple(x for x in grad_inputs if x not in external)
        return _Unit(index, path, module, tuple(used[index].items()), sharded, replicated,
                     external, grad_inputs, owned_grads, _flats(sharded, dims, gather, n),
                     _flats([x for x in sharded if x in trainable], dims, scatter, n))

    units = tuple(plan(i, p, m) for i, (p, m) in enumerate(zip(paths, inner, strict=True)))
    return units, plan(-1, "", skeleton)


def _leaf_names(module: nn.Module, model: FunctionalModel, prefix: str) -> dict[str, str]:
    """Canonical leaf name -> the first name ``module`` registers it under."""
    found: dict[str, str] = {}
    named = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]
    for rel, _ in named:
        full = f"{prefix}.{rel}" if prefix else rel
        found.setdefault(model.tied.get(full, full), rel)
    return found


def _flats(names: Sequence[str], shapes: Mapping[str, tuple], dtypes: Mapping,
           n: int) -> tuple[_Flat, ...]:
    """One flat buffer per (communication dtype, master dtype) pair of ``dtypes[name]``."""
    by_dtype: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name in names:
        by_dtype.setdefault(dtypes[name], []).append(name)
    out = []
    for (dtype, master), group in by_dtype.items():
        local = [(math.ceil(shapes[x][0] / n),) + tuple(shapes[x][1:]) for x in group]
        sizes = [math.prod(s) for s in local]
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        out.append(_Flat(tuple(group), tuple(shapes[x] for x in group), tuple(local), offsets,
                         sum(sizes), dtype, master))
    return tuple(out)


def _init_groups(model: FunctionalModel, paths: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Module paths to initialise together: each unit's subtree, then everything else."""
    inside: dict[str, list[str]] = {p: [] for p in paths}
    rest: list[str] = []
    for module_path in model.module_paths:
        unit = next((p for p in paths if module_path == p or module_path.startswith(p + ".")),
                    None)
        (inside[unit] if unit is not None else rest).append(module_path)
    return (*(tuple(inside[p]) for p in paths), tuple(rest))


# ================================================================ collectives of a unit


class _Reduce:
    """The reduction of one unit's gradients: reduce-scatters issued now, finished by wait().

    Takes ownership of ``grads`` (full gradients of the unit's owned trainable leaves).
    They are reduced in the reduce dtype; the shard gradients come back in the master
    dtype, on the storage device. With HSDP the shards are then summed over the
    replica axis.
    """

    def __init__(self, model: ShardedModel, unit: _Unit, grads: dict[str, torch.Tensor],
                 tag: int):
        self.model, self.unit = model, unit
        self.replicated = {n: grads.pop(n).detach() for n in unit.replicated if n in grads}
        self.exchange = UnitReduce(unit, grads, model._ax, tag)

    def wait(self) -> Params:
        """This rank's shard gradients (``name -> tensor`` of the local shard shape)."""
        model, unit = self.model, self.unit
        chunks = self.exchange.wait()
        rep = model._replicate_ax
        if rep is not None and rep.size > 1:
            with stats.collective_scope(rep.describe(f"psum of unit {unit.label}")):
                chunks = [_ops.wait_tensor(h) for h in [all_reduce_async(c, rep) for c in chunks]]
        place, out = model._place, {}
        for flat, chunk in zip(unit.scatter, chunks, strict=True):
            chunk = chunk.to(flat.master)  # a fresh tensor of ours: scaled in place
            if model._scale != 1.0:
                with no_functorch():
                    chunk.mul_(model._scale)
            for name, local, offset in zip(flat.names, flat.local_shapes, flat.offsets,
                                           strict=True):
                out[name] = place.to_storage(chunk[offset:offset + math.prod(local)].view(local))
        for name, grad in self.replicated.items():
            master = model._masters[name]
            reduced = _comm.psum(grad.to(place.comm_reduce_dtype(master)), model._all_ax)
            out[name] = place.to_storage(reduced.to(master) * model._scale)
        return out


# ================================================================ one apply() call


class _TreeSpec(NamedTuple):
    """A pytree with its tensor leaves taken out (they travel through autograd.Functions)."""

    treedef: Any
    is_tensor: tuple[bool, ...]
    constants: tuple[Any, ...]  # the non-tensor leaves

    @staticmethod
    def of(tree: Any) -> tuple[_TreeSpec, list[torch.Tensor]]:
        leaves, treedef = pytree.tree_flatten(tree)
        is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
        constants = tuple(x for x, t in zip(leaves, is_tensor, strict=True) if not t)
        return _TreeSpec(treedef, is_tensor, constants), [x for x in leaves if
                                                           isinstance(x, torch.Tensor)]

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        tensors, constants = iter(tensors), iter(self.constants)
        leaves = [next(tensors) if t else next(constants) for t in self.is_tensor]
        return pytree.tree_unflatten(self.treedef, leaves)


@dataclasses.dataclass
class _Saved:
    """What one unit call in forward leaves for backward."""

    outputs: list[torch.Tensor]  # its output tensors, replayed by the root's recompute
    versions: list[int]  # their version counters, to catch in-place changes
    spec: _TreeSpec
    rng_before: Any
    rng_after: Any
    replay: dict | None = None  # the remat policy's saved op outputs inside the unit
    vjp_fn: Callable | None = None  # activations kept (remat=None): the unit's vjp
    gather: UnitGather | None = None  # its full parameters (storage released until backward)


class _Step:
    """The state of one ``apply`` call, shared by its forward and its backward."""

    def __init__(self, model: ShardedModel, arg_spec: _TreeSpec, keep: bool, record: bool):
        self.model = model
        self.arg_spec = arg_spec
        self.keep = keep  # keep full params for backward (reshard_after_forward=False)
        self.record = record  # a backward may follow: save unit outputs for replay
        self.shards: Params = {}  # plain local shards and buffers (as _RootFn.forward got them)
        self.local: Params = {}  # replicated leaves and buffers on the compute device, cast
        self.root_plain: Params = {}  # the root's full parameters, plain
        self.root_values: Params = {}  # the root's full parameters in the recompute (primals)
        self.overrides: Params = {}  # unit shards as primals of the root's recompute
        self.mode = "forward"
        self.order: list[int] = []  # unit index of each call, in forward order
        self.saved: list[_Saved] = []
        self.replay_at = 0
        self.prefetched: dict[tuple[str, int], UnitGather] = {}
        self.tags = TagCounter()  # message tags of this call's exchanges
        self.reducing: dict[int, _Reduce] = {}  # position -> its deferred gradient reduction
        self.finished: set[int] = set()  # positions whose deferred reduction nobody will wait
        self.kept: dict[int, Params] = {}  # unit index (-1: root) -> full params
        self.kept_uses: dict[int, int] = {}
        self.out_spec: _TreeSpec | None = None
        self.rng_root: Any = None
        self.accumulator = Accumulator.current(model._token)  # reduce_once: add, don't reduce
        self.root_mode: UnitRecorder | UnitReplayer | None = None  # the root's remat mode
        self.root_replay: dict | None = None  # what the root's recorder saved
        self.root_vjp: Callable | None = None  # activations kept: the root's vjp from forward
        self.root_gather: UnitGather | None = None  # its parameters, released until backward
        self.done = False  # backward ran
        self.later_at: dict[int, tuple[str, ...]] = {}  # position -> the later_names it took
        self.arg_wants: list[bool] = []  # per tensor argument: may need a gradient

    def gather(self, unit: _Unit) -> UnitGather:
        return UnitGather(unit, self.shards, self.model._ax, self.model._place, self.tags())

    def reduce(self, unit: _Unit, grads: dict[str, torch.Tensor]) -> _Reduce | NoReduce:
        """Start reducing ``unit``'s full gradients (or add them to the accumulator)."""
        if self.accumulator is not None:
            self.accumulator.add(unit.index, grads, self.model._masters)
            return NoReduce()
        return _Reduce(self.model, unit, grads, self.tags())

    @contextlib.contextmanager
    def unit_scope(self) -> Iterator[None]:
        """Hide a unit's ops from the root's remat recorder / replayer."""
        if self.root_mode is None:
            yield
        else:
            with self.root_mode.pause():
                yield

    # ---- gathering, with prefetch ----------------------------------------------------------
    def gathered(self, unit: _Unit, phase: str,
                 position: int) -> tuple[Params, UnitGather | None]:
        """Full parameters of ``unit`` for its call at ``position``, and their gather (None
        when kept from forward); prefetch the next ones."""
        if unit.index in self.kept:
            return self.kept[unit.index], None
        pending = self.prefetched.pop((phase, position), None)
        if pending is None or pending.unit is not unit:
            if pending is not None:
                pending.wait()  # a wrong guess: complete it and drop it
            pending = self.start_gather(unit, phase, position)
        full = pending.wait()
        self.prefetch(phase, position)
        if self.keep and phase == "forward":
            self.kept[unit.index] = full
        return full, pending

    def start_gather(self, unit: _Unit, phase: str, position: int) -> UnitGather:
        """Issue the gather for a call: in backward, into the storage its forward kept."""
        if phase == "backward" and self.saved[position].gather is not None:
            return self.saved[position].gather.start(self.shards, self.tags())
        return self.gather(unit)

    def prefetch(self, phase: str, position: int) -> None:
        model = self.model
        if phase == "forward":
            guess = model._order_hint or list(range(len(model._units)))
            ahead = [(q, guess[q]) for q in range(position + 1, position + 1 + model.prefetch)
                     if q < len(guess)]
        else:
            ahead = [(q, self.order[q]) for q in range(position - 1, position - 1 - model.prefetch,
                                                        -1) if q >= 0]
        for q, index in ahead:
            if (phase, q) not in self.prefetched and index not in self.kept:
                self.prefetched[(phase, q)] = self.start_gather(model._units[index], phase, q)

    def drop_prefetched(self) -> None:
        for pending in self.prefetched.values():
            pending.wait()
        self.prefetched.clear()

    def params_for(self, unit: _Unit, full: Params, override: Mapping = ()) -> Params:
        """What ``functional_call`` on the unit's module gets, by the module's own names."""
        params = {}
        for name, rel in unit.rel:
            if name in override:
                params[rel] = override[name]
            elif name in full:
                params[rel] = full[name]
            elif name in self.model._buffer_set:
                params[rel] = self.local[name].clone()  # private: forward may update it
            elif name in unit.external:
                params[rel] = self.root_plain[name]
            else:  # a replicated (0-dim) parameter
                params[rel] = self.local[name]
        return params

    # ---- forward ---------------------------------------------------------------------------
    def forward_root(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        model = self.model
        root, names, place = model._root, model.names, model._place
        self.shards = dict(zip(names, tensors[:len(names)], strict=True))
        local = [n for u in (*model._units, root) for n in u.replicated] + [
            n for n in names if n in model._buffer_set]
        self.local = {n: place.cast(place.to_compute(self.shards[n])) for n in local}
        args, kwargs = self.arg_spec.build(tensors[len(names):])
        pending = self.gather(root)
        self.prefetch("forward", -1)
        full = pending.wait()
        if self.keep:
            self.kept[-1] = full
        self.root_plain = {**full, **{n: self.local[n] for n in root.replicated}}
        self.rng_root = _rng_state()
        params = self.params_for(root, self.root_plain)
        if self.record and model._policy is not None:
            self.root_mode = UnitRecorder(model._policy, params)
        saving = self.record and model._save
        try:
            if saving:
                out = self.forward_root_saving(args, kwargs)
            else:
                with _active(self), self.root_mode or contextlib.nullcontext():
                    out = _call(root, params, args, kwargs)
        finally:
            self.drop_prefetched()
        if saving and not self.keep:  # the root's vjp holds its parameters: free the storage
            pending.release()
            self.root_gather = pending
        if self.root_mode is not None:
            self.root_replay, self.root_mode = self.root_mode.finish(), None
        del params, pending, full
        self.model._order_hint[:] = self.order
        self.root_plain = {}
        self.out_spec, outputs = _TreeSpec.of(out)
        inputs = {id(t) for t in tensors}
        return tuple(x.clone() if id(x) in inputs else x for x in outputs)

    def forward_root_saving(self, args: tuple, kwargs: dict) -> Any:
        """Run the root recording its autograd graph (kept for backward: no recompute).

        Each unit call computes first (on plain inputs, recording its own graph), then
        its output enters the root's graph through ``_UnitFn`` as in a replay.
        """
        model, root = self.model, self.model._root
        spec, tensors = _TreeSpec.of((args, kwargs))
        with torch.enable_grad():
            root_train = {n: self.root_plain[n].detach().requires_grad_() for n in root.grad_inputs}
            unit_train = {n: self.shards[n].detach().requires_grad_()
                          for n in model._unit_trainable}
            tensors = [t.detach().requires_grad_() if self.arg_wants[i] else t
                       for i, t in enumerate(tensors)]
            self.mode, self.replay_at, self.overrides = "forward+replay", 0, unit_train
            self.root_values = {**self.root_plain, **root_train}
            try:
                with _active(self):
                    out = _call(root, self.params_for(root, self.root_values),
                                *spec.build(tensors))
            finally:
                self.mode = "forward"
                self.root_values, self.overrides = {}, {}
        self.check_guesses()
        wanted = {i: tensors[i] for i, w in enumerate(self.arg_wants) if w}
        self.root_vjp = _recorded_vjp(out, (root_train, unit_train, wanted))
        return _detached(out)

    def call_unit(self, index: int, args: tuple, kwargs: dict) -> Any:
        unit = self.model._units[index]
        with self.unit_scope():
            if self.mode == "replay":
                return self.replay_unit(unit, args, kwargs)
            if self.mode == "forward+replay":  # compute on plain inputs, then join the graph
                spec, tensors = _TreeSpec.of((args, kwargs))
                self.forward_unit(unit, *spec.build(_plain(tensors)))
                return self.replay_unit(unit, args, kwargs)
            return self.forward_unit(unit, args, kwargs)

    def forward_unit(self, unit: _Unit, args: tuple, kwargs: dict) -> Any:
        position = len(self.order)
        self.order.append(unit.index)
        rng_before = _rng_state()
        full, gather = self.gathered(unit, "forward", position)
        vjp_fn, recorder = None, None
        if self.record and self.model._save:
            out, vjp_fn = self.forward_saving(unit, full, args, kwargs)
            if not self.keep:  # autograd holds the parameters: free their storage instead
                gather.release()
            else:
                gather = None
        else:
            gather = None
            params = self.params_for(unit, full)
            if self.record and self.model._policy is not None:
                recorder = UnitRecorder(self.model._policy, params)
            with recorder or contextlib.nullcontext():
                out = _call(unit, params, args, kwargs)
            del params
        del full
        if self.keep:
            self.kept_uses[unit.index] = self.kept_uses.get(unit.index, 0) + 1
        if self.record:
            spec, tensors = _TreeSpec.of(out)
            self.saved.append(_Saved(tensors, [t._version for t in tensors], spec, rng_before,
                                     _rng_state(), recorder.finish() if recorder else None,
                                     vjp_fn, gather))
        return out

    def forward_saving(self, unit: _Unit, full: Params, args: tuple,
                       kwargs: dict) -> tuple[Any, Callable]:
        """Run a unit recording its autograd graph (w.r.t. its trainable leaves and floating
        inputs): its output, and the vjp its backward calls (no recompute)."""
        values = {**self.local, **self.root_plain, **full}
        spec, tensors = _TreeSpec.of((args, kwargs))
        with torch.enable_grad():
            train = {n: values[n].detach().requires_grad_() for n in unit.grad_inputs}
            tensors = [t.detach().requires_grad_() if _is_float(t) else t for t in tensors]
            out = _call(unit, self.params_for(unit, full, train), *spec.build(tensors))
        floats = {i: t for i, t in enumerate(tensors) if _is_float(t)}
        return _detached(out), _recorded_vjp(out, (train, floats))

    def replay_unit(self, unit: _Unit, args: tuple, kwargs: dict) -> Any:
        position = self.replay_at
        self.replay_at += 1
        if position >= len(self.order) or self.order[position] != unit.index:
            raise RuntimeError(
                f"shard_params: when recomputed for backward, the root forward made call "
                f"{position} to unit {unit.label}, but in forward the unit calls were "
                f"{[self.model.units[i] for i in self.order]}; the root forward must be "
                f"deterministic"
            )
        saved = self.saved[position]
        if any(t._version != v for t, v in zip(saved.outputs, saved.versions, strict=True)):
            raise RuntimeError(
                f"shard_params: an output of unit {unit.label} was modified in place after the "
                f"unit returned it; backward replays that output, so update it out of place "
                f"(x = x + y rather than x += y)"
            )
        values = {**self.root_values, **self.overrides}
        arg_spec, arg_tensors = _TreeSpec.of((args, kwargs))
        self.later_at[position] = later = self.later_names(position)
        inputs = [values[name] for name in unit.grad_inputs + later]
        outputs = _UnitFn.apply(self, position, arg_spec, *inputs, *arg_tensors)
        saved.outputs = []  # the replayed outputs now own the storage
        _set_rng_state(saved.rng_after)
        return saved.spec.build(outputs)

    def later_names(self, position: int) -> tuple[str, ...]:
        """Shards of the next call's unit: their gradient comes out of this call's backward.

        The reduce-scatter a unit call issues in its backward is waited in the backward of
        the call before it (which runs next), so it overlaps with that call's recompute.
        """
        if self.mode == "forward+replay":  # the next call has not happened yet: guess it
            guess = self.model._order_hint or list(range(len(self.model._units)))
            following = guess[position + 1] if position + 1 < len(guess) else None
        else:
            following = self.order[position + 1] if position + 1 < len(self.order) else None
        return () if following is None else self.model._units[following].owned_grads

    def check_guesses(self) -> None:
        """After a forward that guessed each call's successor: a call whose predecessor
        guessed wrong waits for its own reduction (nobody else would return it)."""
        for position in range(len(self.order) - 1):
            actual = self.model._units[self.order[position + 1]].owned_grads
            if self.later_at.get(position) != actual:
                self.finished.add(position + 1)

    # ---- backward --------------------------------------------------------------------------
    def backward_root(self, arg_tensors, grads, outputs_float, needs_grad) -> tuple:
        model, root = self.model, self.model._root
        if self.mode == "replay" or self.done:
            raise RuntimeError("shard_params: backward through one apply() call can run only "
                               "once (it frees what it saved); call model.apply again")
        self.done = True
        if self.root_vjp is not None:
            return self.backward_root_saved(arg_tensors, grads, outputs_float, needs_grad)
        full = self.kept.pop(-1, None)
        if full is None:
            pending = self.gather(root)
            self.prefetch("backward", len(self.order))
            full = pending.wait()
        self.root_plain = {**full, **{n: self.local[n] for n in root.replicated}}
        root_train = {n: self.root_plain[n] for n in root.grad_inputs}
        unit_train = {n: self.shards[n] for n in model._unit_trainable}
        n_leaves = len(model.names)
        float_args = {i: t for i, t in enumerate(arg_tensors)
                      if t.is_floating_point() and needs_grad[n_leaves + i]}
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)

        def recompute(root_train, unit_train, float_args):
            args, kwargs = self.arg_spec.build([float_args.get(i, t)
                                                for i, t in enumerate(arg_tensors)])
            self.mode, self.replay_at, self.overrides = "replay", 0, unit_train
            self.root_values = {**self.root_plain, **root_train}
            if self.root_replay is not None:
                self.root_mode = UnitReplayer(self.root_replay)
            try:
                with (_active(self), _forked_rng(self.rng_root),
                      self.root_mode or contextlib.nullcontext()):
                    out = _call(root, self.params_for(root, self.root_values), args, kwargs)
            finally:
                self.root_mode = None
            return _float_outputs(out, outputs_float)

        _, vjp_fn = torch.func.vjp(recompute, root_train, unit_train, float_args)
        g_root, g_units, g_args = vjp_fn(cotangents)
        del vjp_fn, full, root_train
        return self.finish_backward(g_root, g_units, g_args, len(arg_tensors))

    def backward_root_saved(self, arg_tensors, grads, outputs_float, needs_grad) -> tuple:
        """Backward of a forward that kept its vjp: refill the root's parameters, run it."""
        kept = self.kept.pop(-1, None)
        if kept is None:
            self.root_gather.start(self.shards, self.tags())
            self.prefetch("backward", len(self.order))
            self.root_gather.wait()
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
        g_root, g_units, g_args = self.root_vjp(cotangents)
        self.root_vjp = None
        if self.root_gather is not None:
            self.root_gather.release()
            self.root_gather = None
        n_leaves = len(self.model.names)
        g_args = {i: g for i, g in g_args.items() if needs_grad[n_leaves + i]}
        return self.finish_backward(g_root, g_units, g_args, len(arg_tensors))

    def finish_backward(self, g_root, g_units, g_args, n_args: int) -> tuple:
        """Reduce the root's gradients, collect the units' and return the leaves' grads."""
        model, root = self.model, self.model._root
        self.drop_prefetched()
        self.root_values, self.overrides, self.root_plain, self.saved = {}, {}, {}, []
        self.root_replay = None
        g_units = dict(g_units)
        root_reduce = self.reduce(root, dict(g_root))
        for pending in self.reducing.values():  # the first call's, and any left unclaimed
            for name, grad in pending.wait().items():
                g_units[name] = g_units[name] + grad
        self.reducing.clear()
        reduced = root_reduce.wait()
        trainable = model._trainable_set
        leaf_grads = [(reduced[n] if n in reduced else g_units.get(n)) if n in trainable else None
                      for n in model.names]
        return (*leaf_grads, *[g_args.get(i) for i in range(n_args)])

    def backward_unit(self, position: int, arg_spec: _TreeSpec, arg_tensors, grads,
                      outputs_float, needs_grad) -> tuple:
        unit = self.model._units[self.order[position]]
        full, _ = self.gathered(unit, "backward", position)
        if unit.index in self.kept:
            self.kept_uses[unit.index] -= 1
            if not self.kept_uses[unit.index]:
                del self.kept[unit.index]
        later = self.later_at[position]
        n_inputs = len(unit.grad_inputs) + len(later)
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
        saved = self.saved[position]
        if saved.vjp_fn is not None:  # activations kept: the forward's vjp, on refilled params
            g_train, g_args = saved.vjp_fn(cotangents)
            g_train = dict(g_train)
            saved.vjp_fn = None
            if saved.gather is not None:
                saved.gather.release()
                saved.gather = None
        else:
            g_train, g_args = self.recompute_vjp(unit, saved, full, arg_spec, arg_tensors,
                                                 cotangents, outputs_float,
                                                 needs_grad[n_inputs:])
        full = None
        external = {n: g_train.pop(n).detach() for n in unit.external if n in g_train}
        reduce = self.reduce(unit, g_train)
        # the next call's reduction, issued in its backward (which ran just before this one)
        later_grads: Params = {}
        if later:
            pending = self.reducing.pop(position + 1, None)
            if pending is not None:
                later_grads = pending.wait()
            else:  # its backward has not run (a branch): it must finish its own
                self.finished.add(position + 1)
        if position in self.finished:
            own = reduce.wait()
        else:  # the call before this one (or the root) waits for it and returns the grads
            self.reducing[position] = reduce
            own = {}
        grad_inputs = [external[n] if n in external else own.get(n) for n in unit.grad_inputs]
        return (*grad_inputs, *[later_grads.get(n) for n in later],
                *[g_args.get(i) if needs_grad[n_inputs + i] else None
                  for i in range(len(arg_tensors))])

    def recompute_vjp(self, unit: _Unit, saved: _Saved, full: Params, arg_spec: _TreeSpec,
                      arg_tensors, cotangents, outputs_float, needs_grad) -> tuple[dict, dict]:
        """Recompute a unit call under ``torch.func.vjp`` (replaying what its policy
        recorded, with the forward's RNG state) and apply it to ``cotangents``."""
        values = {**self.local, **self.root_plain, **full}
        train = {n: values[n] for n in unit.grad_inputs}
        float_args = {i: t for i, t in enumerate(arg_tensors)
                      if t.is_floating_point() and needs_grad[i]}

        def recompute(train, float_args):
            args, kwargs = arg_spec.build([float_args.get(i, t) for i, t in enumerate(arg_tensors)])
            replayer = UnitReplayer(saved.replay) if saved.replay is not None else None
            with _forked_rng(saved.rng_before), replayer or contextlib.nullcontext():
                out = _call(unit, self.params_for(unit, full, train), args, kwargs)
            return _float_outputs(out, outputs_float)

        _, vjp_fn = torch.func.vjp(recompute, train, float_args)
        saved.replay = None  # the recompute has what it needs
        g_train, g_args = vjp_fn(cotangents)
        return dict(g_train), g_args


class _RootFn(torch.autograd.Function):
    """The whole apply(): inputs are every leaf and every tensor argument."""

    @staticmethod
    def forward(step: _Step, *tensors: torch.Tensor):
        return step.forward_root(tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        step = ctx.step = inputs[0]
        ctx.save_for_backward(*inputs[1 + len(step.model.names):])
        ctx.outputs_float = [_is_float(o) for o in output]
        ctx.mark_non_differentiable(*[o for o in output if not _is_float(o)])

    @staticmethod
    def backward(ctx, *grads):
        saved, grads = _plain(ctx.saved_tensors), _plain(grads)
        return None, *ctx.step.backward_root(saved, grads, ctx.outputs_float,
                                              ctx.needs_input_grad[1:])


class _UnitFn(torch.autograd.Function):
    """One unit call inside the root's recompute: forward replays, backward does the work."""

    @staticmethod
    def forward(step: _Step, position: int, arg_spec: _TreeSpec, *tensors: torch.Tensor):
        return tuple(t.detach() for t in step.saved[position].outputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        step, position, arg_spec = inputs[:3]
        unit = step.model._units[step.order[position]]
        n_inputs = len(unit.grad_inputs) + len(step.later_at[position])
        ctx.step, ctx.position, ctx.arg_spec = step, position, arg_spec
        ctx.save_for_backward(*inputs[3 + n_inputs:])
        ctx.outputs_float = [_is_float(o) for o in output]
        ctx.mark_non_differentiable(*[o for o in output if not _is_float(o)])

    @staticmethod
    def backward(ctx, *grads):
        saved, grads = _plain(ctx.saved_tensors), _plain(grads)
        return None, None, None, *ctx.step.backward_unit(
            ctx.position, ctx.arg_spec, saved, grads, ctx.outputs_float, ctx.needs_input_grad[3:])


# ================================================================ small helpers


def _call(unit: _Unit, params: Params, args: tuple, kwargs: dict) -> Any:
    return torch.func.functional_call(unit.module, params, args, kwargs, tie_weights=True,
                                      strict=True)


def _plain(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Strip functorch wrappers (saved tensors of a finished vjp level would trip its asserts)."""
    out = []
    for t in tensors:
        while t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t):
            t = torch._C._functorch.get_unwrapped(t)
        out.append(None if t is None else t.detach())
    return out


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _is_float(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _float_outputs(out: Any, outputs_float: Sequence[bool]) -> tuple[torch.Tensor, ...]:
    tensors = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return tuple(x for x, f in zip(tensors, outputs_float, strict=True) if f)


@contextlib.contextmanager
def _active(step: _Step) -> Iterator[None]:
    _ACTIVE.append(step)
    try:
        yield
    finally:
        _ACTIVE.remove(step)


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _recorded_vjp(out: Any, groups: tuple[Mapping, ...]) -> Callable:
    """The vjp of a recorded autograd graph from the floating tensors of ``out`` to the
    tensors of ``groups`` (mappings key -> leaf requiring grad).

    Returns ``fn(cotangents) -> tuple of {key: grad}`` (one per group, zeros where
    unused), like ``torch.func.vjp`` of the same computation. It runs plain autograd
    with functorch disabled, so it may be called inside a ``torch.func`` transform's
    backward; it frees the graph.
    """
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and _is_float(o)]
    inputs = [t for group in groups for t in group.values()]

    def vjp_fn(cotangents: Sequence[torch.Tensor]) -> tuple[dict, ...]:
        pairs = [(o, g) for o, g in zip(outs, cotangents, strict=True) if o.requires_grad]
        grads: Sequence[torch.Tensor | None] = [None] * len(inputs)
        if pairs and inputs:
            with no_functorch():
                grads = torch.autograd.grad([o for o, _ in pairs], inputs,
                                            [g for _, g in pairs], allow_unused=True)
        it = iter(torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g
                  for g, x in zip(grads, inputs, strict=True))
        return tuple({key: next(it) for key in group} for group in groups)

    return vjp_fn


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


@contextlib.contextmanager
def _forked_rng(state: tuple) -> Iterator[None]:
    """Run a block from the RNG ``state`` (as in forward), then restore the caller's."""
    before = _rng_state()
    _set_rng_state(state)
    try:
        yield
    finally:
        _set_rng_state(before)


def _suggest(names: Sequence[str], candidates: Sequence[str]) -> str:
    hints = [m for name in names[:3] for m in difflib.get_close_matches(name, candidates, n=1)]
    return f"; did you mean {hints}?" if hints else ""
