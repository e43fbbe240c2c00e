"""Guards of a pipeline call: one call per model at a time, the same batch on every pp rank.

A pipelined step is a conversation between pp ranks: message ``k`` of one rank's
call meets message ``k`` of its peers' calls. Two things silently pair the wrong
messages, so both are refused before anything is sent:

* **Two threads calling one model at once** (:class:`CallGuard`). Their messages
  would interleave (losses swapped). The second call raises at once; the first
  raises too when it ends, because its peers may have let the *other* thread in
  first (paired with the other thread's batch): neither result can be trusted.
  Calls from one thread after another are fine. The guard is a Python lock taken
  by the eager entry points only (``value_and_grad``, ``apply``, ``gather``), which
  run point-to-point messages and cannot be traced; nothing inside a stage's
  forward or backward touches it.
* **Different batches on different pp ranks** (:func:`agree_on_batch`). Stage 0
  reads the inputs, the last stage the targets and both scale each micro-batch's
  loss by the rows: 8 rows on one rank and 6 on another gave one wrong loss. At
  every step's start the pp ranks all-gather three ints (rows of the inputs, rows
  of the targets, micro-batches) and every rank raises the same error, naming
  each rank's sizes. Cost: one 24-byte all-gather over the pp group per step
  (median 0.4 ms on gloo, 2 CPU ranks, on a 2-core machine at load 19; the pipeline
  benchmark's step takes some hundreds of ms). In check mode
  (``sf.check_consistency``) the ranks also compare the inputs and targets
  themselves (dtypes, shapes and a hash of their bytes, through check mode's store).

A third guard stops the others early when one stage fails (:class:`FailureFlag`):
the failing rank also posts its error in the process group's key-value store, and a
rank checks it before each action that receives nothing (stage 0's forwards, the last
stage's backwards, ``W``): a rank running GPipe's forwards stops after the failed
micro-batch, as FairScale does, instead of running them all before a receive tells
it. Cost: one ``store.check`` per such action (3 us median on the local world's
``FileStore``, 27 us under heavy load; a round trip on a ``TCPStore``). The key is
deleted once the failing rank has settled its messages, so the store does not grow.

Example:
    >>> guard = CallGuard()
    >>> with guard.hold("value_and_grad"):
    ...     ...
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardfn._torch_internals import c10d_functional, default_store
from shardfn.primitives import consistency
from shardfn.primitives._comm import Axis
from shardfn.transforms.pipeline._p2p import Messenger, PeerFailed
from shardfn.transforms.pipeline.values import describe

__all__ = ["CallGuard", "ConcurrentCallError", "FailureFlag", "agree_on_batch", "check_batch",
           "exclusive", "settle_and_raise"]

_CALLS: dict[tuple, itertools.count] = {}  # per pp group: its steps so far (same on every rank)


class ConcurrentCallError(RuntimeError):
    """Two threads used one pipeline model at the same time."""


class CallGuard:
    """One pipeline call per model at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: str | None = None
        self._contended = False

    @contextlib.contextmanager
    def hold(self, what: str) -> Iterator[None]:
        """Run ``what`` alone on this model, or raise :class:`ConcurrentCallError`."""
        if not self._lock.acquire(blocking=False):
            self._contended = True
            raise ConcurrentCallError(
                f"pipeline {what}: another thread is running {self._running} on this "
                "PipelineModel; its messages would mix with this call's and each pp rank may "
                "pair the calls differently. Call the model from one thread per rank (the "
                "same calls in the same order on every pp rank), or build one model per "
                "thread")
        self._running, self._contended = what, False
        try:
            yield
            if self._contended:
                raise ConcurrentCallError(
                    f"pipeline {what}: another thread called this PipelineModel while this "
                    "call ran; the pp ranks may have paired the two calls differently, so this "
                    "result is not trusted. Call the model from one thread per rank")
        finally:
            self._running = None
            self._lock.release()


class FailureFlag:
    """This step's "a rank failed" flag in the default store (see the module docstring).

    Args:
        ax: the pp axis (its group's ranks name the key, with the step's number).
    """

    def __init__(self, ax: Axis) -> None:
        count = _CALLS.setdefault(ax.ranks, itertools.count())
        self.key = f"shardfn/pipeline-failed/{'-'.join(map(str, ax.ranks))}/{next(count)}"
        self.store = default_store() if ax.size > 1 and dist.is_initialized() else None
        self.posted, self.rank = False, ax.index

    def raise_if_set(self) -> None:
        """Raise :class:`PeerFailed` with the failing rank's text if it posted one."""
        if self.store is not None and self.store.check([self.key]):
            raise PeerFailed(self.store.get(self.key).decode(errors="replace"))

    def post(self, text: str) -> None:
        if self.store is not None and not self.posted:
            self.store.set(self.key, f"pp rank {self.rank} failed during this pipeline call "
                                     f"(seen before its message arrived): {text}")
            self.posted = True

    def clear(self) -> None:
        """Delete the key this rank posted (its peers have all settled with it by then)."""
        if self.posted:
            self.store.delete_key(self.key)


def settle_and_raise(step_messenger: Messenger, owed, expected, error: BaseException,
                     where: str, flag: FailureFlag | None = None) -> None:
    """After ``error``: post the failure flag (if any), send error headers for what is
    owed, drain what is expected, then raise ``error`` with ``where`` as a note."""
    text = str(error) if isinstance(error, PeerFailed) else \
        f"{type(error).__name__}: {error} (in {where})"
    try:
        if flag is not None and not isinstance(error, PeerFailed):
            flag.post(text)
        step_messenger.settle(owed, expected, text)
        if flag is not None:
            flag.clear()
    finally:
        if hasattr(error, "add_note"):
            error.add_note(where)
    raise error


def exclusive(method: Callable) -> Callable:
    """Decorate a ``PipelineModel`` method: run it under ``self.call_guard`` (the model's
    guard, one per model object, kept in its :class:`~.caches.Caches`)."""
    @functools.wraps(method)
    def run(self, *args: Any, **kwargs: Any) -> Any:
        with self.call_guard.hold(method.__name__):
            return method(self, *args, **kwargs)
    return run


def _rows(value: Any) -> int:
    """Rows on dim 0, -1 for what has none (not a tensor, or a 0-d one), -2 for None."""
    if value is None:
        return -2
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else -1


def _text(rows: int) -> str:
    return {-2: "no targets", -1: "no batch dim"}.get(rows, f"{rows} rows")


def agree_on_batch(ax: Axis, inputs: Any, targets: Any, microbatches: int,
                   device: torch.device, what: str = "value_and_grad") -> None:
    """Raise on every pp rank unless all pass the same batch size, targets' rows and
    micro-batch count (a collective: every pp rank calls it before checking anything).

    Raises:
        ValueError: naming each pp rank's sizes.
    """
    if ax.size == 1:
        return
    mine = torch.tensor([_rows(inputs), _rows(targets), microbatches], dtype=torch.int64,
                        device=device)
    every = c10d_functional.wait_tensor(
        c10d_functional.all_gather_into_tensor(mine, ax.size, ax.group_name))
    found = [tuple(row) for row in every.view(ax.size, 3).tolist()]
    if len(set(found)) > 1:
        ranks = "; ".join(f"pp rank {r}: inputs {_text(i)}, targets {_text(t)}, {m} "
                          f"micro-batches" for r, (i, t, m) in enumerate(found))
        raise ValueError(f"pipeline {what}: the pp ranks were given different batches ({ranks});"
                         " every pp rank must pass the same inputs and targets (stage 0 reads "
                         "the inputs, the last stage the targets) with the same micro-batch "
                         "count")
    batch = {"inputs": inputs, "targets": targets}
    if consistency.enabled() and all(isinstance(v, torch.Tensor) for v in batch.values()
                                     if v is not None):
        consistency.check_replicated(f"pipeline {what} batch", ax, batch)


def check_batch(inputs: Any, targets: Any, microbatches: int, declared: bool) -> None:
    """Refuse a batch the step cannot split (on this rank).

    Raises:
        TypeError: inputs that are not one tensor with a batch dim.
        ValueError: fewer rows than micro-batches, targets of another batch size, or a
            batch that does not split evenly when shapes were declared.
    """
    m = microbatches
    if not isinstance(inputs, torch.Tensor) or inputs.dim() == 0:
        raise TypeError("pipeline inputs must be one tensor with a batch dim 0, got "
                        f"{type(inputs).__name__}")
    batch = inputs.shape[0]
    if batch < m:
        raise ValueError(f"pipeline: a batch of {batch} rows cannot be split into {m} "
                         "micro-batches (each needs at least one row)")
    if targets is not None and (not isinstance(targets, torch.Tensor)
                                or targets.dim() == 0 or targets.shape[0] != batch):
        raise ValueError(f"pipeline targets must be a tensor with the inputs' batch size "
                         f"{batch} on dim 0, got {describe(targets)}")
    if declared and batch % m:
        raise ValueError(f"pipeline: shapes= declares one shape per micro-batch, so the "
                         f"batch ({batch} rows) must split evenly into {m} micro-batches")
