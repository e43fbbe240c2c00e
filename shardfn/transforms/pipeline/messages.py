"""Which messages each pp rank sends and receives in a step, read off the schedule.

A schedule says, per rank, the order of its actions and, by its placement
(:meth:`~.schedules.Schedule.rank_of`), where each stage lives; the messages follow
from it: ``F`` of stage ``s`` receives ``("act", s - 1, i)`` from stage ``s - 1``'s rank
and sends ``("act", s, i)`` to stage ``s + 1``'s; ``B`` receives ``("grad", s + 1, i)``
and sends ``("grad", s, i)``; the last stage's rank sends ``("loss", 0, 0)`` to
every other pp rank at the end. Messages between stages on the same rank are
local hand-offs, not messages. Used for error settling (every message owed or
expected) and to free send buffers as soon as a send is known to be complete.

Example:
    >>> owed, expected = message_lists(make_schedule("gpipe", 2, 1), 0)
    >>> owed, expected
    ([(('act', 0, 0), 1)], [(('grad', 1, 0), 1), (('loss', 0, 0), 1)])
"""

from __future__ import annotations

from collections.abc import Sequence

from shardfn.transforms.pipeline.kinds import LOSS_KEY, ActionKind, MessageKind
from shardfn.transforms.pipeline.kinds import MessageKey as Key
from shardfn.transforms.pipeline.schedules import Action, Schedule

__all__ = ["message_lists", "release_points"]


def message_lists(schedule: Schedule, rank: int, actions: Sequence[Action] | None = None
                  ) -> tuple[list[tuple[Key, int]], list[tuple[Key, int]]]:
    """``(owed, expected)``: every ``(key, peer)`` pp rank ``rank`` sends / receives.

    Args:
        schedule: the schedule.
        rank: the pp rank.
        actions: the actions run (default: the rank's whole schedule, plus the loss).
    """
    p, last, rank_of = schedule.n_ranks, schedule.n_stages - 1, schedule.rank_of
    owed, expected = [], []
    for kind, s, i in actions if actions is not None else schedule.actions[rank]:
        if kind == ActionKind.F:
            before, after = (MessageKind.ACT, s - 1, i), (MessageKind.ACT, s, i)
            src, dst = s - 1, s + 1
        elif kind == ActionKind.B:
            before, after = (MessageKind.GRAD, s + 1, i), (MessageKind.GRAD, s, i)
            src, dst = s + 1, s - 1
        else:
            continue
        if 0 <= src <= last and rank_of(src) != rank:
            expected.append((before, rank_of(src)))
        if 0 <= dst <= last and rank_of(dst) != rank:
            owed.append((after, rank_of(dst)))
    if actions is None:
        holder = rank_of(last)
        if rank == holder:
            owed += [(LOSS_KEY, r) for r in range(p) if r != rank]
        else:
            expected.append((LOSS_KEY, holder))
    return owed, expected


def release_points(schedule: Schedule, rank: int
                   ) -> dict[tuple[Key, int], tuple[tuple[Key, int], ...]]:
    """For :attr:`StepPlan.releases`: per message ``rank`` receives, the sends it completes."""
    found: dict[tuple[Key, int], list[tuple[Key, int]]] = {}
    for peer in range(schedule.n_ranks):
        if peer == rank:
            continue
        per_action = [message_lists(schedule, peer, [a]) for a in schedule.actions[peer]]
        for index, (_, expected) in enumerate(per_action):
            for key, src in expected:
                if src != rank:
                    continue
                for owed, _ in per_action[index:]:  # a send in the same action follows its recv
                    back = [k for k, dst in owed if dst == rank]
                    if back:
                        found.setdefault((back[0], peer), []).append((key, peer))
                        break
    return {received: tuple(sends) for received, sends in found.items()}
