"""The plan of a `shard_params` model: computed once from the model, then frozen.

A *unit* is a submodule whose parameters are gathered together; what lies outside
every unit is the *root unit*. :func:`make_plan` chooses the units (``units=``),
wraps each in the root's skeleton with a :class:`UnitCall` (which hands the call to
the running ``apply``, :data:`RUNNING`), and records in a :class:`Plan` what every
later call needs: which leaves each unit owns, uses and reduces, their flat layouts
(:class:`Flat`), the axes, placement and dtypes, and the init groups. Nothing here
changes after it is built; the one thing carried between calls (the guess of the
next call's unit order) lives apart, in ``prefetch.PrefetchGuess``.

Example:
    >>> plan = make_plan(fmodel, mesh, "dp", units=Block, place=Placement.of(None, None))
    >>> [u.path for u in plan.units], plan.root.sharded
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from shardfn._functional_hf import call_recording
from shardfn.functional import FunctionalModel
from shardfn.mesh import AxisName, Mesh
from shardfn.primitives import _comm
from shardfn.spec import Layout, P, local_shape
from shardfn.transforms._fsdp_tp import copy_sharing_meshes
from shardfn.transforms.remat import Policy, nothing_saveable
from shardfn.transforms.shard_params.choose import (
    IgnoredPolicy,
    UnitPolicy,
    resolve_ignored,
    resolve_units,
    suggest,
)
from shardfn.transforms.shard_params.placement import Placement

__all__ = ["RESHARD", "RUNNING", "Flat", "GradReduce", "Plan", "Reshard", "Running", "Unit",
           "UnitCall", "build_units", "init_groups", "make_plan"]

#: ``grad_reduce=``: divide the reduced gradients by the data-parallel ranks, or not
GradReduce = Literal["mean", "sum"]
#: ``reshard_after_forward``: True (ZeRO-3), False (keep all), "units" (keep the root only)
Reshard = bool | Literal["units"]
RESHARD = (True, False, "units")


class Running(NamedTuple):
    """The ``apply`` call whose root module runs in this context, as its :class:`UnitCall` s
    see it."""

    token: object  # the plan's token: a UnitCall of another model refuses the call
    call_unit: Callable[[int, tuple, dict], Any]  # (unit index, args, kwargs) -> output


#: the ``apply`` call whose root forward (or its recompute) is running in this context
RUNNING: contextvars.ContextVar[Running | None] = contextvars.ContextVar(
    "shardfn_shard_params_running", default=None)

# ================================================================ the plan of each unit


@dataclasses.dataclass(frozen=True)
class Flat:
    """One flat buffer of a unit: its dim-0-sharded leaves of one dtype, end to end."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # global shapes
    local_shapes: tuple[tuple[int, ...], ...]  # padded shard shapes
    offsets: tuple[int, ...]  # start of each shard in this rank's chunk
    chunk: int  # elements per rank
    dtype: torch.dtype  # what the collective moves (param_dtype / reduce_dtype)
    master: torch.dtype  # the leaves' own dtype

    def subset(self, keep: Collection[str]) -> Flat | None:
        """The flat of only the leaves in ``keep`` (None if none; ``self`` if all)."""
        picked = [i for i, name in enumerate(self.names) if name in keep]
        if len(picked) == len(self.names):
            return self
        if not picked:
            return None
        local = tuple(self.local_shapes[i] for i in picked)
        sizes = [math.prod(s) for s in local]
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        return Flat(tuple(self.names[i] for i in picked), tuple(self.shapes[i] for i in picked),
                    local, offsets, sum(sizes), self.dtype, self.master)


@dataclasses.dataclass(frozen=True, eq=False)
class Unit:
    """A unit: the module its calls run (leaves swapped in) and the leaves it owns or uses."""

    index: int  # position in ShardedModel.units; -1 for the root unit
    path: str  # "" for the root
    module: nn.Module  # the unit's submodule; for the root, the skeleton with units wrapped
    rel: tuple[tuple[str, str], ...]  # (leaf name, name inside ``module``) of each leaf used
    sharded: tuple[str, ...]  # owned parameters split on dim 0 (gathered)
    replicated: tuple[str, ...]  # owned 0-dim parameters
    external: tuple[str, ...]  # root-owned parameters it uses (tied across units), full
    grad_inputs: tuple[str, ...]  # trainable: owned sharded, owned replicated, external
    owned_grads: tuple[str, ...]  # trainable owned: the gradients its reduction returns
    gather: tuple[Flat, ...]  # all sharded leaves
    scatter: tuple[Flat, ...]  # trainable sharded leaves
    buffers: tuple[str, ...] = ()  # the buffers its module registers (updated in place)
    ignored: tuple[str, ...] = ()  # owned parameters held whole (ignored_params=)
    _subsets: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def label(self) -> str:
        return repr(self.path) if self.path else "<root>"

    @property
    def whole(self) -> tuple[str, ...]:
        """Owned parameters the unit is handed as given: 0-dim ones and ignored ones."""
        return self.replicated + self.ignored

    def scatter_for(self, wanted: frozenset[str] | None) -> tuple[Flat, ...]:
        """``scatter`` restricted to the leaves in ``wanted`` (None: all), cached."""
        if wanted is None:
            return self.scatter
        flats = self._subsets.get(wanted)
        if flats is None:
            flats = tuple(f for f in (flat.subset(wanted) for flat in self.scatter)
                          if f is not None)
            self._subsets[wanted] = flats
        return flats


class UnitCall(nn.Module):
    """Stands in for a unit inside the root skeleton and hands the call to the running
    ``apply`` (:data:`RUNNING`).

    The unit's module is not registered (its leaves are the unit's, not the root's), but
    it is the UnitCall's child for ``children()`` (``named_children`` yields it under the
    name ``""``): Hugging Face installs its output-recording hooks on the layers inside
    it, and ``call_recording`` carries what they record out of the unit's call.
    """

    def __init__(self, index: int, inner: nn.Module, token: object):
        super().__init__()
        self.__dict__["_shardfn_inner"] = inner  # not registered: its leaves are the unit's
        self.__dict__["_shardfn_token"] = token
        self._shardfn_index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        running = RUNNING.get()
        if running is None or running.token is not self.__dict__["_shardfn_token"]:
            raise RuntimeError("a shard_params unit was called outside its model's apply()")
        index = self._shardfn_index
        return call_recording(self.__dict__["_shardfn_inner"],
                              lambda a, k: running.call_unit(index, a, k), args, kwargs)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        yield from super().named_children()
        yield "", self.__dict__["_shardfn_inner"]

    def __getattr__(self, name: str) -> Any:  # attributes the root reads (never parameters)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_shardfn_inner"], name)


def build_units(model: FunctionalModel, paths: tuple[str, ...], n: int, token: object,
                 place: Placement, dtypes: Mapping[str, torch.dtype] | None = None,
                 ignored: frozenset[str] = frozenset()) -> tuple[tuple[Unit, ...], Unit]:
    """The units at ``paths`` and the root unit.

    ``dtypes`` (leaf name -> dtype, default the module's) are the leaves' master dtypes:
    the dtypes of the shards ``apply`` is given, from which the gather and reduce dtypes
    follow (through ``place``). ``ignored`` parameters are neither gathered nor reduced.
    """
    # meta: free; the wrapping must not touch `model`; a Mesh held by a module (the split
    # layers of tensor_split) cannot be copied: copies share it
    skeleton = copy_sharing_meshes(model.module)
    inner = [skeleton.get_submodule(p) for p in paths]
    used: dict[int, dict[str, str]] = {}  # unit index -> leaf name -> its name in the module
    for index, (path, module) in enumerate(zip(paths, inner, strict=True)):
        used[index] = _leaf_names(module, model, path)
    for index, path in enumerate(paths):
        parent, _, key = path.rpartition(".")
        skeleton.get_submodule(parent)._modules[key] = UnitCall(index, inner[index], token)
    used[-1] = _leaf_names(skeleton, model, "")

    users: dict[str, set[int]] = {}
    for index, leaves in used.items():
        for name in leaves:
            users.setdefault(name, set()).add(index)
    params, shapes = set(model.param_names), model.param_shapes()
    masters = {x: (dtypes[x] if dtypes is not None else shapes[x].dtype) for x in model.names}
    trainable, buffer_names = set(model.trainable_names), set(model.buffer_names)
    owner = {name: (min(who) if len(who) == 1 else -1) for name, who in users.items()
             if name in params}

    def plan(index: int, path: str, module: nn.Module) -> Unit:
        owned = [name for name in model.names if owner.get(name) == index]
        held = tuple(x for x in owned if x in ignored)
        sharded = tuple(x for x in owned if len(shapes[x].shape) >= 1 and x not in ignored)
        replicated = tuple(x for x in owned if len(shapes[x].shape) == 0 and x not in ignored)
        external = tuple(x for x in model.names if x in used[index] and owner.get(x) == -1
                         and index != -1)
        grad_inputs = tuple(x for x in sharded + replicated + held + external if x in trainable)
        dims = {x: tuple(shapes[x].shape) for x in sharded}
        gather = {x: (place.compute_dtype(masters[x]), masters[x]) for x in sharded}
        scatter = {x: (place.comm_reduce_dtype(masters[x]), masters[x])
                   for x in sharded}
        owned_grads = tuple(x for x in grad_inputs if x not in external)
        buffers = tuple(x for x in model.names if x in used[index] and x in buffer_names)
        return Unit(index, path, module, tuple(used[index].items()), sharded, replicated,
                     external, grad_inputs, owned_grads, _flats(sharded, dims, gather, n),
                     _flats([x for x in sharded if x in trainable], dims, scatter, n), buffers,
                     held)

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
           n: int) -> tuple[Flat, ...]:
    """One flat buffer per (communication dtype, master dtype) pair of ``dtypes[name]``."""
    by_dtype: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name in names:
        by_dtype.setdefault(dtypes[name], []).append(name)
    out = []
    for (dtype, master), group in by_dtype.items():
        local = [(math.ceil(shapes[x][0] / n),) + tuple(shapes[x][1:]) for x in group]
        sizes = [math.prod(s) for s in local]
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        out.append(Flat(tuple(group), tuple(shapes[x] for x in group), tuple(local), offsets,
                         sum(sizes), dtype, master))
    return tuple(out)


def init_groups(model: FunctionalModel, paths: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Module paths to initialise together: each unit's subtree, then everything else."""
    inside: dict[str, list[str]] = {p: [] for p in paths}
    rest: list[str] = []
    for module_path in model.module_paths:
        unit = next((p for p in paths if module_path == p or module_path.startswith(p + ".")),
                    None)
        (inside[unit] if unit is not None else rest).append(module_path)
    return (*(tuple(inside[p]) for p in paths), tuple(rest))


# ================================================================ the frozen plan


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Plan:
    """Everything an ``apply`` call reads of its model, fixed when the model is built.

    Attributes:
        functional: the unsharded functional model.
        mesh: the mesh.
        token: identifies the model (its :class:`UnitCall` s and accumulators).
        names, buffer_names: leaf names and buffer names, in the model's order.
        unit_paths: the units' module paths, in registration order.
        units, root: the :class:`Unit` s (``units[i].index == i``) and the root unit.
        ax, replicate_ax, all_ax: the sharding axis, the HSDP replica axis (or None) and
            both together (the data-parallel ranks a mean divides by).
        ignored: the parameters held whole on each rank, never gathered nor reduced.
        place: dtypes and devices.
        masters: each leaf's own (master) dtype, as this plan was built for.
        specs, local_shapes: each leaf's layout and its local shard shape.
        buffer_set, trainable_set: buffer names; trainable parameter names.
        unit_trainable: the units' trainable owned leaves (shards the root's graph sees).
        init_groups: module paths initialised together (one unit at a time).
        grad_reduce: ``"mean"`` or ``"sum"``.
        prefetch: how many unit calls ahead to gather.
        reshard_after_forward: free each unit's full parameters after its forward
            (``"units"``: not the root's).
        save: keep activations (``remat=None``): backward runs the vjp recorded in forward.
        policy: what a unit's remat recorder saves (None: record nothing).
    """

    functional: FunctionalModel
    mesh: Mesh
    token: object
    names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    unit_paths: tuple[str, ...]
    units: tuple[Unit, ...]
    root: Unit
    ax: _comm.Axis
    replicate_ax: _comm.Axis | None
    all_ax: _comm.Axis
    ignored: frozenset[str]
    place: Placement
    masters: Mapping[str, torch.dtype]
    specs: Mapping[str, Layout]
    local_shapes: Mapping[str, tuple[int, ...]]
    buffer_set: frozenset[str]
    trainable_set: frozenset[str]
    unit_trainable: tuple[str, ...]
    init_groups: tuple[tuple[str, ...], ...]
    grad_reduce: GradReduce
    prefetch: int
    reshard_after_forward: Reshard
    save: bool
    policy: Policy | None

    def check_shards(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Raise a ``ValueError``/``TypeError`` naming the leaf unless ``shards`` fits."""
        if not isinstance(shards, Mapping):
            raise TypeError(f"shards must be a mapping name -> Tensor (as model.init returns), "
                            f"got {type(shards).__name__}")
        if shards.keys() != self.local_shapes.keys():
            missing = [n for n in self.names if n not in shards]
            unexpected = [n for n in shards if n not in self.local_shapes]
            raise ValueError(f"shards do not match the model: missing {missing}, unexpected "
                             f"{unexpected}" + suggest(unexpected, self.names))
        for name, expected in self.local_shapes.items():
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

    def for_dtypes(self, dtypes: tuple[torch.dtype, ...]) -> Plan:
        """The same model planned for leaves of ``dtypes`` (in ``names`` order): the
        gather and reduce dtypes follow from them (float64 shards of a float32 module).
        It builds a new skeleton: the caller caches the result."""
        if dtypes == tuple(self.masters[name] for name in self.names):
            return self
        masters = dict(zip(self.names, dtypes, strict=True))
        units, root = build_units(self.functional, self.unit_paths, self.ax.size, self.token,
                                  self.place, masters, self.ignored)
        return dataclasses.replace(self, units=units, root=root, masters=masters)


def make_plan(model: FunctionalModel, mesh: Mesh, axis: AxisName, *, units: UnitPolicy,
              replicate_axis: AxisName | None, place: Placement, grad_reduce: GradReduce,
              prefetch: int, reshard_after_forward: Reshard, remat: Policy | None,
              ignored: IgnoredPolicy = None) -> Plan:
    """Choose the units and plan them (arguments as for ``shard_params``; the model and
    mesh checked there, the options here).

    Raises:
        ValueError: an unknown axis, a replica axis overlapping ``axis``, a unit policy
            that matches no submodule, a ``reshard_after_forward`` not in ``RESHARD``, a
            ``grad_reduce`` or ``prefetch`` out of range, or what ``resolve_ignored``
            refuses.
        TypeError: a ``remat`` that is no policy.
    """
    if reshard_after_forward not in RESHARD or not isinstance(reshard_after_forward, (bool, str)):
        raise ValueError(f"reshard_after_forward must be one of {RESHARD}, got "
                         f"{reshard_after_forward!r}")
    if grad_reduce not in ("mean", "sum"):
        raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if remat is not None and not callable(remat):
        raise TypeError(f"remat must be a policy (op, name) -> bool, e.g. "
                        f"sf.checkpoint_policies.dots_saveable; got {remat!r}")
    held = resolve_ignored(model, ignored)
    ax = _comm.resolve(axis, mesh)
    replicate_ax, all_names = None, ax.names
    if replicate_axis is not None:
        replicate_ax = _comm.resolve(replicate_axis, mesh)
        if set(replicate_ax.names) & set(ax.names):
            raise ValueError(f"replicate_axis {replicate_axis!r} overlaps axis {axis!r}")
        all_names = ax.names + replicate_ax.names
    paths = resolve_units(model, units)
    token = object()
    unit_plans, root = build_units(model, paths, ax.size, token, place, ignored=held)
    shapes = model.param_shapes()
    specs, local_shapes = {}, {}
    for name in model.names:
        shape = tuple(shapes[name].shape)
        sharded = name in model.param_names and len(shape) >= 1 and name not in held
        spec = P(axis) if sharded else P()
        specs[name] = Layout(spec, shape)
        local_shapes[name] = local_shape(shape, spec, mesh)
    return Plan(
        functional=model, mesh=mesh, token=token, names=model.names,
        buffer_names=model.buffer_names, unit_paths=paths, units=unit_plans, root=root,
        ax=ax, replicate_ax=replicate_ax,
        all_ax=_comm.resolve(all_names, mesh), ignored=held, place=place,
        masters={name: shapes[name].dtype for name in model.names}, specs=specs,
        local_shapes=local_shapes, buffer_set=frozenset(model.buffer_names),
        trainable_set=frozenset(model.trainable_names),
        unit_trainable=tuple(n for u in unit_plans for n in u.grad_inputs
                             if n not in u.external),
        init_groups=init_groups(model, paths), grad_reduce=grad_reduce, prefetch=prefetch,
        # None: keep every activation (no recompute); nothing_saveable: recompute each unit
        # whole (nothing to record); another policy: record what it saves, recompute the rest
        reshard_after_forward=reshard_after_forward, save=remat is None,
        policy=None if remat is None or remat is nothing_saveable else remat)
