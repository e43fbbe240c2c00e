"""Guards of a pipeline call: one call per model at a time, the same batch on every pp rank.

(Also what every call checks first: not under a torch.func transform, and the leaves
given are this rank's: :func:`refuse_transforms`, :func:`check_leaves`.)

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
  every step's start the pp ranks all-gather five ints (rows of the inputs, rows
  of the targets, micro-batches, and a digest of each side's structure, per-leaf
  rows and plain values: :mod:`.batch`) and every rank raises the same error,
  naming each rank's sizes. Cost: one 40-byte all-gather over the pp group per step
  (median 0.4 ms on gloo for the earlier 24-byte form, 2 CPU ranks, on a 2-core
  machine at load 19; the pipeline benchmark's step takes some hundreds of ms). In
  check mode (``sf.check_consistency``) the ranks also compare the inputs and targets
  themselves, every leaf of them (dtypes, shapes and a hash of their bytes, through
  check mode's store).

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardfn._torch_internals import c10d_functional, default_store, get_interpreter_stack
from shardfn.primitives import consistency
from shardfn.primitives._comm import Axis
from shardfn.transforms.pipeline._p2p import Messenger, PeerFailed
from shardfn.transforms.pipeline.batch import batch_digest, batch_rows

__all__ = ["CallGuard", "ConcurrentCallError", "FailureFlag", "agree_on_batch", "check_leaves",
           "exclusive", "refuse_transforms", "settle_and_raise"]

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


def refuse_transforms(what: str) -> None:
    """Raise when called under a torch.func transform (a whole pipelined call cannot run
    there: it has its own autograd and messages between ranks)."""
    if get_interpreter_stack():
        raise RuntimeError(f"pipeline {what} runs a whole pipelined step with its own autograd "
                           "and messages between ranks; it cannot run under torch.func "
                           "transforms (grad, vmap, ...): call it directly")


def check_leaves(params: Any, names: Sequence[str], layout: Mapping[str, int], rank: int,
                 subset: bool = False) -> None:
    """Refuse a call's leaves that are not this pp rank's (all of them, or some: ``subset``).

    Args:
        params: what the call was given.
        names: this rank's leaves.
        layout: every leaf of the full model -> the pp rank holding it (for the message).
        rank: this pp rank.
        subset: any part of this rank's leaves will do.

    Raises:
        TypeError: not a mapping. ValueError: missing or unexpected names (naming the pp
            rank holding each unexpected one).
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"pipeline params must be a dict of this rank's leaves, got "
                        f"{type(params).__name__}")
    mine = set(names)
    missing = [] if subset else [n for n in names if n not in params]
    unexpected = sorted(n for n in params if n not in mine)
    if missing or unexpected:
        others = [f"{n} (pp rank {layout[n]})" for n in unexpected if n in layout]
        raise ValueError(f"pipeline params on pp rank {rank}: missing {missing}, "
                         f"unexpected {unexpected}" +
                         (f"; held by other ranks: {others}" if others else "") +
                         ("; pass some of this rank's leaves" if subset else
                          "; pass this rank's leaves (pp.init(seed))"))


def _text(rows: int) -> str:
    return {-2: "no targets", -1: "no batch dim"}.get(rows, f"{rows} rows")


def agree_on_batch(ax: Axis, inputs: Any, targets: Any, microbatches: int,
                   device: torch.device, what: str = "value_and_grad") -> None:
    """Raise on every pp rank unless all pass the same batch size, targets' rows,
    micro-batch count and batch structure (a collective: every pp rank calls it before
    checking anything).

    The structure is a digest of the inputs' and targets' pytree, every tensor leaf's rows
    and every plain value (:func:`~.batch.batch_digest`), so a rank passing ``(x, mask)``
    where another passes ``(x,)`` raises too; in check mode every leaf's values are
    compared as well.

    Raises:
        ValueError: naming each pp rank's sizes, or the ranks whose structures differ.
    """
    if ax.size == 1:
        return
    mine = torch.tensor([batch_rows(inputs), batch_rows(targets), microbatches,
                         batch_digest(inputs), batch_digest(targets)], dtype=torch.int64,
                        device=device)
    every = c10d_functional.wait_tensor(
        c10d_functional.all_gather_into_tensor(mine, ax.size, ax.group_name))
    found = [tuple(row) for row in every.view(ax.size, 5).tolist()]
    tail = ("; every pp rank must pass the same inputs and targets (stage 0 reads the inputs, "
            "the last stage the targets) with the same micro-batch count")
    if len({row[:3] for row in found}) > 1:
        ranks = "; ".join(f"pp rank {r}: inputs {_text(i)}, targets {_text(t)}, {m} "
                          f"micro-batches" for r, (i, t, m, _, _) in enumerate(found))
        raise ValueError(f"pipeline {what}: the pp ranks were given different batches "
                         f"({ranks})" + tail)
    if len({row[3:] for row in found}) > 1:
        groups: dict[tuple, list[int]] = {}
        for r, row in enumerate(found):
            groups.setdefault(row[3:], []).append(r)
        ranks = " vs ".join(f"pp ranks {g}" for g in groups.values())
        raise ValueError(f"pipeline {what}: the pp ranks were given different batches: the "
                         f"same rows, but inputs or targets of another structure, other rows "
                         f"in some tensor, or other plain values ({ranks})" + tail)
    kinds = (torch.Tensor, tuple, list, dict, type(None))
    if consistency.enabled() and isinstance(inputs, kinds) and isinstance(targets, kinds):
        consistency.check_replicated(f"pipeline {what} batch", ax,
                                     {"inputs": inputs, "targets": targets})
