"""`shard_params` units: choosing them (``units=``) and the plan of each.

A *unit* is a submodule whose parameters are gathered together; what lies outside
every unit is the *root unit*. :func:`build_units` wraps each unit in the root's
skeleton with a :class:`UnitCall` that hands the call to the running ``apply``
(``ACTIVE[-1]``), and records which leaves each unit owns, uses and reduces.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardfn.functional import FunctionalModel
from shardfn.transforms._units import Placement

if TYPE_CHECKING:
    from shardfn.transforms._unit_step import Step

__all__ = ["ACTIVE", "Flat", "Unit", "UnitCall", "UnitPolicy", "build_units", "init_groups",
           "resolve_units", "suggest"]

ACTIVE: list[Step] = []  # apply() calls whose root forward is running, innermost last

UnitPolicy = type | tuple[type, ...] | int | Sequence[str] | None
"""A module class (or tuple of classes), a minimum parameter count, module paths, or None."""


# ================================================================ choosing units


def resolve_units(model: FunctionalModel, units: UnitPolicy) -> tuple[str, ...]:
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
                                 + suggest([path], list(named)))
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
    gather: tuple[Flat, ...]  # all sharded leaves
    scatter: tuple[Flat, ...]  # trainable sharded leaves
    buffers: tuple[str, ...] = ()  # the buffers its module registers (updated in place)
    _subsets: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def label(self) -> str:
        return repr(self.path) if self.path else "<root>"

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
    """Stands in for a unit inside the root skeleton and hands the call to the running step."""

    def __init__(self, index: int, inner: nn.Module, token: object):
        super().__init__()
        self.__dict__["_shardfn_inner"] = inner  # not registered: its leaves are the unit's
        self.__dict__["_shardfn_token"] = token
        self._shardfn_index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        step = ACTIVE[-1] if ACTIVE else None
        if step is None or step.model._token is not self.__dict__["_shardfn_token"]:
            raise RuntimeError("a shard_params unit was called outside its model's apply()")
        return step.call_unit(self._shardfn_index, args, kwargs)

    def __getattr__(self, name: str) -> Any:  # attributes the root reads (never parameters)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_shardfn_inner"], name)


def build_units(model: FunctionalModel, paths: tuple[str, ...], n: int, token: object,
                 place: Placement, dtypes: Mapping[str, torch.dtype] | None = None,
                 ) -> tuple[tuple[Unit, ...], Unit]:
    """The units at ``paths`` and the root unit.

    ``dtypes`` (leaf name -> dtype, default the module's) are the leaves' master dtypes:
    the dtypes of the shards ``apply`` is given, from which the gather and reduce dtypes
    follow (through ``place``).
    """
    skeleton = copy.deepcopy(model.module)  # meta: free; the wrapping must not touch `model`
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
        sharded = tuple(x for x in owned if len(shapes[x].shape) >= 1)
        replicated = tuple(x for x in owned if len(shapes[x].shape) == 0)
        external = tuple(x for x in model.names if x in used[index] and owner.get(x) == -1
                         and index != -1)
        grad_inputs = tuple(x for x in sharded + replicated + external if x in trainable)
        dims = {x: tuple(shapes[x].shape) for x in sharded}
        gather = {x: (place.compute_dtype(masters[x]), masters[x]) for x in sharded}
        scatter = {x: (place.comm_reduce_dtype(masters[x]), masters[x])
                   for x in sharded}
        owned_grads = tuple(x for x in grad_inputs if x not in external)
        buffers = tuple(x for x in model.names if x in used[index] and x in buffer_names)
        return Unit(index, path, module, tuple(used[index].items()), sharded, replicated,
                     external, grad_inputs, owned_grads, _flats(sharded, dims, gather, n),
                     _flats([x for x in sharded if x in trainable], dims, scatter, n), buffers)

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



def suggest(names: Sequence[str], candidates: Sequence[str]) -> str:
    hints = [m for name in names[:3] for m in difflib.get_close_matches(name, candidates, n=1)]
    return f"; did you mean {hints}?" if hints else ""

