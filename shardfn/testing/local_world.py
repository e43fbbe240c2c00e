"""A persistent world of N local CPU processes joined in a gloo group.

Spawning processes per test case is far too slow for property tests, so a
``LocalWorld`` starts N workers once and then runs any number of functions on
all of them: ``world.run(fn, *args)`` ships ``fn`` with cloudpickle (lambdas and
closures from a notebook or a test module work), calls it on every rank with
``torch.distributed`` initialised, and returns the per-rank results.

Failures never leave the world unusable: an exception on a rank raises
``RankError`` with the remote traceback; a rank that hangs or dies raises
``WorldTimeout`` with each unfinished rank's Python stack and collective in
flight. Whenever a rank may still be stuck (in a collective waiting for a failed
peer, sleeping, dead), the world is killed and respawned before the error is
raised, so the next ``run`` starts clean. See docs/local_world.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import textwrap
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from time import monotonic
from typing import Any

import cloudpickle

from shardfn.testing import _worker

_STARTUP_MIN_S = 60.0  # spawning N torch processes on a busy 2-core machine takes seconds
_STACK_WAIT_S = 2.0  # how long to wait for the watchdogs' stack reports


class RankError(RuntimeError):
    """A function run on the local world failed on ``rank``.

    Attributes:
        rank: the rank at fault (the first to fail).
        remote_traceback: that rank's traceback (or Python stack) as text.
    """

    def __init__(self, rank: int, remote_traceback: str, message: str | None = None):
        super().__init__(message or f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return type(self), (self.rank, self.remote_traceback, str(self))


class WorldTimeout(RankError, TimeoutError):
    """Some ranks did not finish: they hung past the timeout or died.

    ``rank`` is the first such rank, ``remote_traceback`` its Python stack (empty
    for a dead rank) and ``ranks`` all of them; the message describes each.
    """

    def __init__(self, rank: int, remote_traceback: str, message: str | None = None,
                 ranks: tuple[int, ...] = ()):
        super().__init__(rank, remote_traceback, message)
        self.ranks = ranks or (rank,)

    def __reduce__(self):
        return type(self), (self.rank, self.remote_traceback, str(self), self.ranks)


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-exitcode).name}"
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _indent(text: str) -> str:
    return textwrap.indent(text.rstrip(), "    ")


class LocalWorld:
    """A pool of ``size`` CPU processes in a gloo group, started once and reused.

    Args:
        size: number of ranks (1 runs in one worker process with no process group).
        timeout: default seconds a ``run`` may take; the gloo group's own timeout is
            set ``10`` seconds above it.
        grace: seconds the other ranks get to finish after one rank fails before the
            world is presumed stuck and restarted.

    Example:
        >>> world = LocalWorld(2)
        >>> world.run(lambda: torch.distributed.get_rank())
        [0, 1]
        >>> world.close()
    """

    def __init__(self, size: int, *, timeout: float = 120.0, grace: float = 2.0):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"LocalWorld size must be an int >= 1, got {size!r}")
        self.size = size
        self.timeout = float(timeout)
        self.grace = float(grace)
        self._tmpdir = tempfile.mkdtemp(prefix="shardfn-world-")
        self._generation = 0
        self._ranks: list[_worker.Rank] = []  # mutated in place: the finalizer holds the same list
        self._ready = False
        self._finalizer = weakref.finalize(self, _worker.shutdown, self._ranks, self._tmpdir)
        self._respawn()
        self._await_ready()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank and return the results by rank.

        Args:
            fn: any function cloudpickle can ship; inside it ``torch.distributed`` is
                initialised (gloo, this world's size, rank = list index) unless size is 1.
            *args, **kwargs: arguments, pickled and sent to every rank.
            timeout: seconds before unfinished ranks count as hung (default: the world's).

        Returns:
            ``[result_of_rank_0, ..., result_of_rank_{size-1}]``.

        Raises:
            RankError: ``fn`` raised on a rank (message has the rank and its traceback).
            WorldTimeout: a rank hung past ``timeout`` or died; names each such rank
                with its Python stack and the collective in flight.

        Example:
            >>> world.run(lambda x: x + torch.distributed.get_rank(), 10)
            [10, 11]
        """
        if not self._finalizer.alive:
            raise RuntimeError("this LocalWorld is closed")
        timeout = self.timeout if timeout is None else float(timeout)
        self._await_ready()
        payload = _worker.dumps((fn, args, kwargs))
        try:
            for rank in self._ranks:
                rank.cmd.send_bytes(payload)
            replies, pending = self._collect(monotonic() + timeout, self.grace)
        except BaseException:  # Ctrl-C or a test timeout mid-run: the ranks are mid-fn
            self._respawn()
            raise
        if all(replies.get(rank, ("",))[0] == "ok" for rank in range(self.size)):
            return [replies[rank][1] for rank in range(self.size)]
        raise self._failure(getattr(fn, "__qualname__", repr(fn)), timeout, replies, pending)

    def close(self) -> None:
        """Stop the workers (cleanly, else by SIGKILL) and reap them; idempotent."""
        self._finalizer()

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._finalizer.alive else "closed"
        return f"LocalWorld(size={self.size}, timeout={self.timeout:g}, {state})"

    def _respawn(self) -> None:
        """Kill the current processes (if any) and start a fresh generation."""
        _worker.kill(self._ranks)
        self._generation += 1
        store_path = os.path.join(self._tmpdir, f"store{self._generation}")
        self._ranks[:] = _worker.spawn(self.size, store_path, self.timeout + 10.0)
        self._ready = False

    def _await_ready(self) -> None:
        """Wait until every rank has joined the group; respawn first if one has died."""
        if self._ready and all(rank.process.is_alive() for rank in self._ranks):
            return
        if self._ready:
            self._respawn()
        replies, pending = self._collect(monotonic() + max(self.timeout, _STARTUP_MIN_S), 0.0)
        failed = {r: reply for r, reply in replies.items() if reply[0] != "ready"}
        if failed or pending:
            reports = [f"rank {r} had not joined the group yet" for r in pending] + [
                f"rank {r} raised:\n{_indent(value)}" if kind == "err"
                else f"rank {r} died ({_exit_text(value)})" for r, (kind, value) in failed.items()
            ]
            self.close()
            raise RuntimeError("LocalWorld failed to start; it is now closed.\n"
                               + "\n".join(reports))
        self._ready = True

    def _collect(self, deadline: float, grace: float) -> tuple[dict[int, tuple], list[int]]:
        """Wait for one reply per rank until ``deadline`` (or ``grace`` after a failure).

        Returns the replies by rank in arrival order (``("dead", exitcode)`` for a
        rank whose process ended) and the ranks that never answered.
        """
        replies: dict[int, tuple] = {}
        waiting = {}
        for index, rank in enumerate(self._ranks):
            waiting[rank.cmd] = waiting[rank.process.sentinel] = index
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - monotonic()))
            if not ready:
                break
            for index in dict.fromkeys(waiting[obj] for obj in ready):
                rank = self._ranks[index]
                try:
                    reply = cloudpickle.loads(rank.cmd.recv_bytes()) if rank.cmd.poll() else None
                except (EOFError, OSError):
                    reply = None
                if reply is None:
                    rank.process.join(1.0)
                    reply = ("dead", rank.process.exitcode)
                replies[index] = reply
                if reply[0] in ("err", "dead"):
                    deadline = min(deadline, monotonic() + grace)
            waiting = {obj: index for obj, index in waiting.items() if index not in replies}
        return replies, [index for index in range(self.size) if index not in replies]

    def _stacks(self, ranks: list[int]) -> dict[int, tuple[str, str | None]]:
        """Ask the watchdogs of ``ranks`` for (Python stack, collective in flight)."""
        asked = {}
        for index in ranks:
            with contextlib.suppress(OSError):
                self._ranks[index].watch.send_bytes(b"stack")
                asked[self._ranks[index].watch] = index
        reports = {}
        deadline = monotonic() + _STACK_WAIT_S
        while asked and monotonic() < deadline:
            for conn in wait(list(asked), timeout=max(0.0, deadline - monotonic())):
                with contextlib.suppress(EOFError, OSError):
                    reports[asked[conn]] = cloudpickle.loads(conn.recv_bytes())
                del asked[conn]
        return {r: reports.get(r, ("<the watchdog did not answer>\n", "unknown")) for r in ranks}

    def _failure(self, name: str, timeout: float, replies: dict[int, tuple],
                 pending: list[int]) -> RankError:
        """Build the error for a failed run, restarting the world if a rank may be stuck."""
        stacks = self._stacks(pending)
        errors = [r for r, (kind, _) in replies.items() if kind == "err"]
        dead = [r for r, (kind, _) in replies.items() if kind == "dead"]
        lines = []
        for r in range(self.size):
            kind, value = replies.get(r, ("pending", None))
            if kind == "err":
                lines.append(f"rank {r} raised:\n{_indent(value)}")
            elif kind == "dead":
                lines.append(f"rank {r} is dead ({_exit_text(value)})")
            elif kind == "pending":
                stack, doing = stacks[r]
                lines.append(f"rank {r} did not finish; collective in flight: {doing}; "
                             f"Python stack:\n{_indent(stack)}")
        if dead or pending:
            self._respawn()
            lines.append("(the world was restarted: the next run starts on fresh processes)")
        details = "\n".join(lines)
        if errors and not dead:
            first = errors[0]
            return RankError(first, replies[first][1], f"{name} raised on rank {first}\n{details}")
        first = sorted(dead)[0] if dead else pending[0]  # a death is the likelier root cause
        why = (f"rank(s) {sorted(dead)} died while running {name}" if dead
               else f"rank(s) {pending} did not finish {name} within {timeout:g}s")
        stack = stacks[first][0] if first in stacks else ""
        return WorldTimeout(first, stack, f"{why}\n{details}", tuple(sorted(dead + pending)))


@contextlib.contextmanager
def local_world(size: int, *, timeout: float = 120.0, grace: float = 2.0) -> Iterator[LocalWorld]:
    """Start a ``LocalWorld`` of ``size`` processes for a ``with`` block, closing it on exit.

    Example:
        >>> with local_world(4) as world:
        ...     world.run(lambda: torch.distributed.get_world_size())
        [4, 4, 4, 4]
    """
    world = LocalWorld(size, timeout=timeout, grace=grace)
    try:
        yield world
    finally:
        world.close()
