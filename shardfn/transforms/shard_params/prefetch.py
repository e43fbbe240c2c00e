"""Gathers issued ahead of the unit call that needs them, and the guess they follow.

While a unit computes, the all-gathers of the next ``prefetch`` unit calls are in
flight. Backward knows its order (the reverse of this call's forward); forward
does not, so it follows a :class:`PrefetchGuess`: the unit order of the model's
previous forward (at first the registration order). A wrong guess wastes a
gather (completed and dropped), never a result.

Example:
    >>> prefetcher = Prefetcher(plan, guess, start, skip)
    >>> gather = prefetcher.take(Phase.FORWARD, 0, unit)   # prefetched, or issued now
    >>> prefetcher.ahead(Phase.FORWARD, 0)                 # the next calls' gathers
    >>> prefetcher.ahead(Phase.BACKWARD, 5, order)         # the calls before 5 in ``order``
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from shardfn.transforms.shard_params.exchange import UnitGather
from shardfn.transforms.shard_params.plan import Plan, Unit

__all__ = ["Phase", "PrefetchGuess", "Prefetcher"]


class Phase(enum.Enum):
    """Where an ``apply`` call is; a unit call does different work in each."""

    FORWARD = "forward"  # the root's forward, no graph kept (no grad, or remat)
    FORWARD_GRAPH = "forward, recording the root's graph"  # remat=None: units join via UnitFn
    BACKWARD = "backward"  # the root's backward is running
    RECOMPUTE = "backward, recomputing the root"  # remat: unit calls replay their outputs
    DONE = "done"  # backward finished (it freed what forward saved)


class PrefetchGuess:
    """The unit order of a model's previous forward: the guess at the next call's order.

    Owned by the :class:`~shardfn.transforms.shard_params.api.ShardedModel` (shared by
    its dtype variants) and the one thing carried from one ``apply`` to the next. It
    affects only *when* work happens: which gathers are issued ahead, and which deferred
    reduction a unit call offers to wait for (``deferred.DeferredReductions``, which
    corrects a wrong offer before backward). The gradients returned never depend on it.
    """

    def __init__(self, n_units: int):
        self.n_units = n_units
        self.order: list[int] = []  # empty: no forward yet (registration order)

    def unit_at(self, position: int) -> int | None:
        """The unit index guessed for call ``position`` of a forward (None: past the end)."""
        order = self.order or range(self.n_units)
        return order[position] if 0 <= position < len(order) else None

    def update(self, order: Sequence[int]) -> None:
        """Remember the order a forward just ran (the next forward's guess)."""
        self.order = list(order)


class Prefetcher:
    """The gathers in flight for later unit calls of one ``apply``.

    Args:
        plan: the model's plan (``prefetch`` calls ahead).
        guess: the forward's guess of the call order.
        start: issues the gather of a unit for a call ``(unit, phase, position)``.
        skip: whether a unit index needs no gather (its full parameters are kept).
    """

    def __init__(self, plan: Plan, guess: PrefetchGuess,
                 start: Callable[[Unit, Phase, int], UnitGather], skip: Callable[[int], bool]):
        self.plan, self.guess = plan, guess
        self.start, self.skip = start, skip
        self.pending: dict[tuple[Phase, int], UnitGather] = {}

    def take(self, phase: Phase, position: int, unit: Unit) -> UnitGather:
        """The gather of ``unit`` for its call at ``position``: the prefetched one, or a
        new one (a prefetch of the wrong unit is completed and dropped)."""
        pending = self.pending.pop((phase, position), None)
        if pending is None or pending.unit is not unit:
            if pending is not None:
                pending.wait()  # a wrong guess: complete it and drop it
            pending = self.start(unit, phase, position)
        return pending

    def ahead(self, phase: Phase, position: int, order: Sequence[int] = ()) -> None:
        """Issue the gathers of the ``prefetch`` calls after ``position`` (forward: the
        guessed ones; backward: the calls before it in ``order``, the forward's)."""
        if phase is Phase.FORWARD:
            ahead = [(q, self.guess.unit_at(q))
                     for q in range(position + 1, position + 1 + self.plan.prefetch)]
        else:
            ahead = [(q, order[q])
                     for q in range(position - 1, position - 1 - self.plan.prefetch, -1) if q >= 0]
        for q, index in ahead:
            if index is not None and (phase, q) not in self.pending and not self.skip(index):
                self.pending[(phase, q)] = self.start(self.plan.units[index], phase, q)

    def drop(self) -> None:
        """Complete and forget every gather still in flight."""
        for pending in self.pending.values():
            pending.wait()
        self.pending.clear()
