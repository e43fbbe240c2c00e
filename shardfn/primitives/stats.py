"""Communication counters: bytes each collective moved, per mesh axis.

Every shardfn collective records, on the rank that runs it, the bytes *this rank
sends* under the bandwidth-optimal (ring) algorithm, the figure the ZeRO paper
counts with. For ``N`` ranks on the axis and a tensor of ``B`` bytes:

=================  =====================================
collective         bytes sent per rank
=================  =====================================
psum / pmean       ``2 B (N-1)/N``  (reduce-scatter + all-gather)
all_gather         ``B_out (N-1)/N`` (``B_out`` = gathered size)
psum_scatter       ``B_in (N-1)/N``  (``B_in`` = input size)
all_to_all         ``B (N-1)/N``
broadcast          ``B (N-1)/N``     (pipelined)
ppermute           ``B`` if this rank sends, else 0
=================  =====================================

Counts are kept per axis key (``"dp"``, or ``"dp+tp"`` for a tuple of axes) and
per collective name; backward passes count too, since they communicate.
Collectives inside code compiled by ``torch.compile`` are not counted (a
warning says so once, when the step is traced).

Example:
    >>> reset_comm_stats()
    >>> comm_stats().total_bytes
    0
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Iterator

from shardfn.primitives import _compiled
from shardfn.primitives._group_errors import translate

__all__ = [
    "CommStats",
    "collective_failures",
    "comm_stats",
    "counting",
    "heartbeat",
    "in_flight",
    "progress",
    "record",
    "reset_comm_stats",
]


@dataclasses.dataclass(frozen=True)
class CommStats:
    """A snapshot of the counters.

    Attributes:
        bytes: ``{axis key: bytes sent by this rank}``.
        calls: ``{axis key: number of collectives}``.
        by_op: ``{(axis key, op name): bytes}``.
        calls_by_op: ``{op name: number of collectives}``.
    """

    bytes: dict[str, int]
    calls: dict[str, int]
    by_op: dict[tuple[str, str], int]
    calls_by_op: dict[str, int]

    @property
    def total_bytes(self) -> int:
        """Bytes sent over all axes."""
        return sum(self.bytes.values())

    @property
    def total_calls(self) -> int:
        """Collectives issued over all axes."""
        return sum(self.calls.values())

    def op_bytes(self, op: str) -> int:
        """Bytes sent by collectives named ``op`` over all axes."""
        return sum(b for (_, name), b in self.by_op.items() if name == op)

    def op_calls(self, op: str) -> int:
        """Number of collectives named ``op`` over all axes."""
        return self.calls_by_op.get(op, 0)


_BYTES: dict[str, int] = defaultdict(int)
_CALLS: dict[str, int] = defaultdict(int)
_BY_OP: dict[tuple[str, str], int] = defaultdict(int)
_OP_CALLS: dict[str, int] = defaultdict(int)
_IN_FLIGHT: list[str] = []
# Progress events (collectives issued, entered and left; heartbeats), never reset:
# the local world's watchdog tells a slow run from a hung one by this count moving.
_PROGRESS: list[int] = [0]
_FAILURES: list[int] = [0]  # collective scopes left by an exception


def counting() -> bool:
    """Whether collectives issued here are counted: False inside code that
    ``torch.compile`` traces (warned once; see :mod:`shardfn.primitives._compiled`).

    Example:
        >>> if counting():
        ...     record("dp", "psum", 1024)
    """
    if _compiled.tracing():
        _compiled.skipped("comm_stats")
        return False
    return True


def record(axis_key: str, op: str, nbytes: float) -> None:
    """Add one collective of ``nbytes`` sent bytes on ``axis_key`` to the counters (not in
    code that ``torch.compile`` traces: see :func:`counting`)."""
    if not counting():
        return
    nbytes = int(round(nbytes))
    _BYTES[axis_key] += nbytes
    _CALLS[axis_key] += 1
    _BY_OP[(axis_key, op)] += nbytes
    _OP_CALLS[op] += 1
    _PROGRESS[0] += 1


def comm_stats() -> CommStats:
    """A snapshot of the bytes and calls recorded since the last reset.

    Returns:
        A :class:`CommStats`.

    Example:
        >>> comm_stats().bytes.get("dp", 0) >= 0
        True
    """
    return CommStats(dict(_BYTES), dict(_CALLS), dict(_BY_OP), dict(_OP_CALLS))


def reset_comm_stats() -> None:
    """Zero every counter."""
    for table in (_BYTES, _CALLS, _BY_OP, _OP_CALLS):
        table.clear()


@contextlib.contextmanager
def collective_scope(description: str) -> Iterator[None]:
    """Mark ``description`` as the collective in flight on this rank (for hang reports).

    Entering and leaving the scope each count as progress (see :func:`progress`); an
    exception leaving it counts in :func:`collective_failures`.
    """
    _IN_FLIGHT.append(description)
    _PROGRESS[0] += 1
    try:
        yield
    except BaseException as error:
        _FAILURES[0] += 1
        clear = translate(error, description)  # a destroyed or departed group: say so
        if clear is not None:
            raise clear from error
        raise
    finally:
        _IN_FLIGHT.pop()
        _PROGRESS[0] += 1


def in_flight() -> str | None:
    """The collective this rank is blocked in, or None (read by the local world's watchdog)."""
    return _IN_FLIGHT[-1] if _IN_FLIGHT else None


def heartbeat() -> None:
    """Count one unit of progress: call it in long loops that run no shardfn collective.

    The local world (``shardfn.testing``) declares a run hung when no rank has made
    progress for the run's ``timeout``; collectives count on their own, and so does a
    change of the Python stack, so only a loop of long C calls (``time.sleep``, one huge
    op) with no collective needs this.

    Example:
        >>> for step in range(10_000):
        ...     time.sleep(1.0)   # waiting on something outside torch.distributed
        ...     heartbeat()
    """
    _PROGRESS[0] += 1


def progress() -> int:
    """Progress events on this rank so far: collectives recorded, entered and left, heartbeats.

    Returns:
        A count that only grows (``reset_comm_stats`` leaves it alone).

    Example:
        >>> before = progress(); heartbeat(); progress() - before
        1
    """
    return _PROGRESS[0]


def collective_failures() -> int:
    """Collectives on this rank so far that an exception interrupted (a timeout, a dead peer).

    The local world respawns its processes after a run in which this grew: the
    process group may be out of step or closed.

    Returns:
        A count that only grows.
    """
    return _FAILURES[0]
