"""Stages: which units each pipeline stage runs, which leaves it holds, and its forward.

The model is a list of *units* (an ``nn.Sequential``'s children, or modules
given as a list). ``balance[s]`` units go to stage ``s``, in order; stage ``s``
lives on pp rank ``s % p`` (looped, :func:`~.schedules.stage_rank`). Leaves keep
the names of ``sf.functional(nn.Sequential(*units))`` (``"3.weight"`` is unit 3's
``weight``), and each unit is initialised as that model's ``init`` does it (the
same per-submodule seeds), so a rank builds exactly its slice of the full tree.

Example:
    >>> plan = plan_stages([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)], [2, 1], 2)
    >>> plan.stages[1].units, plan.stages[1].names
    ((2,), ('2.weight', '2.bias'))
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardfn.functional import FunctionalModel, functional
from shardfn.mesh import Mesh
from shardfn.primitives import _comm
from shardfn.primitives._comm import resolve
from shardfn.transforms.pipeline.schedules import stage_rank

__all__ = ["Stage", "StagePlan", "as_units", "check_balance", "plan_stages", "resolve_balance",
           "stage_module"]

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
    """

    full: FunctionalModel
    unit_models: tuple[FunctionalModel, ...]
    stages: tuple[Stage, ...]
    n_ranks: int

    def on_rank(self, rank: int) -> tuple[Stage, ...]:
        """The stages pp rank ``rank`` holds, in stage order."""
        return tuple(stage for stage in self.stages if stage.rank == rank)

    def layout(self) -> dict[str, int]:
        """Leaf name -> the pp axis index that holds it, in full-tree order."""
        rank_of = {name: stage.rank for stage in self.stages for name in stage.names}
        return {name: rank_of[name] for name in self.full.names}

    def init(self, seed: int, rank: int, device: torch.device | str | None = None) -> Params:
        """The leaves of pp rank ``rank``'s stages, equal to those of ``full.init(seed)``."""
        paths = [str(u) for stage in self.on_rank(rank) for u in stage.units]
        return self.full.init_subset(seed, paths, device=device, recurse=True)

    def forward(self, stage: Stage, params: Mapping[str, torch.Tensor], x: Any) -> Any:
        """Run ``stage``'s units on ``x`` with ``params`` (at least the stage's leaves)."""
        for unit in stage.units:
            prefix = f"{unit}."
            model = self.unit_models[unit]
            x = model.apply({name: params[prefix + name] for name in model.names}, x)
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
            prefix = f"{unit}."
            model = self.unit_models[unit]
            x, new = model.apply({name: params[prefix + name] for name in model.names}, x,
                                 mutable=True)
            buffers.update({prefix + name: t.detach() for name, t in new.items()})
        return x, buffers


def stage_module(units: Sequence[nn.Module], stage: Stage) -> nn.Sequential:
    """An ``nn.Sequential`` of ``stage``'s units under their full-model indices, so its
    leaves have the full tree's names (``"3.weight"``) and ``sf.functional`` of it
    initialises them as the full model's ``init`` does (same submodule paths, same seeds).
    """
    return nn.Sequential(OrderedDict((str(u), units[u]) for u in stage.units))


def as_units(model: nn.Module | Sequence[nn.Module]) -> tuple[nn.Module, ...]:
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
        raise TypeError("pipeline_stages takes an nn.Sequential or a list of nn.Modules (the "
                        f"units), got {type(model).__name__}")
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"pipeline_stages: unit {i} is a {type(unit).__name__}, not an "
                            "nn.Module")
    if not units:
        raise ValueError("pipeline_stages: the model has no units")
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
                    sample: Any, mesh: Mesh) -> tuple[int, ...]:
    """``balance=`` as unit counts: a list (checked), or ``"params"`` / ``"time"``
    (measured on ``sample``; with ``"time"`` mesh index 0's counts are broadcast)."""
    if isinstance(balance, str) and balance in ("params", "time"):
        try:
            from shardfn.transforms.pipeline.balance import balance_units
        except ImportError as error:
            raise NotImplementedError(f"balance={balance!r} needs shardfn.transforms.pipeline"
                                      ".balance, not written yet: pass a list of unit counts"
                                      ) from error
        by = balance
        if by == "params" or mesh.size() == 1:
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


def _check_ties(full: FunctionalModel) -> None:
    for alias, owner in full.tied.items():
        if alias.split(".", 1)[0] != owner.split(".", 1)[0]:
            raise ValueError(f"pipeline_stages: {alias!r} is tied to {owner!r} in another unit; "
                             "weights tied across units are not supported (untie them, or put "
                             "both uses in one unit)")


def plan_stages(units: Sequence[nn.Module], balance: Sequence[int], n_ranks: int) -> StagePlan:
    """Split ``units`` into ``len(balance)`` stages placed looped over ``n_ranks`` pp ranks.

    Args:
        units: the modules, in order.
        balance: units per stage (validated by :func:`check_balance` beforehand).
        n_ranks: pp ranks.

    Returns:
        The :class:`StagePlan`.
    """
    full = functional(nn.Sequential(*units))
    _check_ties(full)
    unit_models = tuple(functional(unit) for unit in units)
    trainable = set(full.trainable_names)
    stages, start = [], 0
    for index, count in enumerate(balance):
        unit_ids = tuple(range(start, start + count))
        start += count
        prefixes = tuple(f"{u}." for u in unit_ids)
        names = tuple(n for n in full.names if n.startswith(prefixes))
        stages.append(Stage(index, stage_rank(index, n_ranks), unit_ids, names,
                            tuple(n for n in names if n in trainable)))
    return StagePlan(full, unit_models, tuple(stages), n_ranks)
