"""Check a pipeline :class:`~shardfn.transforms.pipeline.schedules.Schedule` and simulate it.

Pure and single-process: no tensor, no communication. :func:`validate` says whether
the runtime can execute a schedule (every action present once, on its own rank, and
no deadlock under blocking receives and non-blocking sends); :func:`simulate` runs it
on a clock with fixed action times and reports when each action starts and ends, the
bubble and the activations each rank holds.

Dependencies (what the runtime waits for):

* ``F`` of stage ``s`` on micro-batch ``i`` needs ``F(s - 1, i)`` (received from
  the rank of stage ``s - 1``, :meth:`~.schedules.Schedule.rank_of`); stage 0 needs
  nothing;
* ``B(s, i)`` needs ``B(s + 1, i)``; the last stage's ``B`` needs its own ``F``;
* ``W(s, i)`` needs ``B(s, i)`` (same rank).

Each rank runs its actions in order; an action starts when the rank is free and its
dependency has ended (communication takes ``t_comm``). The execution is deadlock-free
exactly when this always-make-progress simulation finishes; ``validate`` names the
ranks that are stuck and what each waits for otherwise.

Example:
    >>> from shardfn.transforms.pipeline.schedules import make_schedule
    >>> r = simulate(make_schedule("1f1b", 2, 4), t_f=1.0, t_b=1.0)
    >>> r.makespan, round(r.bubble, 3)   # (p - 1) / (m + p - 1) = 1/5
    (10.0, 0.2)
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from shardfn.transforms.pipeline.kinds import ActionKind
from shardfn.transforms.pipeline.messages import message_lists
from shardfn.transforms.pipeline.schedules import Action, Schedule, ScheduleName

__all__ = ["SimResult", "simulate", "theoretical_bubble", "validate"]


class SimResult(NamedTuple):
    """What :func:`simulate` measured on its clock.

    Attributes:
        starts: ``starts[r][k]``: start time of rank ``r``'s ``k``-th action.
        ends: ``ends[r][k]``: its end time.
        makespan: the last end time (the first action starts at 0).
        busy: per rank, the time spent computing.
        bubble: idle fraction, ``1 - sum(busy) / (n_ranks * makespan)``.
        peak_in_flight: per rank, the most micro-batch stages whose ``F`` has run and
            ``B`` has not (1F1B: ``p - r`` on rank ``r``; GPipe: ``m * n_virtual``).
        peak_held: per rank, the most whose ``F`` has run and last backward piece (``W``
            when the schedule splits backward, else ``B``) has not: activations kept.
    """

    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    bubble: float
    peak_in_flight: tuple[int, ...]
    peak_held: tuple[int, ...]


def _dependency(action: Action, n_stages: int) -> Action | None:
    kind, stage, mb = action
    if kind == ActionKind.F:
        return None if stage == 0 else Action(ActionKind.F, stage - 1, mb)
    if kind == ActionKind.B:
        return Action(ActionKind.F, stage, mb) if stage == n_stages - 1 else \
            Action(ActionKind.B, stage + 1, mb)
    return Action(ActionKind.B, stage, mb)


def _name(action: Action) -> str:
    return f"{action.kind}(stage {action.stage}, microbatch {action.microbatch})"


def _check_placement(schedule: Schedule) -> None:
    """A placement names a rank for every stage, each rank holding ``n_virtual`` of them."""
    placement = schedule.placement
    if placement is None:
        return
    p, n_stages = schedule.n_ranks, schedule.n_stages
    if len(placement) != n_stages or any(
            isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < p for r in placement):
        raise ValueError(f"schedule {schedule.name!r}: placement {list(placement)} must give "
                         f"a pp rank 0..{p - 1} for each of the {n_stages} stages")
    held = Counter(placement)
    uneven = [r for r in range(p) if held[r] != schedule.n_virtual]
    if uneven:
        raise ValueError(f"schedule {schedule.name!r}: placement {list(placement)} puts "
                         f"{held[uneven[0]]} stages on rank {uneven[0]}; every rank holds "
                         f"n_virtual={schedule.n_virtual}")


def _missing_reason(action: Action, m: int) -> str:
    if action.kind == ActionKind.F:
        return (f"micro-batch {action.microbatch} never runs stage {action.stage} "
                f"(n_microbatches={m}: every stage runs every micro-batch)")
    if action.kind == ActionKind.B:
        return "its forward's backward never runs"
    return "the schedule splits backward (it has W actions): every B needs its W"


def _check_counts(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Every action once, on its own rank, of a known kind; ``{action: (rank, position)}``."""
    p, n_stages, m = schedule.n_ranks, schedule.n_stages, schedule.n_microbatches
    if len(schedule.actions) != p:
        raise ValueError(f"schedule {schedule.name!r}: {len(schedule.actions)} action lists "
                         f"for n_ranks={p}")
    _check_placement(schedule)
    kinds = tuple(ActionKind) if schedule.split_backward else (ActionKind.F, ActionKind.B)
    where: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for position, action in enumerate(actions):
            action = Action(*action)
            if action.kind not in kinds:
                raise ValueError(f"schedule {schedule.name!r}: rank {rank} action {position} "
                                 f"has kind {action.kind!r}; this schedule has {kinds}")
            if not (0 <= action.stage < n_stages and 0 <= action.microbatch < m):
                raise ValueError(f"schedule {schedule.name!r}: rank {rank} runs "
                                 f"{_name(action)} out of range (stages 0..{n_stages - 1}, "
                                 f"microbatches 0..{m - 1})")
            if schedule.rank_of(action.stage) != rank:
                raise ValueError(f"schedule {schedule.name!r}: rank {rank} runs "
                                 f"{_name(action)}, which lives on rank "
                                 f"{schedule.rank_of(action.stage)}")
            if action in where:
                raise ValueError(f"schedule {schedule.name!r}: rank {rank} runs "
                                 f"{_name(action)} twice (positions {where[action][1]} and "
                                 f"{position})")
            where[action] = (rank, position)
    missing = [Action(k, s, i) for k in kinds for s in range(n_stages) for i in range(m)
               if Action(k, s, i) not in where]
    if missing:
        first = missing[0]
        raise ValueError(f"schedule {schedule.name!r}: rank {schedule.rank_of(first.stage)} "
                         f"never runs {_name(first)}: {_missing_reason(first, m)} "
                         f"({len(missing)} actions missing in all)")
    return where


def _check_same_rank_order(schedule: Schedule, where: dict[Action, tuple[int, int]]) -> None:
    for action, (rank, position) in where.items():
        needed = _dependency(action, schedule.n_stages)
        if needed is not None and where[needed][0] == rank and where[needed][1] > position:
            raise ValueError(f"schedule {schedule.name!r}: rank {rank} runs {_name(action)} "
                             f"(position {position}) before {_name(needed)} (position "
                             f"{where[needed][1]}), which it needs")


def _check_messages(schedule: Schedule) -> None:
    """Every message a rank sends (:func:`~.messages.message_lists`) is one its peer
    receives, and the reverse: nothing is left unsent or unreceived."""
    sent: Counter[tuple] = Counter()
    received: Counter[tuple] = Counter()
    for rank in range(schedule.n_ranks):
        owed, expected = message_lists(schedule, rank)
        sent.update((key, rank, dst) for key, dst in owed)
        received.update((key, src, rank) for key, src in expected)
    unreceived, unsent = list(sent - received), list(received - sent)
    if unreceived:
        key, src, dst = unreceived[0]
        raise ValueError(f"schedule {schedule.name!r}: rank {src} sends {key} to rank {dst}, "
                         "which never receives it")
    if unsent:
        key, src, dst = unsent[0]
        raise ValueError(f"schedule {schedule.name!r}: rank {dst} waits for {key} from rank "
                         f"{src}, which never sends it")


def _durations(schedule: Schedule, t_f: float, t_b: float, t_w: float | None
               ) -> dict[ActionKind, float]:
    if min(t_f, t_b) <= 0:
        raise ValueError(f"simulate: t_f and t_b must be > 0, got t_f={t_f}, t_b={t_b}")
    if not schedule.split_backward:
        return {ActionKind.F: t_f, ActionKind.B: t_b}
    t_w = t_b / 2 if t_w is None else t_w
    if not 0 < t_w < t_b:
        raise ValueError(f"simulate: t_w (the weight-gradient part of t_b) must be in "
                         f"(0, t_b={t_b}), got {t_w}")
    return {ActionKind.F: t_f, ActionKind.B: t_b - t_w, ActionKind.W: t_w}


def _run(schedule: Schedule, durations: dict[ActionKind, float], t_comm: float):
    """The always-make-progress execution: ``(starts, ends)`` per rank, or a deadlock."""
    p, n_stages = schedule.n_ranks, schedule.n_stages
    done: dict[Action, float] = {}
    starts: list[list[float]] = [[] for _ in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while len(ends[rank]) < len(actions):
                action = Action(*actions[len(ends[rank])])
                needed = _dependency(action, n_stages)
                if needed is not None and needed not in done:
                    break
                ready = 0.0 if needed is None else done[needed] + (
                    t_comm if schedule.rank_of(needed.stage) != rank else 0.0)
                start = max(ends[rank][-1] if ends[rank] else 0.0, ready)
                starts[rank].append(start)
                ends[rank].append(start + durations[action.kind])
                done[action] = ends[rank][-1]
                progressed = True
    stuck = [(rank, Action(*actions[len(ends[rank])]))
             for rank, actions in enumerate(schedule.actions) if len(ends[rank]) < len(actions)]
    if stuck:
        waits = "; ".join(f"rank {rank} at {_name(a)} waits for "
                          f"{_name(_dependency(a, n_stages))}" for rank, a in stuck)
        raise ValueError(f"schedule {schedule.name!r} deadlocks (blocking receives, "
                         f"non-blocking sends): {waits}")
    return starts, ends


def validate(schedule: Schedule) -> None:
    """Check that the runtime can execute ``schedule``; raise a clear ValueError if not.

    Checks: one action list per rank; a placement (if any) gives each rank ``n_virtual``
    stages; every ``(stage, microbatch)`` has exactly one ``F`` and one ``B`` (and one
    ``W`` when ``split_backward``, none otherwise); each rank runs only its own stages
    (:meth:`~.schedules.Schedule.rank_of`); a rank never runs an action before one of
    its own that it needs; every message sent is received; and the execution cannot
    deadlock. Each refusal names the rank, the action and the reason.

    Args:
        schedule: the schedule to check.

    Returns:
        None.

    Example:
        >>> from shardfn.transforms.pipeline.schedules import make_schedule
        >>> validate(make_schedule("zb-h1", 4, 8))
    """
    where = _check_counts(schedule)
    _check_same_rank_order(schedule, where)
    _check_messages(schedule)
    _run(schedule, dict.fromkeys(ActionKind, 1.0), 0.0)


def _peaks(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    last = ActionKind.W if schedule.split_backward else ActionKind.B
    in_flight, held = [], []
    for actions in schedule.actions:
        count_b = count_last = peak_b = peak_last = 0
        for action in actions:
            kind = action[0]
            count_b += (kind == ActionKind.F) - (kind == ActionKind.B)
            count_last += (kind == ActionKind.F) - (kind == last)
            peak_b, peak_last = max(peak_b, count_b), max(peak_last, count_last)
        in_flight.append(peak_b)
        held.append(peak_last)
    return tuple(in_flight), tuple(held)


def simulate(schedule: Schedule, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None,
             t_comm: float = 0.0) -> SimResult:
    """Validate ``schedule``, then run it on a clock.

    Args:
        schedule: the schedule.
        t_f: time of one ``F`` (one stage, one micro-batch).
        t_b: time of one full backward. With ``split_backward`` the ``B`` takes
            ``t_b - t_w`` and the ``W`` ``t_w``, so schedules compare at equal work.
        t_w: the weight-gradient part (default ``t_b / 2``); only for split schedules.
        t_comm: delay of each message between ranks (0: free communication).

    Returns:
        A :class:`SimResult`.

    Example:
        >>> from shardfn.transforms.pipeline.schedules import make_schedule
        >>> round(simulate(make_schedule("gpipe", 4, 4)).bubble, 4)   # 3 / 7
        0.4286
    """
    validate(schedule)
    durations = _durations(schedule, t_f, t_b, t_w)
    starts, ends = _run(schedule, durations, t_comm)
    makespan = max((e[-1] for e in ends if e), default=0.0)
    busy = tuple(sum(durations[a[0]] for a in actions) for actions in schedule.actions)
    bubble = 1.0 - sum(busy) / (schedule.n_ranks * makespan) if makespan else 0.0
    in_flight, held = _peaks(schedule)
    return SimResult(tuple(map(tuple, starts)), tuple(map(tuple, ends)), makespan, busy,
                     bubble, in_flight, held)


def theoretical_bubble(name: ScheduleName, n_ranks: int, n_microbatches: int, n_virtual: int = 1,
                       t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None) -> float:
    """The textbook bubble fraction of a schedule (free communication).

    * GPipe and 1F1B (one stage per rank): ``(p - 1) / (m + p - 1)``, exact for any
      ``m``, ``t_f`` and ``t_b``;
    * interleaved, and GPipe over ``v`` stages per rank (looped):
      ``(p - 1) / (v * m + p - 1)`` (Narayanan et al. 2021), exact for ``m >= p``
      (with fewer micro-batches than ranks the bubble is larger);
    * ``"interleaved_zb"`` and ``"zbv"``: no formula (ValueError); :func:`simulate` gives
      their bubble;
    * ZB-H1: idle time ``(p - 1) * (t_f + t_b - 2 t_w)`` per rank (Qi et al. 2023 write it
      ``(p - 1)(T_F + T_B - T_W)`` with ``T_B`` the input gradient alone), over the
      makespan ``m (t_f + t_b) + (p - 1)(t_f + t_b - 2 t_w)``; exact for ``m >= p`` when
      ``t_w <= t_f`` and ``t_w <= t_b - t_w``; otherwise :func:`simulate` is the
      reference.

    Args:
        name: a schedule name of :func:`make_schedule`.
        n_ranks, n_microbatches, n_virtual: ``p``, ``m``, ``v``.
        t_f, t_b, t_w: as for :func:`simulate`.

    Returns:
        The idle fraction of ``n_ranks * makespan``.

    Example:
        >>> theoretical_bubble("1f1b", 2, 4)
        0.2
    """
    p, m, v = n_ranks, n_microbatches, n_virtual
    if name in ("gpipe", "1f1b", "interleaved", "interleaved_1f1b"):
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        t_w = t_b / 2 if t_w is None else t_w
        idle = (p - 1) * (t_f + t_b - 2 * t_w)
        return idle / (m * (t_f + t_b) + idle)
    if name in ("interleaved_zb", "zbv"):
        raise ValueError(f"theoretical_bubble: schedule {name!r} has no closed form here "
                         "(its bubble depends on t_f, t_b, t_w and m together): use "
                         "simulate(make_schedule(...)).bubble")
    raise ValueError(f"theoretical_bubble: unknown schedule {name!r}")
