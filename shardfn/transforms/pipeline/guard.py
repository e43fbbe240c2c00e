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
  every step's start the pp ranks all-gather nine ints (rows of the inputs, rows
  of the targets, micro-batches, and per side a digest of its structure, per-leaf
  rows and plain values, one of its shapes and dtypes, and in check mode one of its
  values: :mod:`.batch`) and every rank raises the same error, naming each rank's
  sizes. A side is compared among the ranks that pass it: a rank that does not read
  it (no stage 0 for the inputs, no last stage for the targets) may pass None, and a
  rank that reads it may not. Cost: one 72-byte all-gather over the pp group per step
  (median 0.4 ms on gloo for the earlier 24-byte form, 2 CPU ranks, on a 2-core
  machine at load 19; the pipeline benchmark's step takes some hundreds of ms). In
  check mode (``sf.check_consistency``) the ranks also compare the inputs and targets
  themselves: every leaf of them through check mode's store when every rank passes
  both (dtypes, shapes and a hash of their bytes), else each side's hash among the
  ranks that pass it.

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
import hashlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardfn import pytree as pt
from shardfn._torch_internals import c10d_functional, default_store, get_interpreter_stack
from shardfn.primitives import consistency
from shardfn.primitives._comm import Axis
from shardfn.primitives._fingerprint import leaf_hash
from shardfn.transforms.pipeline._p2p import Messenger, PeerFailed
from shardfn.transforms.pipeline.batch import (
    READS_ALL,
    StageReads,
    batch_digest,
    batch_rows,
    shape_digest,
)

if TYPE_CHECKING:
    from shardfn.transforms.pipeline.step_plan import StepPlan

__all__ = ["CallGuard", "ConcurrentCallError", "FailureFlag", "agree_on_batch", "agree_on_step",
           "check_leaves", "exclusive", "plan_reads", "refuse_transforms", "settle_and_raise"]

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


def _text(rows: int, side: str) -> str:
    return {-2: f"no {side}", -1: "no batch dim"}.get(rows, f"{rows} rows")


def _value_digest(tree: Any) -> int:
    """A 63-bit hash of every leaf's bytes (check mode's comparison of one side)."""
    if tree is None:
        return 0
    h = hashlib.blake2b(digest_size=8)
    for leaf in pt.tree_leaves(tree):
        h.update(leaf_hash(leaf).encode())
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFFFFFFFFFF


def _groups(found: list[tuple], ranks: list[int], column: int) -> str | None:
    """``"pp ranks [0] vs pp ranks [1]"`` when ``ranks`` disagree on ``column``, else None."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(found[r][column], []).append(r)
    return " vs ".join(f"pp ranks {g}" for g in groups.values()) if len(groups) > 1 else None


def _missing(found: list[tuple], reads: Sequence[StageReads], n_stages: int) -> list[str]:
    """Why each pp rank that reads a side it was given None of is wrong."""
    any_targets = any(row[1] != -2 for row in found)
    last = f"stage {n_stages - 1}, the last," if n_stages else "the last stage,"
    errors = []
    for r, (row, read) in enumerate(zip(found, reads, strict=True)):
        if read.inputs and row[0] == -2:
            errors.append(f"pp rank {r} holds stage 0, which reads the inputs, but was given "
                          "inputs=None")
        if read.targets and row[1] == -2 and any_targets:
            errors.append(f"pp rank {r} holds {last} which reads the targets, but was given "
                          "targets=None while other pp ranks passed targets")
        elif read.targets and row[1] == -2 and row[0] == -2:
            errors.append(f"pp rank {r} holds {last} but was given neither inputs nor targets "
                          "(with targets=None on every rank, for a loss_fn that takes none, "
                          "it needs the inputs for the micro-batches' sizes)")
    return errors


def plan_reads(plan: StepPlan, targets: bool = True) -> list[StageReads]:
    """Per pp rank, what it reads of a batch: the inputs if it holds stage 0, the targets if
    it holds the last stage (``targets=False``: inference, no targets read at all).

    Example:
        >>> plan_reads(pp.plan)                        # 1F1B over 2 ranks
        [StageReads(inputs=True, targets=False), StageReads(inputs=False, targets=True)]
    """
    schedule, last = plan.schedule, plan.n_stages - 1
    return [StageReads(schedule.rank_of(0) == r, targets and schedule.rank_of(last) == r)
            for r in range(schedule.n_ranks)]


def agree_on_step(plan: StepPlan, inputs: Any, targets: Any, what: str
                  ) -> tuple[int, int] | None:
    """:func:`agree_on_batch` over ``plan``'s pp axis, with what each pp rank reads
    (:func:`plan_reads`; ``what="apply"``, inference: no targets).

    Example:
        >>> agreed = agree_on_step(pp.plan, x if pp.reads.inputs else None, None, "apply")
    """
    reads = plan_reads(plan, targets=what != "apply")
    return agree_on_batch(plan.ax, inputs, targets, plan.schedule.n_microbatches, plan.device,
                          what, reads, plan.n_stages)


def agree_on_batch(ax: Axis, inputs: Any, targets: Any, microbatches: int,
                   device: torch.device, what: str = "value_and_grad",
                   reads: Sequence[StageReads] | None = None, n_stages: int = 0
                   ) -> tuple[int, int] | None:
    """Raise on every pp rank unless the ranks that pass a side of the batch pass the same
    one and every rank the same micro-batch count (a collective: every pp rank calls it
    before checking anything, and every rank raises the same error).

    A side is compared among the pp ranks that pass it (not None): its rows, a digest of
    its pytree with every tensor leaf's rows and every plain value
    (:func:`~.batch.batch_digest`; a rank passing ``(x, mask)`` where another passes
    ``(x,)`` raises too), and of its leaves' shapes and dtypes
    (:func:`~.batch.shape_digest`); in check mode every leaf's values as well. A rank
    that reads a side (``reads``: it holds stage 0, or the last stage) must pass it; the
    others may pass None. The targets may be None on every rank (a ``loss_fn`` that takes
    none), as before.

    Args:
        ax: the pp axis.
        inputs, targets: this rank's batch (None for a side it does not read).
        microbatches: the micro-batch count.
        device: where the all-gather's tensor lives.
        what: the call, for messages.
        reads: per pp rank, what it reads; None: every rank reads both.
        n_stages: the stage count (to name the last stage in messages).

    Returns:
        The shape digests of the inputs and the targets agreed by the ranks that pass
        them (-2 for a side no rank passes), the same on every pp rank: what inferred
        shapes are cached under; None when a side has no signature (nothing cached).

    Raises:
        ValueError: naming each pp rank's sizes, the ranks whose structures or shapes
            differ, or a rank that reads a side it was given None of (naming the rank and
            its stage). ConsistencyError (check mode): values that differ.
    """
    reads = [READS_ALL] * ax.size if reads is None else list(reads)
    check = consistency.enabled() and ax.size > 1
    mine = [batch_rows(inputs), batch_rows(targets), microbatches, batch_digest(inputs),
            batch_digest(targets), shape_digest(inputs), shape_digest(targets),
            _value_digest(inputs) if check else 0, _value_digest(targets) if check else 0]
    if ax.size == 1:
        found = [tuple(mine)]
    else:
        every = c10d_functional.wait_tensor(c10d_functional.all_gather_into_tensor(
            torch.tensor(mine, dtype=torch.int64, device=device), ax.size, ax.group_name))
        found = [tuple(row) for row in every.view(ax.size, len(mine)).tolist()]
    tail = ("; the pp ranks must pass the same inputs and targets (stage 0 reads the inputs, "
            "the last stage the targets; a rank that reads neither side may pass None for "
            "it) with the same micro-batch count")
    missing = _missing(found, reads, n_stages)
    if missing:
        raise ValueError(f"pipeline {what}: " + "; ".join(missing) + tail)
    given = [[r for r, row in enumerate(found) if row[side] != -2] for side in (0, 1)]
    rows = [{found[r][side] for r in given[side]} for side in (0, 1)]
    if len(rows[0]) > 1 or len(rows[1]) > 1 or len({row[2] for row in found}) > 1 or (
            rows[0] and rows[1] and rows[0] != rows[1] and
            not set(given[0]) & set(given[1])):  # no rank has both to check them against
        ranks = "; ".join(f"pp rank {r}: inputs {_text(i, 'inputs')}, targets "
                          f"{_text(t, 'targets')}, {m} micro-batches"
                          for r, (i, t, m, *_) in enumerate(found))
        raise ValueError(f"pipeline {what}: the pp ranks were given different batches "
                         f"({ranks})" + tail)
    for side, name in enumerate(("inputs", "targets")):
        ranks = _groups(found, given[side], 3 + side)
        if ranks:
            raise ValueError(f"pipeline {what}: the pp ranks were given different batches: "
                             f"the same rows, but {name} of another structure, other rows "
                             f"in some tensor, or other plain values ({ranks})" + tail)
        ranks = _groups(found, given[side], 5 + side)
        if ranks:
            raise ValueError(f"pipeline {what}: the pp ranks were given different batches: "
                             f"the same rows and structure, but {name} of other shapes or "
                             f"dtypes ({ranks})" + tail)
    if check:
        _check_values(ax, found, given, inputs, targets, what)
    digests = [found[g[0]][5 + side] if g else -2 for side, g in enumerate(given)]
    return None if -1 in digests else (digests[0], digests[1])


def _check_values(ax: Axis, found: list[tuple], given: list[list[int]], inputs: Any,
                  targets: Any, what: str) -> None:
    """Check mode: the values of each side the same on every pp rank that passes it."""
    kinds = (torch.Tensor, tuple, list, dict, type(None))
    if len(given[0]) == len(given[1]) == ax.size:  # every rank passes both: per leaf
        if isinstance(inputs, kinds) and isinstance(targets, kinds):
            consistency.check_replicated(f"pipeline {what} batch", ax,
                                         {"inputs": inputs, "targets": targets})
        return
    for side, name in enumerate(("inputs", "targets")):
        ranks = _groups(found, given[side], 7 + side)
        if ranks:
            raise consistency.ConsistencyError(
                f"pipeline {what} batch: the values of the {name} differ between the pp "
                f"ranks that pass them ({ranks}); each rank must read the same samples "
                "(check mode compares them)")
