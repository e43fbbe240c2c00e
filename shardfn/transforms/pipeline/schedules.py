"""Pipeline schedules as data: for each pp rank, the ordered list of actions it runs.

A schedule does no work and no communication: the runtime
(:mod:`shardfn.transforms.pipeline`) executes each rank's actions in order,
receiving a stage's input (or output gradient) from the neighbouring stage's
rank when the action needs it and sending its result on.

Stages are *virtual*: with ``n_virtual`` chunks per rank there are
``n_stages = n_ranks * n_virtual`` stages. Where they live is the schedule's
:attr:`Schedule.placement`: looped by default (stage ``s`` on rank ``s % n_ranks``,
so rank ``r`` holds stages ``r, r + p, r + 2p, ...``), or V-shaped for ``"zbv"``
(stage ``s`` on rank ``s`` for ``s < p``, on rank ``2p - 1 - s`` after: rank ``r``
holds stages ``r`` and ``2p - 1 - r``, and the first and last stage share rank 0).

Schedules (``make_schedule(name, ...)``):

* ``"gpipe"``: every forward, then every backward (activations of all ``m``
  micro-batches held); with ``n_virtual > 1`` it is the looped breadth-first
  order (torch's ``ScheduleLoopedBFS``).
* ``"1f1b"``: PipeDream-flush: rank ``r`` runs ``p - r - 1`` warm-up forwards,
  then alternates one forward and one backward, then the cool-down backwards.
  At most ``p - r`` micro-batches are in flight on rank ``r``.
* ``"interleaved"`` (alias ``"interleaved_1f1b"``): Megatron's interleaved 1F1B
  over ``n_virtual`` chunks per rank, in the generalised form of torch's
  ``ScheduleInterleaved1F1B``: micro-batches go in rounds of
  ``g = m // max(1, m // p)``, so ``m`` must be a multiple of
  ``max(1, m // p)`` (``m % p == 0``, Megatron's rule, is the common case;
  ``m < p`` is one round). With ``n_virtual == 1`` it is ``"1f1b"``.
* ``"zb-h1"``: zero bubble H1 (Qi et al. 2023, the handcrafted schedule):
  backward split into ``B`` (input gradient, on the critical path) and ``W``
  (weight gradient); the 1F1B order with rank ``r``'s first ``r`` weight
  gradients deferred, so the input gradients reach the first stage sooner and
  the deferred ``W`` fill the cool-down. Peak activations ``p`` micro-batches
  (rank 0), as 1F1B.
* ``"interleaved_zb"``: interleaved zero bubble (torch's
  ``ScheduleInterleavedZeroBubble``, ZB-1P over virtual stages): the interleaved
  order with ``(v - 1) * g + (p - 1 - r)`` warm-up forwards (one per hop, not two:
  ``B`` is shorter) and rank ``r``'s first ``r`` weight gradients deferred, as
  ``"zb-h1"``. Same rounds rule on ``m`` as ``"interleaved"``; with ``n_virtual == 1``
  it is ``"zb-h1"``.
* ``"zbv"``: ZB-V (Qi et al. 2023, section 6; torch's ``ScheduleZBVZeroBubble``):
  exactly two stages per rank placed in a V (above), split backward; the chunk
  going down is fed ``2(p - r) - 1`` forwards ahead, then both chunks alternate
  ``F``, ``B``, ``W``. Any ``m >= 1`` (below ``2p - 1`` the steady state is shorter).

``"interleaved"``, ``"interleaved_zb"`` and ``"gpipe"`` take ``n_virtual > 1``;
``"zbv"`` takes ``n_virtual == 2`` only. A schedule written by hand is
:func:`~.written.schedule_from_actions` (or ``schedule_from_csv``), checked by the
simulator when built.

Action kinds (:class:`~.kinds.ActionKind`, equal to the strings):

* ``"F"``: forward of ``stage`` on ``microbatch``;
* ``"B"``: backward; the full backward (input and weight gradients) unless the
  schedule has ``split_backward``, then only the input gradient;
* ``"W"``: the weight gradient (only in schedules with ``split_backward``).

Example:
    >>> s = make_schedule("gpipe", n_ranks=2, n_microbatches=2)
    >>> [a.kind + str(a.microbatch) for a in s.actions[0]]
    ['F0', 'F1', 'B0', 'B1']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Literal, NamedTuple

from shardfn.transforms.pipeline.kinds import ActionKind

__all__ = ["SCHEDULES", "Action", "ActionKind", "Schedule", "ScheduleName", "make_schedule",
           "stage_rank", "v_placement"]

#: the names :func:`make_schedule` knows (``"interleaved_1f1b"`` = ``"interleaved"``)
ScheduleName = Literal["gpipe", "1f1b", "interleaved", "interleaved_1f1b", "zb-h1",
                       "interleaved_zb", "zbv"]


class Action(NamedTuple):
    """One step of a rank's schedule.

    Attributes:
        kind: :class:`~.kinds.ActionKind` ``F`` (forward), ``B`` (backward, or
            input-gradient only when the schedule splits backward) or ``W`` (weight
            gradient); a plain ``"F"``, ``"B"`` or ``"W"`` compares equal.
        stage: the (virtual) stage index, ``0 .. n_stages - 1``.
        microbatch: the micro-batch index, ``0 .. n_microbatches - 1``.
    """

    kind: ActionKind
    stage: int
    microbatch: int


class Schedule(NamedTuple):
    """Every pp rank's ordered actions; see the module docstring.

    Attributes:
        name: the schedule's name (``"gpipe"``, ``"1f1b"``, ...).
        n_ranks: pp ranks.
        n_virtual: stages (chunks) per rank.
        n_microbatches: micro-batches per step.
        split_backward: ``"B"`` is the input gradient only and ``"W"`` actions exist.
        actions: ``actions[r]`` is rank ``r``'s actions in execution order.
        placement: ``placement[s]`` is the pp rank of stage ``s``; None (the default) is
            looped, ``s % n_ranks`` (:meth:`rank_of` reads it).
    """

    name: ScheduleName | str
    n_ranks: int
    n_virtual: int
    n_microbatches: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] | None = None

    @property
    def n_stages(self) -> int:
        return self.n_ranks * self.n_virtual

    def rank_of(self, stage: int) -> int:
        """The pp rank that holds ``stage`` under this schedule's placement.

        Example:
            >>> make_schedule("zbv", 2, 4, 2).rank_of(3), make_schedule("1f1b", 2, 4).rank_of(1)
            (0, 1)
        """
        return stage_rank(stage, self.n_ranks) if self.placement is None else \
            self.placement[stage]


def stage_rank(stage: int, n_ranks: int) -> int:
    """The pp rank that holds ``stage`` under the looped placement
    (:meth:`Schedule.rank_of` is the schedule's own)."""
    return stage % n_ranks


def v_placement(n_ranks: int) -> tuple[int, ...]:
    """The V-shaped placement of ``2 * n_ranks`` stages: down the ranks, then back up.

    Example:
        >>> v_placement(3)
        (0, 1, 2, 2, 1, 0)
    """
    return tuple(range(n_ranks)) + tuple(reversed(range(n_ranks)))


def _gpipe(n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    stages = n_ranks * n_virtual
    actions = []
    for rank in range(n_ranks):
        mine = [s for s in range(stages) if stage_rank(s, n_ranks) == rank]
        fwd = [Action(ActionKind.F, s, i) for s in mine for i in range(n_microbatches)]
        bwd = [Action(ActionKind.B, s, i) for s in reversed(mine) for i in range(n_microbatches)]
        actions.append(tuple(fwd + bwd))
    return Schedule("gpipe", n_ranks, n_virtual, n_microbatches, False, tuple(actions))


def _ranked_1f1b(warmup: int, n_ops: int, forward_stage: Callable[[int], int],
                 backward_stage: Callable[[int], int], deferred_w: int | None) -> list[Action]:
    """One rank's warm-up / steady 1F1B / cool-down order (the shape torch's schedules share).

    Args:
        warmup: forwards before the first backward.
        n_ops: forwards (= backwards) this rank runs: ``n_virtual * m``.
        forward_stage: ``k -> stage`` of the ``k``-th forward.
        backward_stage: ``k -> stage`` of the ``k``-th backward.
        deferred_w: ``None``: no split backward; else the number of weight gradients held
            back before each ``B`` is followed by the oldest pending ``W``.

    Returns:
        The rank's actions; micro-batches count up per stage.
    """
    next_mb: dict[tuple[ActionKind, int], int] = {}
    pending_w: list[Action] = []
    out: list[Action] = []

    def take(kind: ActionKind, stage: int) -> Action:
        mb = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = mb + 1
        return Action(kind, stage, mb)

    def backward(k: int) -> None:
        out.append(take(ActionKind.B, backward_stage(k)))
        if deferred_w is None:
            return
        pending_w.append(Action(ActionKind.W, out[-1].stage, out[-1].microbatch))
        if k >= deferred_w:
            out.append(pending_w.pop(0))

    for k in range(warmup):
        out.append(take(ActionKind.F, forward_stage(k)))
    for k in range(n_ops - warmup):
        out.append(take(ActionKind.F, forward_stage(warmup + k)))
        backward(k)
    for k in range(n_ops - warmup, n_ops):
        backward(k)
    return out + pending_w


def _one_f_one_b(n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    actions = tuple(tuple(_ranked_1f1b(
        min(n_ranks - r - 1, n_microbatches), n_microbatches,
        lambda k, r=r: r, lambda k, r=r: r, None)) for r in range(n_ranks))
    return Schedule("1f1b", n_ranks, 1, n_microbatches, False, actions)


def interleaved_round(n_ranks: int, n_microbatches: int, name: str = "interleaved") -> int:
    """Micro-batches per round of the interleaved schedule: ``m // max(1, m // p)``.

    Raises:
        ValueError: ``m`` is not a multiple of the number of rounds ``max(1, m // p)``.

    Example:
        >>> interleaved_round(4, 8), interleaved_round(4, 10), interleaved_round(4, 3)
        (4, 5, 3)
    """
    rounds = max(1, n_microbatches // n_ranks)
    if n_microbatches % rounds:
        valid = [k for k in range(max(1, n_microbatches - n_ranks), n_microbatches + n_ranks)
                 if k % max(1, k // n_ranks) == 0]
        raise ValueError(
            f"schedule {name!r} runs micro-batches in rounds of m // max(1, m // p); "
            f"m={n_microbatches} is not a multiple of its {rounds} rounds with p={n_ranks} "
            f"ranks (m % p == 0 always works; nearby valid m: {valid})")
    return n_microbatches // rounds


def _interleaved(n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    if n_virtual == 1:
        return _one_f_one_b(n_ranks, n_microbatches, 1)._replace(name="interleaved")
    per_round = interleaved_round(n_ranks, n_microbatches)
    n_ops = n_virtual * n_microbatches
    actions = []
    for r in range(n_ranks):
        warmup = min((n_virtual - 1) * per_round + 2 * (n_ranks - 1 - r), n_ops)

        def forward_stage(k: int, r: int = r) -> int:
            return (k // per_round) % n_virtual * n_ranks + r

        def backward_stage(k: int, r: int = r) -> int:
            return (n_virtual - 1 - (k // per_round) % n_virtual) * n_ranks + r

        actions.append(tuple(_ranked_1f1b(warmup, n_ops, forward_stage, backward_stage,
                                          None)))
    return Schedule("interleaved", n_ranks, n_virtual, n_microbatches, False, tuple(actions))


def _zb_h1(n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    actions = tuple(tuple(_ranked_1f1b(
        min(n_ranks - r - 1, n_microbatches), n_microbatches,
        lambda k, r=r: r, lambda k, r=r: r, r)) for r in range(n_ranks))
    return Schedule("zb-h1", n_ranks, 1, n_microbatches, True, actions)


def _interleaved_zb(n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """torch's ``ScheduleInterleavedZeroBubble``: one warm-up forward per hop, ``W``
    deferred by ``r`` on rank ``r`` (its idle slots are timing, not order: dropped)."""
    if n_virtual == 1:
        return _zb_h1(n_ranks, n_microbatches, 1)._replace(name="interleaved_zb")
    per_round = interleaved_round(n_ranks, n_microbatches, "interleaved_zb")
    n_ops = n_virtual * n_microbatches
    actions = []
    for r in range(n_ranks):
        def forward_stage(k: int, r: int = r) -> int:
            return (k // per_round) % n_virtual * n_ranks + r

        def backward_stage(k: int, r: int = r) -> int:
            return (n_virtual - 1 - (k // per_round) % n_virtual) * n_ranks + r

        warmup = min((n_virtual - 1) * per_round + n_ranks - 1 - r, n_ops)
        actions.append(tuple(_ranked_1f1b(warmup, n_ops, forward_stage, backward_stage, r)))
    return Schedule("interleaved_zb", n_ranks, n_virtual, n_microbatches, True, tuple(actions))


def _zbv_rank(rank: int, n_ranks: int, n_microbatches: int) -> list[Action]:
    """Rank ``rank``'s ZB-V order (torch's ``ScheduleZBVZeroBubble``): ``down`` is its
    stage on the way down the V, ``up`` on the way back; planned for at least
    ``2p - 1`` micro-batches, then the ones past ``m`` dropped."""
    p, F, B, W = n_ranks, ActionKind.F, ActionKind.B, ActionKind.W
    down, up = rank, 2 * p - 1 - rank
    planned = max(2 * p - 1, n_microbatches)
    count: Counter[tuple[ActionKind, int]] = Counter()
    out: list[Action] = []

    def run(*steps: tuple[ActionKind, int]) -> None:
        for kind, stage in steps:
            out.append(Action(kind, stage, count[(kind, stage)]))
            count[(kind, stage)] += 1

    for _ in range(2 * (p - rank) - 1):  # warm-up: the down chunk runs ahead
        run((F, down))
    for _ in range(rank):
        run((F, up), (F, down))
    for _ in range(p - rank):
        run((F, up), (B, up), (W, up))
    while count[(F, up)] < count[(F, down)] or count[(F, down)] < planned:  # steady
        if count[(F, down)] < planned:
            run((F, down))
        run((B, down), (W, down), (F, up), (B, up), (W, up))
    for _ in range(rank):  # cool-down: input gradients first, weight gradients fill in
        run((B, down), (B, up))
    for _ in range(p - rank):
        run((B, down), (W, down))
    run(*[(W, up)] * (count[(B, up)] - count[(W, up)]))
    run(*[(W, down)] * (count[(B, down)] - count[(W, down)]))
    return [a for a in out if a.microbatch < n_microbatches]


def _zbv(n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    if n_virtual != 2:
        raise ValueError(f"make_schedule: schedule 'zbv' places exactly 2 stages per rank "
                         f"(a V over {2 * n_ranks} stages); got n_virtual={n_virtual}: pass "
                         f"virtual=2")
    actions = tuple(tuple(_zbv_rank(r, n_ranks, n_microbatches)) for r in range(n_ranks))
    return Schedule("zbv", n_ranks, 2, n_microbatches, True, actions, v_placement(n_ranks))


#: name -> (builder, takes n_virtual > 1)
SCHEDULES: dict[ScheduleName, tuple[Callable[[int, int, int], Schedule], bool]] = {
    "gpipe": (_gpipe, True),
    "1f1b": (_one_f_one_b, False),
    "interleaved": (_interleaved, True),
    "interleaved_1f1b": (_interleaved, True),
    "zb-h1": (_zb_h1, False),
    "interleaved_zb": (_interleaved_zb, True),
    "zbv": (_zbv, True),
}


def _check_count(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"make_schedule: {what} must be an int >= 1, got {value!r}")


def make_schedule(name: ScheduleName, n_ranks: int, n_microbatches: int,
                  n_virtual: int = 1) -> Schedule:
    """Build the named schedule (see the module docstring for each one's order).

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (= ``"interleaved_1f1b"``),
            ``"zb-h1"``, ``"interleaved_zb"`` or ``"zbv"``.
        n_ranks: pp ranks ``p`` (>= 1).
        n_microbatches: micro-batches per step ``m`` (>= 1); ``"interleaved"`` and
            ``"interleaved_zb"`` need ``m`` to be a multiple of ``max(1, m // p)``
            (:func:`interleaved_round`).
        n_virtual: stages per rank (>= 1); above 1 only for ``"interleaved"``,
            ``"interleaved_zb"`` and ``"gpipe"``; exactly 2 for ``"zbv"``.

    Returns:
        The :class:`Schedule`; :func:`shardfn.transforms.pipeline.simulate.validate` passes
        on it.

    Raises:
        ValueError: an unknown name, a count below 1, ``n_virtual > 1`` for a schedule
            with one stage per rank, ``n_virtual != 2`` for ``"zbv"``, or an ``m`` the
            interleaved rounds do not divide.

    Example:
        >>> s = make_schedule("1f1b", 2, 3)
        >>> [a.kind + str(a.microbatch) for a in s.actions[0]]
        ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    if name not in SCHEDULES:
        raise ValueError(f"make_schedule: unknown schedule {name!r}; "
                         f"choose one of {sorted(SCHEDULES)}")
    _check_count("n_ranks", n_ranks)
    _check_count("n_microbatches", n_microbatches)
    _check_count("n_virtual", n_virtual)
    build, virtual = SCHEDULES[name]
    if n_virtual > 1 and not virtual:
        raise ValueError(f"make_schedule: schedule {name!r} runs one stage per rank; "
                         f"n_virtual={n_virtual} needs 'interleaved', 'interleaved_zb', "
                         f"'zbv' (2 per rank) or 'gpipe'")
    return build(n_ranks, n_microbatches, n_virtual)
