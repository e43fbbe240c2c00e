"""What one `shard_params` ``apply`` call knows: its configuration, what its forward
did, and what changes while it runs.

An ``apply`` call (``call.ApplyCall``) is made of:

* :class:`CallConfig` (frozen): what the call was asked to do, fixed when it is made;
* :class:`CallInputs` (frozen): the shards its forward was given, and the replicated
  leaves and buffers put on the compute device;
* :class:`ForwardRecord` (sealed when the root's forward ends): what the forward did,
  for the backward: the unit order, one :class:`CallRecord` per unit call and the
  root's :class:`RootRecord`. While the forward runs it builds a
  :class:`ForwardState` (the order, records and buffers so far);
* :class:`Progress`: what changes in backward (the phase, the leaves a gradient is
  wanted for, the full parameters kept for it) and the :class:`RootRun` of the root's
  module while it runs (in forward, or recomputed in backward).

The backward frees what it has used by replacing a record with the one
:func:`spent` returns, so each unit's graph is freed as soon as its backward ran.

Example:
    >>> state.records.append(CallRecord(outputs, versions, spec, before, after))  # forward
    >>> call.forward = state.seal(root_record)                # the root's forward ended
    >>> records = call.forward.records
    >>> records[position] = spent(records[position])           # its backward ran
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from shardfn.primitives.autocast_state import AutocastState
from shardfn.transforms.recording import RngState
from shardfn.transforms.shard_params.accumulator import Accumulator
from shardfn.transforms.shard_params.exchange import UnitGather
from shardfn.transforms.shard_params.plan import Plan
from shardfn.transforms.shard_params.prefetch import Phase, PrefetchGuess
from shardfn.transforms.shard_params.tree import TreeSpec
from shardfn.transforms.shard_params.unit_modes import UnitRecorder, UnitReplayer

__all__ = ["CallConfig", "CallInputs", "CallRecord", "ForwardRecord", "ForwardState",
           "Progress", "RootRecord", "RootRun", "joined", "spent"]

Params = dict[str, torch.Tensor]


class CallConfig(NamedTuple):
    """What one ``apply`` call was asked to do (fixed when it is made).

    Attributes:
        plan: the model's plan, for the dtypes of the shards given.
        guess: the model's guess of the unit order (updated after the forward).
        arg_spec: the call's arguments with their tensors taken out.
        arg_wants: per tensor argument, whether a gradient may be asked for it (the
            root's graph is recorded in forward, before backward says which need one).
        keep: keep the full parameters for backward (``reshard_after_forward=False``).
        record: a backward may follow (grad mode): save what it needs.
        mutable: also return the buffers as the forward left them.
        accumulator: the active ``reduce_once`` accumulator of the model (add full
            gradients to it instead of reducing), or None.
        autocast: the forward's autocast state, for a recompute in backward (None when
            nothing is recomputed).
        keep_root: keep the root's full parameters for backward
            (``reshard_after_forward="units"``, or ``keep``).
    """

    plan: Plan
    guess: PrefetchGuess
    arg_spec: TreeSpec
    arg_wants: tuple[bool, ...]
    keep: bool
    record: bool
    mutable: bool
    accumulator: Accumulator | None
    autocast: AutocastState | None
    keep_root: bool = False

    def replay_autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast state, for a recompute (as ``torch.utils.checkpoint``)."""
        return self.autocast.replay() if self.autocast is not None else contextlib.nullcontext()


class CallInputs(NamedTuple):
    """The leaves one call's forward was given.

    Attributes:
        shards: plain local shards and buffers, by leaf name (as ``RootFn.forward`` got them).
        local: replicated and ignored leaves and buffers on the compute device, cast.
    """

    shards: Params
    local: Params


class CallRecord(NamedTuple):
    """What one unit call in forward leaves for its backward."""

    outputs: tuple[torch.Tensor, ...]  # its output tensors, handed back by UnitFn.forward
    versions: tuple[int, ...]  # their version counters, to catch in-place changes
    spec: TreeSpec
    rng_before: RngState
    rng_after: RngState
    replay: dict | None = None  # the remat policy's saved op outputs inside the unit
    vjp_fn: Callable | None = None  # activations kept (remat=None): the unit's vjp
    gather: UnitGather | None = None  # its full parameters (storage released until backward)
    buffers: Params | None = None  # its buffers as the call found them (for a recompute)


def joined(record: CallRecord) -> CallRecord:
    """``record`` once its outputs joined the root's graph (the graph owns them now)."""
    return record._replace(outputs=())


def spent(record: CallRecord) -> CallRecord:
    """``record`` once its backward ran: its vjp, gather and remat state dropped."""
    return record._replace(replay=None, vjp_fn=None, gather=None, buffers=None)


class RootRecord(NamedTuple):
    """What the root's forward leaves for the caller and the backward.

    Attributes:
        out_spec: the output tree with its tensors taken out.
        n_outputs: the model's own output tensors (before the buffers, ``mutable=True``).
        replay: what the root's remat recorder saved (None: nothing).
        rng: the RNG state the root's forward started from (for its recompute).
        vjp: activations kept (``remat=None``): the root's vjp from forward, else None.
        gather: its parameters' gather, storage released until backward (None: kept, or
            no graph).
    """

    out_spec: TreeSpec
    n_outputs: int
    replay: dict | None
    rng: RngState
    vjp: Callable | None
    gather: UnitGather | None


class ForwardRecord(NamedTuple):
    """What one call's forward did, sealed when the root's forward ends; the backward
    reads it.

    Attributes:
        order: the unit index of each unit call, in forward order.
        records: per unit call, its :class:`CallRecord`. The one part the backward
            changes: a record is replaced by :func:`joined` once its outputs joined the
            root's recomputed graph and by :func:`spent` once its backward ran, so each
            unit's graph is freed as soon as it is used (a list, not a tuple: one
            replacement per unit call, no copy).
        root: the root's :class:`RootRecord` (replaced, once the root's backward ran,
            by one without its vjp, gather and replay).
    """

    order: tuple[int, ...]
    records: list[CallRecord]
    root: RootRecord


@dataclasses.dataclass(eq=False)
class ForwardState:
    """One call's forward while it runs; :meth:`seal` makes its :class:`ForwardRecord`.

    Attributes:
        order: the unit index of each unit call so far.
        records: per unit call so far, its :class:`CallRecord` (when ``record``).
        buffers: buffers as the forward updates them (name -> private copy, made on
            first use).
    """

    order: list[int] = dataclasses.field(default_factory=list)
    records: list[CallRecord] = dataclasses.field(default_factory=list)
    buffers: Params = dataclasses.field(default_factory=dict)

    def seal(self, root: RootRecord) -> ForwardRecord:
        """What this forward did, for the backward (the records list is handed over)."""
        return ForwardRecord(tuple(self.order), self.records, root)


@dataclasses.dataclass(eq=False)
class RootRun:
    """The root's module while it runs: in forward (recording its graph or not), or
    recomputed in backward. Made when it starts, dropped when it is done.

    Attributes:
        unit_fn: the ``autograd.Function`` a unit call's outputs join the root's graph
            through (``functions.UnitFn``, handed in by the module that defines it).
        plain: the root's full parameters, plain (units read the ones they share).
        values: while the root's graph is recorded or recomputed: its parameters in
            that graph.
        overrides: meanwhile, the units' shards as inputs of that graph.
        done: meanwhile, what the forward did, whose unit outputs join that graph: its
            state so far (recorded in forward) or its record (recomputed in backward).
        mode: the root's remat recorder or replayer, or None.
        replay_at: the next unit call of the root's graph (recording it, or recomputing).
    """

    unit_fn: type
    plain: Params
    values: Params = dataclasses.field(default_factory=dict)
    overrides: Params = dataclasses.field(default_factory=dict)
    done: ForwardState | ForwardRecord | None = None
    mode: UnitRecorder | UnitReplayer | None = None
    replay_at: int = 0


@dataclasses.dataclass(eq=False)
class Progress:
    """What changes in one ``apply`` call after its forward made it: where it is, what
    its backward still holds.

    Attributes:
        phase: where the call is (a unit call does different work in each).
        wanted: the leaves whose gradient the backward reduces (None: every trainable).
        kept: unit index (-1: root) -> its full parameters kept for backward (``keep``);
            filled by the forward, emptied by the backward.
        kept_uses: unit index -> its calls whose backward has not run yet (``keep``).
        run: the root's module while it runs (forward or recompute), else None.
    """

    phase: Phase = Phase.FORWARD
    wanted: frozenset[str] | None = None
    kept: dict[int, Params] = dataclasses.field(default_factory=dict)
    kept_uses: dict[int, int] = dataclasses.field(default_factory=dict)
    run: RootRun | None = None
