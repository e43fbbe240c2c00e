"""Pipeline schedules as data: for each pp rank, the ordered list of actions it runs.

A schedule does no work and no communication: the runtime
(:mod:`shardfn.transforms.pipeline`) executes each rank's actions in order,
receiving a stage's input (or output gradient) from the neighbouring stage's
rank when the action needs it and sending its result on.

Stages are *virtual*: with ``n_virtual`` chunks per rank there are
``n_stages = n_ranks * n_virtual`` stages, placed looped: stage ``s`` lives on
rank ``s % n_ranks`` (so rank ``r`` holds stages ``r, r + p, r + 2p, ...``).

Action kinds:

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

from typing import NamedTuple

__all__ = ["Action", "Schedule", "make_schedule", "stage_rank"]


class Action(NamedTuple):
    """One step of a rank's schedule.

    Attributes:
        kind: ``"F"`` (forward), ``"B"`` (backward, or input-gradient only when the
            schedule splits backward) or ``"W"`` (weight gradient).
        stage: the (virtual) stage index, ``0 .. n_stages - 1``.
        microbatch: the micro-batch index, ``0 .. n_microbatches - 1``.
    """

    kind: str
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
    """

    name: str
    n_ranks: int
    n_virtual: int
    n_microbatches: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]

    @property
    def n_stages(self) -> int:
        return self.n_ranks * self.n_virtual


def stage_rank(stage: int, n_ranks: int) -> int:
    """The pp rank that holds ``stage`` (looped placement)."""
    return stage % n_ranks


def _gpipe(n_ranks: int, n_microbatches: int, n_virtual: int) -> Schedule:
    stages = n_ranks * n_virtual
    actions = []
    for rank in range(n_ranks):
        mine = [s for s in range(stages) if stage_rank(s, n_ranks) == rank]
        fwd = [Action("F", s, i) for s in mine for i in range(n_microbatches)]
        bwd = [Action("B", s, i) for s in reversed(mine) for i in range(n_microbatches)]
        actions.append(tuple(fwd + bwd))
    return Schedule("gpipe", n_ranks, n_virtual, n_microbatches, False, tuple(actions))


def make_schedule(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> Schedule:
    """Build the named schedule.

    Args:
        name: ``"gpipe"`` (others: being written).
        n_ranks: pp ranks (>= 1).
        n_microbatches: micro-batches per step (>= 1).
        n_virtual: stages per rank (>= 1).

    Returns:
        The :class:`Schedule`.

    Example:
        >>> make_schedule("gpipe", 2, 4).n_stages
        2
    """
    if name == "gpipe":
        return _gpipe(n_ranks, n_microbatches, n_virtual)
    raise NotImplementedError(f"schedule {name!r} is not written yet")
