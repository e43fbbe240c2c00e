"""A persistent world of N local CPU processes joined in a gloo group.

Spawning processes per test case is far too slow for property tests, so a
``LocalWorld`` starts N workers once and then runs any number of functions on
all of them: ``world.run(fn, *args)`` ships ``fn`` with cloudpickle (lambdas and
closures from a notebook or a test module work), calls it on every rank with
``torch.distributed`` initialised, and returns the per-rank results.

Failures never leave the world unusable: an exception on a rank raises
``RankError`` with the remote traceback; a rank that hangs (makes no progress
for ``timeout`` seconds) or dies raises ``WorldTimeout`` with each unfinished
rank's Python stack and collective in flight, and a dead rank's exit signal and
stderr tail. Whenever the process group may be stuck or broken (a rank still
blocked, dead, or an error that came out of a collective), the world is killed
and respawned before the error is raised, so the next ``run`` starts clean.
Concurrent ``run`` calls from several threads are serialized. See
docs/local_world.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from time import monotonic
from typing import Any

import cloudpickle

from shardfn.testing import _worker
from shardfn.testing._reports import dead_report as _dead_report
from shardfn.testing._reports import indent as _indent
from shardfn.testing._reports import seconds as _seconds

DEFAULT_START_TIMEOUT_S = 300.0  # spawning N torch processes on a busy 2-core machine: minutes
_START_ATTEMPTS = 2  # a start that fails is retried once on fresh processes
_STACK_WAIT_S = 2.0  # how long to wait for the watchdogs' stack reports
_PG_TIMEOUT_MARGIN_S = 10.0  # the gloo group's timeout is the world's timeout + this
_CHECK_OFF = ("", "0", "false", "no", "off")  # as shardfn.primitives.consistency reads it


class RankError(RuntimeError):
    """A function run on the local world failed on ``rank``.

    The message's first line says who raised what where: ``<the function's qualified
    name> raised <ExceptionType>: <last line of its message> on rank <r>``; every rank's
    report (tracebacks, stacks) follows.

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
    """Some ranks did not finish: they made no progress for the timeout, or died.

    ``rank`` is the first such rank, ``remote_traceback`` its Python stack (empty
    for a dead rank) and ``ranks`` all of them; the message describes each.
    """

    def __init__(self, rank: int, remote_traceback: str, message: str | None = None,
                 ranks: tuple[int, ...] = ()):
        super().__init__(rank, remote_traceback, message)
        self.ranks = ranks or (rank,)

    def __reduce__(self):
        return type(self), (self.rank, self.remote_traceback, str(self), self.ranks)


class LocalWorld:
    """A pool of ``size`` CPU processes in a gloo group, started once and reused.

    Args:
        size: number of ranks, an int >= 1 (1 runs in one worker with no process group).
        timeout: default seconds a ``run`` may go **without progress** before it counts
            as hung (progress: a collective started or finished, ``heartbeat()``, a
            change of the Python stack, on any unfinished rank). A long run that keeps
            making progress is never killed by it.
        deadline: default total seconds a ``run`` may take (None: no total limit).
        grace: seconds the other ranks get to finish after one rank fails before the
            world is presumed stuck and restarted.
        pg_timeout: the gloo group's own timeout for one collective (default
            ``timeout + 10``).
        check: check mode (``shardfn.check_consistency``) in the workers; None: on,
            unless the environment has ``SHARDFN_CHECK=0``. Restored after every run.
        start_timeout: seconds the ranks get to start and join the group (at creation and
            at each restart), independent of ``timeout``. A start that fails (a rank
            raised, died, or had not joined in time) is retried once on fresh processes;
            if the retry fails too, the world is closed and the error describes both
            attempts rank by rank.

    Raises:
        TypeError / ValueError: for a size that is not an int >= 1, or a duration that
            is not a finite number > 0.
        RuntimeError: when the world failed to start twice.

    Example:
        >>> world = LocalWorld(2)
        >>> world.run(lambda: torch.distributed.get_rank())
        [0, 1]
        >>> world.close()
    """

    def __init__(self, size: int, *, timeout: float = 120.0, deadline: float | None = None,
                 grace: float = 2.0, pg_timeout: float | None = None,
                 check: bool | None = None, start_timeout: float = DEFAULT_START_TIMEOUT_S):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"LocalWorld size must be an int >= 1, got {size!r}")
        if size < 1:
            raise ValueError(f"LocalWorld size must be an int >= 1, got {size!r}")
        if check is not None and not isinstance(check, bool):
            raise TypeError(f"LocalWorld check must be True, False or None, got {check!r}")
        self.size = int(size)
        self.timeout = _seconds("LocalWorld timeout", timeout)
        self.deadline = _seconds("LocalWorld deadline", deadline, none_ok=True)
        self.grace = _seconds("LocalWorld grace", grace, zero_ok=True)
        self.start_timeout = _seconds("LocalWorld start_timeout", start_timeout)
        self.pg_timeout = (self.timeout + _PG_TIMEOUT_MARGIN_S if pg_timeout is None
                           else _seconds("LocalWorld pg_timeout", pg_timeout))
        if check is None:
            check = os.environ.get("SHARDFN_CHECK", "1").strip().lower() not in _CHECK_OFF
        self.check = check
        self._lock = threading.Lock()  # one run at a time: replies are read off shared pipes
        self._request_id = 0
        self._tmpdir = tempfile.mkdtemp(prefix="shardfn-world-")
        self._generation = 0
        self._ranks: list[_worker.Rank] = []  # mutated in place: the finalizer holds the same list
        self._ready = False
        self._last_progress: list[float] = []  # per rank, monotonic time, during a run
        self._finalizer = weakref.finalize(self, _worker.shutdown, self._ranks, self._tmpdir)
        self._respawn()
        self._await_ready()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            deadline: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank and return the results by rank.

        Safe to call from several threads: the calls run one after the other.

        Args:
            fn: any function cloudpickle can ship; inside it ``torch.distributed`` is
                initialised (gloo, this world's size, rank = list index) unless size is 1.
            *args, **kwargs: arguments, pickled and sent to every rank (``timeout`` and
                ``deadline`` are this method's own).
            timeout: seconds without progress on every unfinished rank before the run
                counts as hung (default: the world's); a finite number > 0.
            deadline: total seconds the run may take (default: the world's, None = no
                total limit); a finite number > 0.

        Returns:
            ``[result_of_rank_0, ..., result_of_rank_{size-1}]``.

        Raises:
            TypeError / ValueError: for a timeout or deadline that is not a finite
                number of seconds > 0.
            RankError: ``fn`` raised on a rank (message has the rank and its traceback).
            WorldTimeout: the ranks made no progress for ``timeout``, ran past
                ``deadline``, or a rank died; names each such rank with its Python stack
                and the collective in flight, or its exit signal and stderr tail.

        Example:
            >>> world.run(lambda x: x + torch.distributed.get_rank(), 10)
            [10, 11]
        """
        timeout = self.timeout if timeout is None else _seconds("run timeout", timeout)
        deadline = self.deadline if deadline is None else _seconds("run deadline", deadline)
        payload = _worker.dumps((fn, args, kwargs))
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError("this LocalWorld is closed (by close(), or after it failed "
                                   "to start twice); make a new one")
            self._await_ready()
            self._request_id += 1
            message = _worker.request(self._request_id, payload)
            try:
                for rank in self._ranks:
                    rank.cmd.send_bytes(message)
                replies, pending, why = self._collect(self._request_id, timeout, deadline,
                                                      self.grace)
            except BaseException:  # Ctrl-C or a test timeout mid-run: the ranks are mid-fn
                self._respawn()
                raise
            if all(replies.get(rank, ("",))[0] == "ok" for rank in range(self.size)):
                return [replies[rank][1] for rank in range(self.size)]
            raise self._failure(_function_name(fn), why, (timeout, deadline), replies,
                                pending)

    def close(self) -> None:
        """Stop the workers (cleanly, else by SIGKILL) and reap them; idempotent.

        Waits for a ``run`` in progress in another thread to end first.
        """
        with self._lock:
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
        self._ranks[:] = _worker.spawn(self.size, store_path, self.pg_timeout, self.check,
                                       start_timeout_s=self.start_timeout)
        self._ready = False

    def _await_ready(self) -> None:
        """Wait until every rank has joined the group; respawn first if one has died.

        A failed start is retried once on fresh processes; after a second failure the
        world is closed and the error describes each attempt rank by rank.
        """
        if self._ready and all(rank.process.is_alive() for rank in self._ranks):
            return
        if self._ready:
            self._respawn()
        reports = []
        for attempt in range(_START_ATTEMPTS):
            if attempt:
                self._respawn()
            report = self._start_report()
            if report is None:
                self._ready = True
                return
            reports.append(f"attempt {attempt + 1}:\n{_indent(report)}")
        self._finalizer()
        raise RuntimeError(
            f"LocalWorld({self.size}) failed to start {_START_ATTEMPTS} times (each attempt "
            f"had start_timeout={self.start_timeout:g}s for every rank to join the group); it "
            "is now closed.\n" + "\n".join(reports) + "\nIf the machine is only busy, give "
            "the start more time: LocalWorld(size, start_timeout=...).")

    def _start_report(self) -> str | None:
        """Wait for this generation's ranks to join; None if all did, else each rank's state."""
        started = monotonic()
        replies, pending, _ = self._collect(0, None, self.start_timeout, 0.0)
        if not pending and all(reply[0] == "ready" for reply in replies.values()):
            return None
        waited = monotonic() - started
        stacks = self._stacks([r for r in pending if self._ranks[r].process.is_alive()])
        lines = []
        for r in range(self.size):
            kind, value, _ = replies.get(r, ("pending", None, True))
            if kind == "ready":
                lines.append(f"rank {r} joined the group")
            elif kind == "err":
                lines.append(f"rank {r} raised while starting:\n{_indent(value)}")
            elif kind == "dead" or not self._ranks[r].process.is_alive():
                lines.append(self._dead(r, value if kind == "dead" else
                                        self._ranks[r].process.exitcode))
            else:
                lines.append(f"rank {r} had not joined the group after {waited:.1f}s (alive); "
                             f"Python stack:\n{_indent(stacks[r][0])}")
        return "\n".join(lines)

    def _collect(self, request_id: int, stall: float | None, total: float | None,
                 grace: float) -> tuple[dict[int, tuple], list[int], str]:
        """Wait for one reply per rank to request ``request_id``.

        Stops when every rank answered, when no unfinished rank made progress for
        ``stall`` seconds, after ``total`` seconds, or ``grace`` seconds after a rank
        failed. Returns the replies by rank in arrival order as ``(kind, value, broken)``
        (``("dead", exitcode, True)`` for a rank whose process ended), the ranks that
        never answered, and why the wait stopped (``"done"``, ``"stall"``, ``"deadline"``
        or ``"grace"``).
        """
        start = monotonic()
        limit = start + total if total is not None else math.inf
        why = "deadline"
        counts = [rank.progress.value for rank in self._ranks]
        self._last_progress = [start] * self.size
        replies: dict[int, tuple] = {}
        waiting = {}
        for index, rank in enumerate(self._ranks):
            waiting[rank.cmd] = waiting[rank.process.sentinel] = index
        while waiting:
            now = monotonic()
            unfinished = [self._last_progress[i] for i in range(self.size) if i not in replies]
            stalled_at = max(unfinished) + stall if stall is not None else math.inf
            if now >= min(limit, stalled_at):
                why = why if now >= limit else "stall"
                break
            ready = wait(list(waiting), timeout=min(limit, stalled_at, now + _worker.TICK_S) - now)
            for index in dict.fromkeys(waiting[obj] for obj in ready):
                rank = self._ranks[index]
                try:
                    reply = cloudpickle.loads(rank.cmd.recv_bytes()) if rank.cmd.poll() else None
                except (EOFError, OSError):
                    reply = None
                if reply is None:
                    rank.process.join(1.0)
                    reply = (request_id, "dead", rank.process.exitcode, True)
                if reply[0] != request_id:
                    continue  # a stale reply (never expected: stuck runs respawn)
                replies[index] = reply[1:]
                if reply[1] in ("err", "dead") and monotonic() + grace < limit:
                    limit, why = monotonic() + grace, "grace"
            waiting = {obj: index for obj, index in waiting.items() if index not in replies}
            now = monotonic()
            for index, rank in enumerate(self._ranks):
                rank.stderr.forward()
                if index not in replies and rank.progress.value != counts[index]:
                    counts[index] = rank.progress.value
                    self._last_progress[index] = now
        else:
            why = "done"
        return replies, [index for index in range(self.size) if index not in replies], why

    def _dead(self, index: int, exitcode: int | None) -> str:
        rank = self._ranks[index]
        rank.stderr.forward(final=True)
        return _dead_report(index, exitcode, rank.stderr.tail(),
                            _worker.read_tail(rank.crash_path))

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

    def _failure(self, name: str, why: str, limits: tuple[float, float | None],
                 replies: dict[int, tuple], pending: list[int]) -> RankError:
        """Build the error for a failed run, restarting the world if the group may be broken.

        Restarts when a rank is dead or still running (stuck, or blocked on a failed
        peer), or when a rank's error came out of a collective or torch.distributed
        (a gloo timeout, a closed connection): the group may be out of step or closed.
        A plain exception raised outside any collective keeps the processes.
        """
        now = monotonic()
        stacks = self._stacks(pending)
        errors = [r for r, (kind, _, _) in replies.items() if kind == "err"]
        dead = [r for r, (kind, _, _) in replies.items() if kind == "dead"]
        broken = [r for r in errors if replies[r][2]]
        lines = []
        for r in range(self.size):
            kind, value, _ = replies.get(r, ("pending", None, True))
            if kind == "err":
                lines.append(f"rank {r} raised:\n{_indent(value.traceback)}")
            elif kind == "dead":
                lines.append(self._dead(r, value))
            elif kind == "pending":
                stack, doing = stacks[r]
                idle = now - self._last_progress[r]
                lines.append(f"rank {r} did not finish (no progress for {idle:.1f}s); "
                             f"collective in flight: {doing}; Python stack:\n{_indent(stack)}")
        if dead or pending or broken:
            self._respawn()
            cause = (f"rank(s) {broken} failed in a collective or torch.distributed, so the "
                     "process group may be broken" if broken and not (dead or pending)
                     else "ranks were dead or still running")
            lines.append(f"(the world was restarted: {cause}; the next run starts on fresh "
                         "processes)")
        details = "\n".join(lines)
        if errors and not dead:
            first = errors[0]
            failure = replies[first][1]
            return RankError(first, failure.traceback,
                             f"{name} raised {failure.summary} on rank {first}\n{details}")
        first = sorted(dead)[0] if dead else pending[0]  # a death is the likelier root cause
        if dead:
            head = f"rank(s) {sorted(dead)} died while running {name}"
        elif why == "stall":
            head = (f"rank(s) {pending} did not finish {name}: no progress on any of them "
                    f"for the run timeout of {limits[0]:g}s")
        else:
            head = (f"rank(s) {pending} did not finish {name} within the run deadline of "
                    f"{limits[1]:g}s")
        stack = stacks[first][0] if first in stacks else ""
        return WorldTimeout(first, stack, f"{head}\n{details}", tuple(sorted(dead + pending)))


def _function_name(fn: Any) -> str:
    """How an error names the function a run ran: its qualified name (a partial's function's)."""
    inner = fn.func if isinstance(fn, functools.partial) and not hasattr(fn, "__qualname__") else fn
    name = getattr(inner, "__qualname__", None)
    return name if isinstance(name, str) else f"<{type(inner).__qualname__} object>"


def local_world(size: int, *, timeout: float = 120.0, deadline: float | None = None,
                grace: float = 2.0, pg_timeout: float | None = None,
                check: bool | None = None,
                start_timeout: float = DEFAULT_START_TIMEOUT_S) -> LocalWorld:
    """Start a ``LocalWorld`` of ``size`` processes now: use it in a ``with`` block or keep it.

    Takes the arguments of :class:`LocalWorld` and returns one, which is its own context
    manager: ``with local_world(n) as world:`` closes it when the block ends, while
    ``world = local_world(n)`` (a notebook) keeps it open until ``world.close()``, until
    the object is garbage-collected (the name rebound, e.g. by running the cell again),
    or at interpreter exit, whichever comes first. Either way no process outlives it.

    Returns:
        A started :class:`LocalWorld`.

    Example:
        >>> with local_world(4) as world:
        ...     world.run(lambda: torch.distributed.get_world_size())
        [4, 4, 4, 4]
        >>> world = local_world(2)          # a notebook: one world for many cells
        >>> world.run(lambda: torch.distributed.get_rank())
        [0, 1]
        >>> world.close()
    """
    return LocalWorld(size, timeout=timeout, deadline=deadline, grace=grace,
                      pg_timeout=pg_timeout, check=check, start_timeout=start_timeout)
