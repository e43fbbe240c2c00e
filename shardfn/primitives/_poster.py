"""Post point-to-point operations from a background thread, in submission order.

On gloo, posting a send or a receive takes the connection's lock, which the
transport's own thread holds while it moves a message on that connection: a
post made while a large message is in flight (a reduce-scatter issued one
unit earlier, say) stalls the caller for the rest of that transfer, several
milliseconds of the compute thread. Handing the posts to one background thread
keeps the caller computing; the posts still happen in the order they were
submitted, which is what matches the ranks' messages to each other.

The thread is started on first use, one per process, as a daemon. It releases
nothing on its own: every submission must be waited on (:meth:`Posting.wait`),
which re-raises an error the posting raised.

Example:
    >>> posting = submit([dist.P2POp(dist.isend, t, peer)])
    >>> for work in posting.wait():
    ...     work.wait()
"""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist

__all__ = ["Posting", "submit"]


class Posting:
    """One submitted batch of ``P2POp`` s: :meth:`wait` returns their works once posted."""

    def __init__(self, ops: list) -> None:
        self.ops = ops
        self.works: list = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def wait(self) -> list:
        """Block until the batch is posted; its works (``None`` entries dropped), handed
        over: the posting keeps no reference to them (nor to their tensors)."""
        self.done.wait()
        works, self.works, self.ops = self.works, [], []
        if self.error is not None:
            raise self.error
        return works


_QUEUE: queue.SimpleQueue[Posting] = queue.SimpleQueue()
_THREAD: list[threading.Thread] = []
_LOCK = threading.Lock()


def submit(ops: list) -> Posting:
    """Queue ``ops`` (``dist.P2POp`` s) to be posted by the background thread."""
    posting = Posting(ops)
    with _LOCK:
        if not _THREAD or not _THREAD[0].is_alive():
            _THREAD[:] = [threading.Thread(target=_run, name="shardfn-p2p-poster",
                                           daemon=True)]
            _THREAD[0].start()
    _QUEUE.put(posting)
    return posting


def _run() -> None:
    while True:
        posting = _QUEUE.get()
        try:
            posting.works = [w for w in dist.batch_isend_irecv(posting.ops) if w is not None]
        except BaseException as error:  # handed to the waiter  # noqa: BLE001
            posting.error = error
        done = posting.done
        del posting  # hold none of its tensors once the waiter runs, nor until the next one
        done.set()
