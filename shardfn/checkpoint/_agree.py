"""Every rank learns whether every rank succeeded: no rank is left waiting in a collective.

Each phase of a save or load runs its local work inside :func:`local`, then all
ranks meet in :func:`agree` (one ``all_gather_object`` on the checkpoint group)
and either all go on, or all raise the same :class:`CheckpointError` naming
each rank that failed and why.

Example:
    >>> with local() as outcome:
    ...     outcome.payload = work()
    >>> payloads = agree(group, outcome)
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardfn.checkpoint import errors
from shardfn.checkpoint.errors import CheckpointError

__all__ = ["Outcome", "agree", "local"]


class Outcome:
    """What one rank's phase produced: a payload, or the error it raised."""

    def __init__(self) -> None:
        self.payload: Any = None
        self.error: BaseException | None = None


@contextlib.contextmanager
def local() -> Iterator[Outcome]:
    """Run a phase's local work, keeping (not raising) its exception."""
    outcome = Outcome()
    try:
        yield outcome
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - given to every rank
        outcome.error = err
        outcome.trace = traceback.format_exc(limit=4)


def agree(group, outcome: Outcome, what: str) -> list[Any]:
    """Every rank's payload (rank order), or the same error raised on every rank.

    A single process re-raises its own error unchanged.
    """
    if group is None:
        if isinstance(outcome.error, CheckpointException):  # a BaseException: wrap it
            raise CheckpointError(f"{what} failed: {outcome.error}") from outcome.error
        if outcome.error is not None:
            raise outcome.error
        return [outcome.payload]
    error = outcome.error
    mine = (dist.get_rank(), None if error is None else
            (type(error).__name__, f"{type(error).__name__}: {error}"), outcome.payload)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [(rank, error) for rank, error, _ in everyone if error is not None]
    if failed:
        text = "; ".join(f"rank {rank}: {error[1]}" for rank, error in failed)
        cls = getattr(errors, failed[0][1][0], CheckpointError)
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            cls = CheckpointError
        raise cls(f"{what} failed: {text}") from outcome.error
    return [payload for _, _, payload in everyone]
