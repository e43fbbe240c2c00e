"""How a local-world rank process sets itself up and winds down (private to ``_worker``).

* :func:`rendezvous`: the ranks meet once through a ``FileStore`` in the world's
  temporary directory, only to learn the port of a ``TCPStore`` that rank 0 serves
  on loopback; the gloo group and check mode use that TCPStore. A FileStore only
  appends (a deleted key is one more record in its file), so check mode's traffic,
  a few hundred bytes per checked call, grew the file (and every rank's copy of
  its keys) without bound over a long run; a TCPStore frees a deleted key.
* :func:`allow_children` / :func:`stop_children`: a rank may start processes of its
  own (``DataLoader(num_workers=2)``, a nested local world) and kills and reaps
  them when it stops.
* :func:`die_with_parent`: on Linux the kernel kills a rank when its parent dies.
* :func:`redirect_stderr`, :func:`loopback_interface`.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import signal
import socket
import sys
from datetime import timedelta
from time import monotonic
from typing import Any

__all__ = ["allow_children", "die_with_parent", "loopback_interface", "redirect_stderr",
           "rendezvous", "stop_children"]

PORT_KEY = "shardfn/local_world/tcp_port"  # the one key the FileStore ever holds
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_CHILD_KILL_WAIT_S = 2.0  # how long a stopping rank waits for the processes it started


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            flags = f"/sys/class/net/{name}/flags"
            with contextlib.suppress(OSError, ValueError), open(flags) as file:
                if int(file.read(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
    return "lo0" if sys.platform == "darwin" else "lo"


def redirect_stderr(stderr_path: str, crash_path: str) -> Any:
    """Point fd 2 at ``stderr_path``; faulthandler's crash stacks go to ``crash_path``."""
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    crash_file = open(crash_path, "w")  # noqa: SIM115 - faulthandler keeps it for the process
    faulthandler.enable(file=crash_file, all_threads=True)
    return crash_file


def allow_children() -> None:
    """Let this rank start processes of its own (DataLoader workers, a nested local world).

    multiprocessing refuses children to a daemonic process ("daemonic processes are not
    allowed to have children"). The parent keeps the rank daemonic on its side (it
    terminates the ranks at its exit); the rank kills and reaps what it started when it
    stops (:func:`stop_children`), and its children notice its death on their own
    (DataLoader workers watch their parent; a nested world's ranks their pipes).
    """
    multiprocessing.current_process().daemon = False  # settable: not started from here


def die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when the parent dies (even when this
    process is blocked in C code with the GIL held, where the watchdog cannot run)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(0)


def stop_children() -> None:
    """Kill and reap every process this rank started and did not stop itself."""
    children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()
    deadline = monotonic() + _CHILD_KILL_WAIT_S
    for child in children:
        with contextlib.suppress(Exception):
            child.join(max(0.0, deadline - monotonic()))


def rendezvous(dist: Any, rank: int, size: int, store_path: str, timeout: timedelta) -> Any:
    """Meet through the FileStore at ``store_path``; return the TCPStore rank 0 serves.

    Rank 0 listens on a loopback socket of its own (port 0: the kernel picks a free
    one, so no two worlds race for a port; ``master_listen_fd`` keeps the store off
    other interfaces) and posts the port: the only key the FileStore ever holds.
    """
    file_store = dist.FileStore(store_path, size)
    file_store.set_timeout(timeout)
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach())
        file_store.set(PORT_KEY, str(port))
        return store
    port = int(file_store.get(PORT_KEY))
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
