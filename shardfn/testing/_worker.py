"""The processes of the local world: starting and stopping them, and one rank's loop.

Private to ``local_world``, which holds the API and the failure semantics.

A worker joins the gloo group (over loopback only), then runs the cloudpickled
``(fn, args, kwargs)`` requests it receives on its command pipe and answers
``(request_id, "ok", value, False)`` or ``(request_id, "err", RemoteFailure,
group_may_be_broken)``. A watchdog thread answers stack requests on a second
pipe, so the parent can say what a hung rank is doing, and counts the rank's
progress in shared memory (see :func:`_watchdog`); it also ends the process
when the parent goes away (and, on Linux, the kernel kills it when the parent
dies: ``PR_SET_PDEATHSIG``, for a world started from the main thread). A worker's
stderr goes to a file the parent reads (forwarding it, and quoting its tail when
the rank dies); Python's ``faulthandler`` writes the stacks of a crash to a
second file.

The workers are daemonic for the parent (multiprocessing terminates them at its
exit), but each clears its own daemon flag, so a rank may start processes of its
own (a ``DataLoader(num_workers=2)``, a nested local world); it kills and reaps
whatever it started before it exits.

The ranks meet through a ``TCPStore`` that rank 0 serves on loopback, whose port
they learn from a ``FileStore`` (see :mod:`shardfn.testing._process`).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import threading
import traceback
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from time import monotonic
from typing import Any, NamedTuple

import cloudpickle

from shardfn.testing import _process
from shardfn.testing._reports import RemoteFailure, error_summary

STOP = b"stop"
_STOP_WAIT_S = 5.0  # how long shutdown waits for a clean exit before killing
TICK_S = 0.25  # how often the watchdog samples progress (and the parent looks at it)
TAIL_LINES = 40  # lines of a dead rank's stderr quoted in the error
_TAIL_BYTES = 64 * 1024
_ID_BYTES = 8  # a request starts with its id, little-endian


# --- parent side: start, stop, and ship functions -------------------------------------


class Rank(NamedTuple):
    """The parent's handles on one worker."""

    process: BaseProcess
    cmd: Connection  # requests in, (request id, kind, value, broken) out
    watch: Connection  # stack requests in, (stack, collective in flight) out
    progress: Any  # a shared unsigned counter the watchdog bumps on each sign of progress
    stderr: StderrLog  # the worker's fd 2
    crash_path: str  # faulthandler's stacks of a fatal signal


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Start children without re-running the parent's ``__main__`` script.

    ``spawn`` children normally import the parent's main module (by path or by
    name) before running their target, so a script that opens a local world at
    top level, without an ``if __name__ == "__main__":`` guard, would open one in
    every child. The workers never need it: what they run arrives with cloudpickle,
    which sends ``__main__``'s functions and classes by value. So while the
    children start, ``__main__`` looks like an interactive session's (no
    ``__file__``, no ``__spec__``), as in a notebook.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__")
             if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def spawn(size: int, store_path: str, pg_timeout_s: float, check: bool,
          start_timeout_s: float | None = None) -> list[Rank]:
    """Start ``size`` worker processes (they join the gloo group on their own, waiting for
    each other up to ``start_timeout_s``, default ``pg_timeout_s``)."""
    with _main_not_reimported():
        return _spawn(size, store_path, pg_timeout_s, check, start_timeout_s)


def _spawn(size: int, store_path: str, pg_timeout_s: float, check: bool,
           start_timeout_s: float | None) -> list[Rank]:
    context = multiprocessing.get_context("spawn")
    # The kernel's parent-death signal follows the thread that forked the child: only a
    # world started from the main thread (which lives as long as the process) may use it.
    die_with_parent = threading.current_thread() is threading.main_thread()
    ranks = []
    for rank in range(size):
        cmd, child_cmd = context.Pipe()
        watch, child_watch = context.Pipe()
        progress = context.RawValue("Q", 0)
        prefix = f"{store_path}.rank{rank}"
        stderr_path, crash_path = f"{prefix}.stderr", f"{prefix}.crash"
        process = context.Process(
            target=main, name=f"shardfn-rank{rank}", daemon=True,
            args=(rank, size, store_path, pg_timeout_s, check, child_cmd, child_watch, progress,
                  stderr_path, crash_path, die_with_parent, start_timeout_s),
        )
        process.start()
        child_cmd.close()  # the parent keeps only its own ends, so EOF reaches each side
        child_watch.close()
        ranks.append(Rank(process, cmd, watch, progress, StderrLog(stderr_path, rank), crash_path))
    return ranks


def kill(ranks: list[Rank]) -> None:
    """SIGKILL and reap every process (no zombies), close the pipes, forward stderr left."""
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.kill()
    for rank in ranks:
        rank.process.join()
        rank.cmd.close()
        rank.watch.close()
        rank.stderr.forward(final=True)
        for path in (rank.stderr.path, rank.crash_path):
            with contextlib.suppress(OSError):
                os.remove(path)


def shutdown(ranks: list[Rank], tmpdir: str) -> None:
    """Ask the workers to exit, kill the ones that do not, remove the rendezvous files."""
    for rank in ranks:
        with contextlib.suppress(OSError):
            rank.cmd.send_bytes(STOP)
    deadline = monotonic() + _STOP_WAIT_S
    for rank in ranks:
        rank.process.join(max(0.0, deadline - monotonic()))
    kill(ranks)
    ranks.clear()
    shutil.rmtree(tmpdir, ignore_errors=True)


def request(request_id: int, payload: bytes) -> bytes:
    """Frame a pickled ``(fn, args, kwargs)`` with its id (the reply echoes it)."""
    return request_id.to_bytes(_ID_BYTES, "little") + payload


class StderrLog:
    """A worker's stderr file, read from the parent: forwarded line by line, and its tail.

    The worker writes straight to the file (its fd 2), so what a rank printed before a
    SIGABRT is in it even though the rank is gone.
    """

    def __init__(self, path: str, rank: int):
        self.path = path
        self.rank = rank
        self._offset = 0
        self._partial = b""

    def forward(self, final: bool = False) -> None:
        """Write the complete lines added since the last call to this process's stderr,
        each prefixed ``[rank r]`` (``final``: the incomplete last line too)."""
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except OSError:
            return
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = b"" if final else lines.pop()
        text = "".join(f"[rank {self.rank}] {line.decode(errors='replace')}\n"
                       for line in lines if line or not final)
        if text:
            with contextlib.suppress(Exception):  # a closed or odd sys.stderr must not fail a run
                sys.stderr.write(text)
                sys.stderr.flush()

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines of the file ("" if empty or unreadable)."""
        return read_tail(self.path, lines)


def read_tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of the file at ``path`` ("" if empty or unreadable)."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - _TAIL_BYTES))
            data = file.read()
    except OSError:
        return ""
    text = data.decode(errors="replace").rstrip("\n")
    return "\n".join(text.split("\n")[-lines:]) if text else ""


_CLOUDPICKLE_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _reduce_code(code: types.CodeType) -> tuple:
    # cloudpickle blanks the file name of functions it ships by value ("<dynamic-code>");
    # keep it, so tracebacks and stacks from the workers show file names and source lines.
    constructor, args = _CLOUDPICKLE_CODE_REDUCE(code)
    return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any) -> bytes:
    """cloudpickle ``obj``, keeping source file names of functions shipped by value."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


# --- worker side: one rank's loop and its watchdog -------------------------------------


def _optional(module: str, name: str) -> Callable | None:
    """Return ``module.name`` when it can be imported, else None (shardfn grows meanwhile)."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return None


def _send(conn: Connection, message: tuple) -> None:
    # cloudpickle bytes, not Connection.send: torch registers shared-memory reductions
    # for tensors with multiprocessing's pickler, and results must outlive the worker.
    conn.send_bytes(cloudpickle.dumps(message))


def _group_sequence(dist: Any) -> int:
    """Collectives issued on this rank's process groups so far (torch's sequence numbers)."""
    total = 0
    groups = _optional("shardfn._torch_internals", "process_groups")
    sequence_number = _optional("shardfn._torch_internals", "group_sequence_number")
    with contextlib.suppress(Exception):
        if groups and sequence_number and dist.is_initialized():
            for group in groups():
                with contextlib.suppress(Exception):
                    total += sequence_number(group)
    return total


def _progress_signature(main_thread_id: int, in_flight: Callable | None,
                        counters: list[Callable[[], int]]) -> tuple:
    """What changes while a rank makes progress: shardfn's and torch's collective counts,
    heartbeats, and where the main thread's Python code is (its innermost frame).

    Inside a shardfn collective (``in_flight()`` set) the frame is left out: a
    collective that polls in Python (check mode's exchange) is still one stuck call.
    """
    doing = in_flight() if in_flight is not None else None
    where = doing
    if doing is None:
        frame = sys._current_frames().get(main_thread_id)
        where = (id(frame), frame.f_lasti, frame.f_lineno) if frame is not None else None
        del frame
    return (where, *(counter() for counter in counters))


def _watchdog(conn: Connection, main_thread_id: int, in_flight: Callable | None,
              progress: Any, counters: list[Callable[[], int]]) -> None:
    """Answer each request with (main thread's stack, collective in flight); exit on EOF.

    Every ``TICK_S`` it also samples :func:`_progress_signature` and bumps the shared
    ``progress`` counter when it changed: the parent calls a run hung only when no
    unfinished rank's counter moved for the run's timeout. A rank blocked in one
    collective, or in one long C call (``time.sleep``), shows no progress.
    """
    last = None
    while True:
        try:
            asked = conn.poll(TICK_S)
            if asked:
                conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone: never linger as an orphan
        with contextlib.suppress(Exception):  # a sample must never kill the watchdog
            signature = _progress_signature(main_thread_id, in_flight, counters)
            if signature != last:
                last = signature
                progress.value += 1
        if not asked:
            continue
        frame = sys._current_frames().get(main_thread_id)
        stack = traceback.format_stack(frame) if frame else ["<no main thread frame>\n"]
        del frame
        ours = [i for i, line in enumerate(stack) if __file__ in line]  # drop spawn + loop frames
        stack = "".join(stack[ours[-1] + 1 :] if ours and ours[-1] + 1 < len(stack) else stack)
        try:
            doing = in_flight() if in_flight else "unknown (no shardfn.primitives.in_flight)"
            doing = doing or "none"
        except Exception as error:  # noqa: BLE001 - a report must not kill the watchdog
            doing = f"unknown (in_flight() raised {error!r})"
        _send(conn, (stack, doing))


_DIST_DIR = os.sep + os.path.join("torch", "distributed") + os.sep


def _distributed_error(error: BaseException, dist: Any) -> bool:
    """Whether ``error`` (or an exception it was raised from) came out of torch.distributed
    or gloo: a ``DistError``, a traceback through ``torch/distributed``, or gloo's message."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, getattr(dist, "DistError", ())) or "gloo" in str(error).lower():
            return True
        if any(_DIST_DIR in frame.f_code.co_filename
               for frame, _ in traceback.walk_tb(error.__traceback__)):
            return True
        error = error.__cause__ or error.__context__
    return False


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_PORT")


def main(
    rank: int, size: int, store_path: str, pg_timeout_s: float, check: bool,
    cmd: Connection, watch: Connection, progress: Any, stderr_path: str, crash_path: str,
    die_with_parent: bool = False, start_timeout_s: float | None = None,
) -> None:
    """Run rank ``rank`` of a ``size``-process world until told to stop or the parent exits."""
    if die_with_parent:
        _process.die_with_parent()
    _process.allow_children()
    crash_file = _process.redirect_stderr(stderr_path, crash_path)  # noqa: F841 - kept open
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Everything stays on this host: gloo's device on loopback (not whatever the host
    # name resolves to), and any env:// rendezvous fn might make on 127.0.0.1.
    os.environ["GLOO_SOCKET_IFNAME"] = _process.loopback_interface()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    # A local world started under torchrun must not look launched by it (sf.Mesh and
    # sf.distributed.initialize read these): this process's world is the local one.
    for name in _LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
        os.environ.pop(name)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    in_flight = _optional("shardfn.primitives.stats", "in_flight")
    reset_state = _optional("shardfn.mesh", "reset_state")
    set_check = _optional("shardfn.primitives.consistency", "check_consistency")
    reset_check = _optional("shardfn.primitives.consistency", "reset")  # call numbers per run
    failures = _optional("shardfn.primitives.stats", "collective_failures") or (lambda: 0)
    counters = [c for c in (_optional("shardfn.primitives.stats", "progress"),) if c]
    counters.append(lambda: _group_sequence(dist))
    threading.Thread(
        target=_watchdog, args=(watch, threading.get_ident(), in_flight, progress, counters),
        daemon=True, name="shardfn-watchdog",
    ).start()
    try:
        check_timeout = _optional("shardfn.primitives.consistency", "check_timeout")
        initial_timeout = check_timeout() if check_timeout is not None else None
        if set_check is not None:
            set_check(check)
        if size > 1:  # a world of one runs with no process group at all
            meet = timedelta(seconds=max(pg_timeout_s, start_timeout_s or 0.0))
            store = _process.rendezvous(dist, rank, size, store_path, meet)
            store.set_timeout(timedelta(seconds=pg_timeout_s))  # a get once started
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        _send(cmd, (0, "ready", None, False))
    except BaseException:
        _send(cmd, (0, "err", traceback.format_exc(), True))
        return
    while True:
        try:
            message = cmd.recv_bytes()
        except (EOFError, OSError):
            break
        if message == STOP:
            break
        request_id = int.from_bytes(message[:_ID_BYTES], "little")
        failed_before = failures()
        try:
            fn, args, kwargs = cloudpickle.loads(message[_ID_BYTES:])
            reply = (request_id, "ok", fn(*args, **kwargs), False)
        except BaseException as error:  # report everything, SystemExit included
            trace = error.__traceback__
            trace = trace.tb_next if trace is not None and trace.tb_next is not None else trace
            broken = failures() != failed_before or _distributed_error(error, dist)
            text = "".join(traceback.format_exception(type(error), error, trace))
            reply = (request_id, "err", RemoteFailure(text, error_summary(error)), broken)
            del error, trace
        try:
            if reset_state is not None:
                reset_state()
            if set_check is not None:  # a run may have changed the mode or its timeout
                set_check(check, timeout=initial_timeout)
            if reset_check is not None:
                reset_check()
            payload = cloudpickle.dumps(reply)
        except BaseException as error:  # e.g. a result that cannot be pickled
            failure = RemoteFailure(traceback.format_exc(), error_summary(error))
            payload = cloudpickle.dumps((request_id, "err", failure, False))
        del reply
        cmd.send_bytes(payload)
    _process.stop_children()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torch: nothing is left to clean up
