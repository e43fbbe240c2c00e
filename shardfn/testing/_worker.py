"""The processes of the local world: starting and stopping them, and one rank's loop.

Private to ``local_world``, which holds the API and the failure semantics.

A worker joins the gloo group, then runs the cloudpickled ``(fn, args, kwargs)``
messages it receives on its command pipe and answers ``("ok", value)`` or
``("err", traceback_text)``. A watchdog thread answers stack requests on a
second pipe, so the parent can say what a hung rank is doing; it also ends the
process when the parent goes away.
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
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from time import monotonic
from typing import Any, NamedTuple

import cloudpickle

STOP = b"stop"
_STOP_WAIT_S = 5.0  # how long shutdown waits for a clean exit before killing


# --- parent side: start, stop, and ship functions -------------------------------------


class Rank(NamedTuple):
    """The parent's handles on one worker."""

    process: BaseProcess
    cmd: Connection  # functions in, ("ok", value) / ("err", traceback) out
    watch: Connection  # stack requests in, (stack, collective in flight) out


def spawn(size: int, store_path: str, pg_timeout_s: float) -> list[Rank]:
    """Start ``size`` worker processes (they join the gloo group on their own)."""
    context = multiprocessing.get_context("spawn")
    ranks = []
    for rank in range(size):
        cmd, child_cmd = context.Pipe()
        watch, child_watch = context.Pipe()
        process = context.Process(
            target=main, name=f"shardfn-rank{rank}", daemon=True,
            args=(rank, size, store_path, pg_timeout_s, child_cmd, child_watch),
        )
        process.start()
        child_cmd.close()  # the parent keeps only its own ends, so EOF reaches each side
        child_watch.close()
        ranks.append(Rank(process, cmd, watch))
    return ranks


def kill(ranks: list[Rank]) -> None:
    """SIGKILL and reap every process (no zombies), close the pipes."""
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.kill()
    for rank in ranks:
        rank.process.join()
        rank.cmd.close()
        rank.watch.close()


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


def _watchdog(conn: Connection, main_thread_id: int, in_flight: Callable | None) -> None:
    """Answer each request with (main thread's stack, collective in flight); exit on EOF."""
    while True:
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone: never linger as an orphan
        frame = sys._current_frames().get(main_thread_id)
        stack = traceback.format_stack(frame) if frame else ["<no main thread frame>\n"]
        ours = [i for i, line in enumerate(stack) if __file__ in line]  # drop spawn + loop frames
        stack = "".join(stack[ours[-1] + 1 :] if ours and ours[-1] + 1 < len(stack) else stack)
        try:
            doing = in_flight() if in_flight else "unknown (no shardfn.primitives.in_flight)"
            doing = doing or "none"
        except Exception as error:  # noqa: BLE001 - a report must not kill the watchdog
            doing = f"unknown (in_flight() raised {error!r})"
        _send(conn, (stack, doing))


def main(
    rank: int, size: int, store_path: str, pg_timeout_s: float, cmd: Connection, watch: Connection
) -> None:
    """Run rank ``rank`` of a ``size``-process world until told to stop or the parent exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    in_flight = _optional("shardfn.primitives", "in_flight")
    reset_state = _optional("shardfn.mesh", "reset_state")
    threading.Thread(
        target=_watchdog, args=(watch, threading.get_ident(), in_flight), daemon=True
    ).start()
    try:
        if size > 1:  # a world of one runs with no process group at all
            store = dist.FileStore(store_path, size)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        _send(cmd, ("ready", None))
    except BaseException:
        _send(cmd, ("err", traceback.format_exc()))
        return
    while True:
        try:
            message = cmd.recv_bytes()
        except (EOFError, OSError):
            break
        if message == STOP:
            break
        try:
            fn, args, kwargs = cloudpickle.loads(message)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as error:  # report everything, SystemExit included
            trace = error.__traceback__
            trace = trace.tb_next if trace is not None and trace.tb_next is not None else trace
            reply = ("err", "".join(traceback.format_exception(type(error), error, trace)))
        try:
            if reset_state is not None:
                reset_state()
            payload = cloudpickle.dumps(reply)
        except BaseException:
            payload = cloudpickle.dumps(("err", traceback.format_exc()))
        cmd.send_bytes(payload)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's slow teardown of torch: nothing is left to clean up
