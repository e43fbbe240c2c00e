"""Check mode's waits on the key-value store (private to :mod:`~shardfn.primitives.consistency`).

A TCPStore's ``wait`` is woken by its server; a FileStore's sleeps 10 ms between
looks, so for a FileStore these poll ``check`` with a back-off from 20 µs instead.
"""

from __future__ import annotations

import json
from datetime import timedelta
from time import monotonic, sleep

import torch.distributed as dist

__all__ = ["polls_files", "read_fresh", "wait_keys"]


def polls_files(store: dist.Store) -> bool:
    """Whether ``store`` (under any ``PrefixStore``) is a FileStore (its ``wait`` sleeps 10 ms)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.FileStore)


def wait_keys(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Wait until every key is set; False after ``timeout_s``.

    A TCPStore (and other stores) ``wait``: the server wakes the waiter, nothing polls
    it, and a timed-out wait leaves the client usable (tested). A FileStore's ``wait``
    sleeps 10 ms between looks: poll ``check`` with a back-off from 20 µs instead.
    """
    if not polls_files(store):
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
            return True
        except (RuntimeError, dist.DistError):
            return store.check(keys)
    deadline = monotonic() + timeout_s
    pause = 2e-5
    while not store.check(keys):
        now = monotonic()
        if now > deadline:
            return False
        sleep(min(pause, deadline - now))
        pause = min(pause * 2, 2e-3)
    return True


def read_fresh(store: dist.Store, keys: list[str], deadline: float) -> list[dict] | None:
    """Every key's summary once all are posted and none is a call its rank gave up on
    (that rank's next call will replace it); None at the deadline."""
    pause = 2e-5
    while True:
        if not wait_keys(store, keys, max(0.0, deadline - monotonic())):
            return None
        summaries = [json.loads(v) for v in store.multi_get(keys)]
        if not any(other.get("gave_up") for other in summaries):
            return summaries
        if monotonic() > deadline:
            return None
        sleep(pause)
        pause = min(pause * 2, 2e-3)
