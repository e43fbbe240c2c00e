"""Schedules written by hand: per-rank action lists (or a CSV table) made a checked Schedule.

A schedule is data (:mod:`.schedules`), so a user can write one: for each pp rank the
ordered actions, each an :class:`~.schedules.Action`, a ``(kind, stage, microbatch)``
tuple, or torch's string form ``"<stage><kind><microbatch>"`` (``"0F0"``, ``"1B0"``,
``"0W1"``; torch's ``"I"``, the input gradient, reads as ``"B"``). A schedule with any
``W`` (or ``I``) splits backward: each ``B`` is then the input gradient only and needs
its ``W``. The result goes through :func:`~.simulate.validate` before it is returned,
so a schedule the runtime could not run (a ``B`` before its ``F``, a missing ``W``, a
deadlock, a micro-batch never run) is refused here, naming the rank, the action and the
reason, not left to hang a step.

:func:`resolve_schedule` is what ``pipeline_stages(schedule=...)`` uses: a name, or a
:class:`~.schedules.Schedule` checked against the pipeline's ranks and counts.

Example:
    >>> s = schedule_from_actions([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]],
    ...                           n_microbatches=2)
    >>> s.actions == make_schedule("1f1b", 2, 2).actions
    True
    >>> schedule_to_csv(s).splitlines()[1]
    '1F0,1B0,1F1,1B1'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardfn.transforms.pipeline.kinds import ActionKind
from shardfn.transforms.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    make_schedule,
    v_placement,
)
from shardfn.transforms.pipeline.simulate import validate

__all__ = ["parse_action", "resolve_schedule", "schedule_from_actions", "schedule_from_csv",
           "schedule_to_csv"]

_TEXT = re.compile(r"(\d+)\s*([FBIW])\s*(\d+)")
_KINDS = {"F": ActionKind.F, "B": ActionKind.B, "I": ActionKind.B, "W": ActionKind.W}


def parse_action(entry: Any, rank: int = 0, position: int = 0) -> Action:
    """One written action as an :class:`~.schedules.Action`.

    Args:
        entry: an ``Action``, a ``(kind, stage, microbatch)`` tuple, or a string
            ``"<stage><kind><microbatch>"`` with kind ``F``, ``B``, ``I`` (= ``B``) or ``W``.
        rank, position: where it was written (for the error).

    Returns:
        The action.

    Raises:
        ValueError: anything else, naming the rank and position.

    Example:
        >>> parse_action("1W0")
        Action(kind='W', stage=1, microbatch=0)
    """
    where = f"rank {rank} action {position}"
    if isinstance(entry, str):
        found = _TEXT.fullmatch(entry.strip())
        if found is None:
            raise ValueError(f"schedule: {where} is {entry!r}; write '<stage><kind>"
                             "<microbatch>' with kind F, B, I or W, e.g. '0F1'")
        stage, kind, microbatch = found.groups()
        return Action(_KINDS[kind], int(stage), int(microbatch))
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        kind, stage, microbatch = entry
        ints = all(isinstance(n, int) and not isinstance(n, bool) for n in (stage, microbatch))
        if str(kind) in _KINDS and ints:
            return Action(_KINDS[str(kind)], stage, microbatch)
    raise ValueError(f"schedule: {where} is {entry!r}; an action is an Action, a (kind, "
                     "stage, microbatch) tuple with kind 'F', 'B' or 'W', or a string like '0F1'")


def _placement(placement: Sequence[int] | str | None, n_ranks: int, virtual: int
               ) -> tuple[int, ...] | None:
    if placement is None or placement == "looped":
        return None
    if placement == "v":
        if virtual != 2:
            raise ValueError(f"schedule: placement='v' places 2 stages per rank; got "
                             f"virtual={virtual}")
        return v_placement(n_ranks)
    if isinstance(placement, str):
        raise ValueError(f"schedule: placement={placement!r}; give 'looped', 'v' or the pp "
                         "rank of each stage")
    ranks = tuple(placement)
    looped = tuple(s % n_ranks for s in range(n_ranks * virtual))
    return None if ranks == looped else ranks


def schedule_from_actions(actions: Sequence[Sequence[Any]], *, n_microbatches: int,
                          virtual: int = 1, placement: Sequence[int] | str | None = None,
                          name: str = "custom") -> Schedule:
    """A :class:`~.schedules.Schedule` from per-rank action lists, validated.

    Args:
        actions: ``actions[r]``: pp rank ``r``'s actions in execution order (see
            :func:`parse_action`); there are ``len(actions)`` ranks.
        n_microbatches: micro-batches per step ``m``.
        virtual: stages per rank (``len(actions) * virtual`` stages).
        placement: where the stages live: None or ``"looped"`` (stage ``s`` on rank
            ``s % p``), ``"v"`` (the V of ``"zbv"``, ``virtual=2``) or the pp rank of each
            stage.
        name: the schedule's name (errors and timelines say it).

    Returns:
        The schedule; ``split_backward`` when any action is a ``W`` (or ``I``).

    Raises:
        ValueError: a malformed action or placement, or a schedule
            :func:`~.simulate.validate` refuses (the rank, the action and why).

    Example:
        >>> schedule_from_actions([["0F0", "1F0", "1B0", "0B0"]], n_microbatches=1,
        ...                       virtual=2).n_stages
        2
    """
    if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence) or not actions:
        raise ValueError("schedule: actions must be a list with one action list per pp rank")
    for what, value in (("n_microbatches", n_microbatches), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"schedule: {what} must be an int >= 1, got {value!r}")
    parsed = []
    for rank, row in enumerate(actions):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise ValueError(f"schedule: rank {rank}'s actions must be a list, got {row!r}")
        parsed.append(tuple(parse_action(a, rank, k) for k, a in enumerate(row)))
    split = any(a.kind == ActionKind.W for row in parsed for a in row) or any(
        isinstance(a, str) and "I" in a for row in actions for a in row)
    n_ranks = len(parsed)
    schedule = Schedule(name, n_ranks, virtual, n_microbatches, split, tuple(parsed),
                        _placement(placement, n_ranks, virtual))
    validate(schedule)
    return schedule


def schedule_from_csv(source: str | Path, *, n_microbatches: int, virtual: int = 1,
                      placement: Sequence[int] | str | None = None, name: str = "custom"
                      ) -> Schedule:
    """:func:`schedule_from_actions` of a table: one line per rank, actions separated by
    commas (empty cells, torch's idle slots, are skipped).

    Args:
        source: the table's text, or a ``Path`` to a file holding it.
        n_microbatches, virtual, placement, name: as for :func:`schedule_from_actions`.

    Returns:
        The validated schedule.

    Example:
        >>> schedule_from_csv("0F0,,0B0\\n1F0,1B0", n_microbatches=1).actions[0]
        (Action(kind='F', stage=0, microbatch=0), Action(kind='B', stage=0, microbatch=0))
    """
    text = source.read_text() if isinstance(source, Path) else source
    rows = [[cell for cell in line.split(",") if cell.strip()]
            for line in text.strip().splitlines()]
    return schedule_from_actions(rows, n_microbatches=n_microbatches, virtual=virtual,
                                 placement=placement, name=name)


def schedule_to_csv(schedule: Schedule) -> str:
    """The table :func:`schedule_from_csv` reads: one line per rank, ``"0F0,0B0,..."``.

    Example:
        >>> schedule_to_csv(make_schedule("zb-h1", 2, 1))
        '0F0,0B0,0W0\\n1F0,1B0,1W0'
    """
    return "\n".join(",".join(f"{a.stage}{a.kind}{a.microbatch}" for a in row)
                     for row in schedule.actions)


def resolve_schedule(schedule: Any, n_ranks: int, n_microbatches: int, n_virtual: int
                     ) -> Schedule:
    """The schedule ``pipeline_stages(schedule=...)`` runs: a name built by
    :func:`~.schedules.make_schedule`, or a :class:`~.schedules.Schedule` that must fit.

    Args:
        schedule: a name of :data:`~.schedules.SCHEDULES`, or a Schedule.
        n_ranks, n_microbatches, n_virtual: the pipeline's pp size, ``microbatches=`` and
            ``virtual=``.

    Returns:
        The validated schedule.

    Raises:
        ValueError: an unknown name, or a Schedule whose ranks, micro-batches or stages
            per rank differ from the pipeline's (naming both), or that does not validate.
        TypeError: neither a name nor a Schedule.

    Example:
        >>> resolve_schedule("zbv", 2, 4, 2).placement
        (0, 1, 1, 0)
    """
    if isinstance(schedule, Schedule):
        wanted = {"n_ranks": (schedule.n_ranks, n_ranks, "the pp axis size"),
                  "n_microbatches": (schedule.n_microbatches, n_microbatches, "microbatches="),
                  "n_virtual": (schedule.n_virtual, n_virtual, "virtual=")}
        for field, (theirs, ours, option) in wanted.items():
            if theirs != ours:
                raise ValueError(f"pipeline_stages: schedule {schedule.name!r} has "
                                 f"{field}={theirs}, but the pipeline has {option} {ours}: "
                                 "they must agree")
        validate(schedule)
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(f"pipeline_stages: schedule= takes a name ({sorted(SCHEDULES)}) or a "
                        f"Schedule (schedule_from_actions), got {type(schedule).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {sorted(SCHEDULES)}")
    built = make_schedule(schedule, n_ranks, n_microbatches, n_virtual)
    validate(built)
    return built
