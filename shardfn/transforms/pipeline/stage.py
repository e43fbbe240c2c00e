"""Stages: which units each pipeline stage runs, which leaves it holds, and its forward.

The model is a list of *units* (an ``nn.Sequential``'s children, or modules
given as a list). ``balance[s]`` units go to stage ``s``, in order; stage ``s``
lives on pp rank ``s % p`` (looped, :func:`~.schedules.stage_rank`). Leaves keep
the names of the *root* model the units come from: ``sf.functional(nn.Sequential(*units))``
for plain units (``"3.weight"`` is unit 3's ``weight``), the model's own names for units
cut out of a model (:class:`ModelUnits`: a Hugging Face model's ``"model.layers.0..."``).
Each unit leaf is found in the root by identity (:func:`unit_leaf_names`), and each leaf
is initialised as the root's ``init`` does it (the same per-submodule seeds), so a rank
builds exactly its slice of the full tree.

A leaf two units share (an embedding tied to the head) is one leaf of the root; when
the units are on different stages, every stage using it holds it (:meth:`StagePlan.shared`)
and :mod:`.ties` sums its gradients between their ranks after each step. ``layout`` names
its *owner*, the first stage holding it (what ``gather`` and checkpoints read).

Example:
    >>> plan = plan_stages([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)], [2, 1], 2)
    >>> plan.stages[1].units, plan.stages[1].names
    ((2,), ('2.weight', '2.bias'))
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfn.functional import FunctionalModel, functional
from shardfn.mesh import Mesh
from shardfn.primitives import _comm
from shardfn.primitives._comm import resolve
from shardfn.transforms.pipeline.batch import call_unit
from shardfn.transforms.pipeline.schedules import stage_rank

__all__ = ["ModelUnits", "Stage", "StagePlan", "as_units", "check_balance", "model_units",
           "place_stages", "plan_stages", "resolve_balance", "run_units", "stage_module",
           "unit_leaf_names"]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        index: the stage number ``s`` (``0 .. n_stages - 1``).
        rank: the pp axis index that holds it.
        units: the unit indices it runs, in order.
        names: the leaves (parameters and buffers) of those units, full-tree names.
        trainable: the trainable parameters among ``names``.
    """

    index: int
    rank: int
    units: tuple[int, ...]
    names: tuple[str, ...]
    trainable: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class StagePlan:
    """Every stage of a pipeline, and the functional models of the units.

    Attributes:
        full: ``sf.functional(nn.Sequential(*units))``: names, shapes and init.
        unit_models: ``sf.functional(unit)`` for each unit (what a stage applies).
        stages: all stages, in order.
        n_ranks: pp ranks.
        unit_leaves: per unit, its leaf name -> the root's leaf name (empty: plain units,
            unit ``u``'s ``"w"`` is ``"u.w"``).
        tied_shapes: a leaf several stages hold -> its local shape where their stage models
            shard it (what a rank holding none of its copies adds to the gradient sum,
            :mod:`.ties`); absent: the full shape.
    """

    full: FunctionalModel
    unit_models: tuple[FunctionalModel, ...]
    stages: tuple[Stage, ...]
    n_ranks: int
    unit_leaves: tuple[Mapping[str, str], ...] = ()
    tied_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def leaf_map(self, unit: int) -> Mapping[str, str]:
        """Unit ``unit``'s leaf name -> its name in the full tree."""
        if self.unit_leaves:
            return self.unit_leaves[unit]
        return {name: f"{unit}.{name}" for name in self.unit_models[unit].names}

    def shared(self) -> dict[str, tuple[int, ...]]:
        """Leaves held by stages on more than one pp rank -> those ranks, in order (tied
        weights across stages, a buffer two stages share), in full-tree order."""
        ranks: dict[str, set[int]] = {}
        for stage in self.stages:
            for name in stage.names:
                ranks.setdefault(name, set()).add(stage.rank)
        return {n: tuple(sorted(ranks[n])) for n in self.full.names
                if len(ranks.get(n, ())) > 1}

    def train(self, mode: bool = True) -> StagePlan:
        """The same stages over ``full`` and ``unit_models`` in training (or eval) mode."""
        return dataclasses.replace(self, full=self.full.train(mode),
                                   unit_models=tuple(m.train(mode) for m in self.unit_models))

    def on_rank(self, rank: int) -> tuple[Stage, ...]:
        """The stages pp rank ``rank`` holds, in stage order."""
        return tuple(stage for stage in self.stages if stage.rank == rank)

    def placed(self, rank_of: Callable[[int], int]) -> StagePlan:
        """The same stages, stage ``s`` on pp rank ``rank_of(s)`` (a schedule's placement,
        :meth:`~.schedules.Schedule.rank_of`; the looped one is how stages are made)."""
        return dataclasses.replace(self, stages=tuple(
            dataclasses.replace(stage, rank=rank_of(stage.index)) for stage in self.stages))

    def layout(self) -> dict[str, int]:
        """Leaf name -> the pp axis index that holds it, in full-tree order."""
        rank_of: dict[str, int] = {}
        for stage in self.stages:  # a shared leaf's owner: the first stage holding it
            for name in stage.names:
                rank_of.setdefault(name, stage.rank)
        return {name: rank_of[name] for name in self.full.names}

    def init(self, seed: int, rank: int, device: torch.device | str | None = None,
             stages: Collection[int] | None = None) -> Params:
        """The leaves of pp rank ``rank``'s stages (those in ``stages`` if given), equal to
        those of ``full.init(seed)`` (each built by its owning submodule of the root, under
        that path's seed)."""
        names = [n for stage in self.on_rank(rank) for n in stage.names
                 if stages is None or stage.index in stages]
        if not names:
            return {}
        paths = sorted({self.full.owners[n] for n in names})
        found = self.full.init_subset(seed, paths, device=device)
        return {n: found[n] for n in self.full.names if n in set(names)}

    def forward(self, stage: Stage, params: Mapping[str, torch.Tensor], x: Any) -> Any:
        """Run ``stage``'s units on ``x`` with ``params`` (at least the stage's leaves)."""
        for unit in stage.units:  # stage 0's first unit: a UnitInputs' arguments spread
            names = self.leaf_map(unit)
            x = call_unit(self.unit_models[unit].apply,
                          {name: params[names[name]] for name in names}, x)
        return x

    def stage_forward(self, stage: Stage) -> Callable[[Mapping[str, torch.Tensor], Any], Any]:
        """``fn(params, x)``: :meth:`forward` of one stage, as a plain function."""
        return lambda params, x: self.forward(stage, params, x)

    def forward_mutable(self, stage: Stage, params: Mapping[str, torch.Tensor], x: Any
                        ) -> tuple[Any, Params]:
        """:meth:`forward` that also returns the stage's buffers as its units left them
        (``apply(..., mutable=True)`` per unit; full-tree names).

        Example:
            >>> out, buffers = plan.forward_mutable(plan.stages[0], params, x)
        """
        buffers: Params = {}
        for unit in stage.units:
            names = self.leaf_map(unit)
            x, new = call_unit(self.unit_models[unit].apply,
                               {name: params[names[name]] for name in names}, x, mutable=True)
            buffers.update({names[name]: t.detach() for name, t in new.items()})
        return x, buffers


def run_units(units: Sequence[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """Run ``units`` in turn: the first takes every positional and keyword input (a
    pipeline's several inputs per micro-batch), the rest the previous one's output."""
    first, *rest = units
    x = first(*args, **kwargs)
    for unit in rest:
        x = unit(x)
    return x


class UnitSequence(nn.Sequential):
    """An ``nn.Sequential`` whose forward is :func:`run_units` over its children."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return run_units(tuple(self), *args, **kwargs)


def stage_module(units: Sequence[nn.Module], stage: Stage) -> nn.Sequential:
    """A :class:`UnitSequence` of ``stage``'s units under their full-model indices, so its
    leaves have the full tree's names (``"3.weight"``) and ``sf.functional`` of it
    initialises them as the full model's ``init`` does (same submodule paths, same seeds).
    """
    return UnitSequence(OrderedDict((str(u), units[u]) for u in stage.units))


def as_units(model: nn.Module | Sequence[nn.Module], what: str = "pipeline_stages"
             ) -> tuple[nn.Module, ...]:
    """The units of ``model``: an ``nn.Sequential``'s children, or a list of modules.

    Raises:
        TypeError: anything else, or an entry that is not an ``nn.Module``.
        ValueError: no units.
    """
    if isinstance(model, nn.Sequential):
        units = tuple(model)
    elif isinstance(model, (list, tuple)):
        units = tuple(model)
    else:
        raise TypeError(f"{what} takes an nn.Sequential or a list of nn.Modules (the "
                        f"units), got {type(model).__name__}")
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"{what}: unit {i} is a {type(unit).__name__}, not an nn.Module")
    if not units:
        raise ValueError(f"{what}: the model has no units")
    return units


#: what every balance error ends with: the forms that compute the counts
_BALANCE_HINT = ("; or pass balance='params' (split by parameter count) or balance='time' "
                 "(by measured time, with sample=) to have the counts computed")


def check_balance(balance: Sequence[int], n_units: int, n_stages: int) -> tuple[int, ...]:
    """Validate an explicit balance: ``n_stages`` positive unit counts summing to ``n_units``.

    Raises:
        ValueError: naming what is wrong and what would be valid.
    """
    if balance is None:
        raise TypeError(f"pipeline_stages needs balance=: a list of {n_stages} unit counts "
                        f"(one per stage, adding up to the {n_units} units)" + _BALANCE_HINT)
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a list of unit counts per stage, 'params' or "
                        f"'time', got {balance!r}")
    counts = tuple(balance)
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int)]
    if bad:
        raise TypeError(f"balance entries must be ints (units per stage), got {bad}"
                        + _BALANCE_HINT)
    if len(counts) != n_stages:
        raise ValueError(f"balance {list(counts)} has {len(counts)} entries, but the pipeline "
                         f"has {n_stages} stages (pp size x virtual): give one unit count per "
                         "stage" + _BALANCE_HINT)
    empty = [s for s, c in enumerate(counts) if c < 1]
    if empty:
        raise ValueError(f"balance {list(counts)}: stages {empty} have no units (every stage "
                         "needs at least one)" + _BALANCE_HINT)
    if sum(counts) != n_units:
        raise ValueError(f"balance {list(counts)} covers {sum(counts)} units, but the model "
                         f"has {n_units}: the counts must add up to the number of units"
                         + _BALANCE_HINT)
    return counts


def resolve_balance(balance: Any, units: Sequence[nn.Module], n_stages: int,
                    sample: Any, mesh: Mesh | None) -> tuple[int, ...]:
    """``balance=`` as unit counts: a list (checked), or ``"params"`` / ``"time"``
    (measured on ``sample``; with ``"time"`` over a mesh, mesh index 0's counts are
    broadcast; without one, this process's)."""
    if isinstance(balance, str) and balance in ("params", "time"):
        try:
            from shardfn.transforms.pipeline.balance import balance_units
        except ImportError as error:
            raise NotImplementedError(f"balance={balance!r} needs shardfn.transforms.pipeline"
                                      ".balance, not written yet: pass a list of unit counts"
                                      ) from error
        by = balance
        if by == "params" or mesh is None or mesh.size() == 1:
            balance = balance_units(list(units), n_stages, by=by, sample=sample)
        else:  # timings differ by rank: mesh index 0 decides, once every rank measured
            balance = _agreed_time_balance(list(units), n_stages, sample, mesh)
    return check_balance(balance, len(units), n_stages)


def _agreed_time_balance(units: list[nn.Module], n_stages: int, sample: Any,
                         mesh: Mesh) -> list[int]:
    """``balance='time'`` on every rank, mesh index 0's counts broadcast; a rank whose
    measurement failed makes every rank raise (none is left waiting in the broadcast)."""
    from shardfn.transforms.pipeline.balance import balance_units

    every = resolve(mesh.axis_names, mesh)
    try:
        counts, failure = list(balance_units(units, n_stages, by="time", sample=sample)), None
    except (TypeError, ValueError, RuntimeError) as error:
        counts, failure = [0] * n_stages, error
    status = torch.zeros(every.size, dtype=torch.int64, device=mesh.device)
    status[every.index] = int(failure is not None)
    failed = [r for r, bad in enumerate(_comm.psum(status, every).tolist()) if bad]
    if failure is not None:
        raise failure
    if failed:
        raise ValueError(f"balance='time': measuring the units failed on mesh ranks {failed} "
                         "(their errors say why); every rank must pass the same sample=")
    found = _comm.broadcast(torch.tensor(counts, dtype=torch.int64, device=mesh.device), every, 0)
    return [int(c) for c in found.tolist()]


def unit_leaf_names(root: nn.Module, units: Sequence[nn.Module],
                    unit_models: Sequence[FunctionalModel], full: FunctionalModel
                    ) -> tuple[dict[str, str], ...]:
    """Per unit, its leaf name -> the root's name of that tensor (found by identity).

    A tensor registered twice in the root (a tied weight) is the root's first name,
    the one ``sf.functional(root)`` keeps, so two units using it name the same leaf.

    Raises:
        ValueError: a unit leaf that is not a leaf of the root (naming both).

    Example:
        >>> emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        >>> head.weight = emb.weight
        >>> root = nn.Sequential(emb, head)
        >>> unit_leaf_names(root, [emb, head], [functional(emb), functional(head)],
        ...                 functional(root))
        ({'weight': '0.weight'}, {'weight': '0.weight'})
    """
    first: dict[int, str] = {}
    for name, tensor in [*root.named_parameters(remove_duplicate=False),
                         *root.named_buffers(remove_duplicate=False)]:
        if name in full.names or name in full.tied:
            first.setdefault(id(tensor), full.tied.get(name, name))
    found = []
    for index, (unit, model) in enumerate(zip(units, unit_models, strict=True)):
        tensors = dict([*unit.named_parameters(remove_duplicate=False),
                        *unit.named_buffers(remove_duplicate=False)])
        names = {}
        for name in model.names:
            full_name = first.get(id(tensors[name]))
            if full_name is None:
                raise ValueError(f"pipeline: unit {index} ({type(unit).__name__}) has leaf "
                                 f"{name!r}, which is not a parameter or buffer of the model "
                                 f"({type(root).__name__}) the units were cut from")
            names[name] = full_name
        found.append(names)
    return tuple(found)


class ModelUnits(NamedTuple):
    """Units cut out of one model, whose leaves keep that model's names.

    Attributes:
        root: the model (``sf.functional(root)`` is the pipeline's ``functional``: its
            names, init, ``gather`` and checkpoints).
        units: the modules the stages run in order, each taking the previous one's output;
            built from ``root``'s submodules (the same tensors).

    Example:
        >>> units = ModelUnits(llama, (embed_unit, *layer_units, head_unit))
    """

    root: nn.Module
    units: tuple[nn.Module, ...]


def model_units(model: Any, what: str = "pipeline_stages") -> ModelUnits:
    """``model`` as :class:`ModelUnits`: as given, or plain units (an ``nn.Sequential`` or
    a list of modules) under the root ``nn.Sequential(*units)``.

    Example:
        >>> model_units([nn.Linear(2, 2)]).root
        Sequential(...)
    """
    if isinstance(model, ModelUnits):
        return ModelUnits(model.root, as_units(list(model.units), what))
    units = as_units(model, what)
    return ModelUnits(nn.Sequential(*units), units)


def plan_stages(units: Sequence[nn.Module] | ModelUnits, balance: Sequence[int],
                n_ranks: int) -> StagePlan:
    """Split ``units`` into ``len(balance)`` stages placed looped over ``n_ranks`` pp ranks.

    Args:
        units: the modules, in order (their root ``nn.Sequential(*units)``), or
            :class:`ModelUnits` (their leaves keep the root's names).
        balance: units per stage (validated by :func:`check_balance` beforehand).
        n_ranks: pp ranks.

    Returns:
        The :class:`StagePlan`.
    """
    root, modules = model_units(units)
    full = functional(root)
    unit_models = tuple(functional(unit) for unit in modules)
    leaves = unit_leaf_names(root, modules, unit_models, full)
    return place_stages(full, unit_models, balance, n_ranks, leaves)


def place_stages(full: FunctionalModel, unit_models: Sequence[FunctionalModel],
                 balance: Sequence[int], n_ranks: int,
                 unit_leaves: Sequence[Mapping[str, str]] = ()) -> StagePlan:
    """The :class:`StagePlan` of ``full`` cut into ``balance`` units per stage, stage ``s``
    on pp rank ``s % n_ranks``.

    Args:
        full: the unsplit model (its names, init and buffers).
        unit_models: ``sf.functional(unit)`` per unit.
        balance: units per stage (checked by :func:`check_balance` beforehand).
        n_ranks: pp ranks.
        unit_leaves: per unit, its leaf name -> the full name (:func:`unit_leaf_names`);
            empty: unit ``u``'s ``"w"`` is ``"u.w"`` (``nn.Sequential(*units)``).

    Returns:
        The :class:`StagePlan`.
    """
    plan = StagePlan(full, tuple(unit_models), (), n_ranks, tuple(unit_leaves))
    trainable = set(full.trainable_names)
    stages, start = [], 0
    for index, count in enumerate(balance):
        unit_ids = tuple(range(start, start + count))
        start += count
        held = {n for u in unit_ids for n in plan.leaf_map(u).values()}
        names = tuple(n for n in full.names if n in held)
        stages.append(Stage(index, stage_rank(index, n_ranks), unit_ids, names,
                            tuple(n for n in names if n in trainable)))
    return dataclasses.replace(plan, stages=tuple(stages))
