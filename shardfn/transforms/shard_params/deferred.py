"""Deferred gradient reductions: a unit call's reduce-scatter overlaps the next backward.

Backward runs the unit calls in reverse. The reduce-scatter a call issues at the end
of its backward is not waited there: the call *before* it in forward order (whose
backward runs next) takes that unit's shards as extra inputs of its ``UnitFn``, so
its backward can wait for the reduction and return those gradients. At most one
reduction is in flight while a unit computes; the root waits for the first call's
and for any nobody claimed.

Which shards a call takes is decided when the root's graph is built. Under a
recompute (``remat``) the whole order is known; in a forward that records the
graph (``remat=None``) the next call has not run yet, so the call *offers* to
claim the reduction of the guessed next unit (:class:`PrefetchGuess`). After the
forward, :meth:`DeferredReductions.settle` compares every offer with the call
that really came next: where they differ, that call waits for its own reduction
and returns its own gradients, and the wrong offer yields no gradient. So a guess
moves only the waiting, never a gradient.

Example:
    >>> deferred = DeferredReductions()
    >>> later = deferred.offer(position, names_of_next_unit)   # forward
    >>> later_grads = deferred.claim(position)                  # backward of `position`
    >>> own = deferred.defer(position, reduction)               # {} unless it waits itself
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from shardfn.transforms.shard_params.exchange import Reduction

__all__ = ["DeferredReductions"]

Params = dict[str, torch.Tensor]


class DeferredReductions:
    """The reductions of one ``apply``'s backward that a later-running call waits for."""

    def __init__(self) -> None:
        self.offered: dict[int, tuple[str, ...]] = {}  # position -> shards its UnitFn takes
        self.in_flight: dict[int, Reduction] = {}  # position -> its reduction, unclaimed
        self.self_waiting: set[int] = set()  # positions nobody claims: they wait themselves

    def offer(self, position: int, names: tuple[str, ...]) -> tuple[str, ...]:
        """Call ``position`` takes the shards ``names`` (the next call's) as extra inputs."""
        self.offered[position] = names
        return names

    def settle(self, next_names: Sequence[tuple[str, ...]]) -> None:
        """After a forward that offered on a guess: ``next_names[p]`` is what call ``p + 1``
        really owns; a call whose predecessor offered anything else waits for itself."""
        for position, actual in enumerate(next_names):
            if self.offered.get(position) != actual:
                self.self_waiting.add(position + 1)

    def claim(self, position: int) -> Params:
        """In the backward of call ``position``: the next call's shard gradients (its
        reduction, issued just before, finished now), or {} if there is none to claim."""
        if not self.offered[position]:
            return {}
        pending = self.in_flight.pop(position + 1, None)
        if pending is not None:
            return pending.wait()
        self.self_waiting.add(position + 1)  # its backward has not run (a branch)
        return {}

    def defer(self, position: int, reduction: Reduction) -> Params:
        """Leave call ``position``'s reduction for the call before it; or, when nobody
        claims it, wait for it now. Returns the gradients to return now ({} if deferred)."""
        if position in self.self_waiting:
            return reduction.wait()
        self.in_flight[position] = reduction
        return {}

    def wait_unclaimed(self) -> Iterator[Params]:
        """For the root: the first call's reduction and any left unclaimed, finished."""
        for pending in self.in_flight.values():
            yield pending.wait()
        self.in_flight.clear()
