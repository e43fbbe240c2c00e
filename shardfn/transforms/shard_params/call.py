"""One `shard_params` ``apply`` call: its forward and its backward (:class:`ApplyCall`).

The call runs through :class:`~.functions.RootFn` (the whole apply) and, per unit
call inside the root, :class:`~.functions.UnitFn`. Its named parts: the
:class:`~.prefetch.Phase` it is in, a :class:`~.prefetch.Prefetcher` (gathers ahead)
and :class:`~.deferred.DeferredReductions` (reduce-scatters waited one call later).
It reads its model only through the frozen :class:`~.plan.Plan` and the model's
:class:`~.prefetch.PrefetchGuess`. ``docs/architecture.md`` walks through a call step
by step; the backward half is in :mod:`.backward`.

Example:
    >>> call = ApplyCall(plan, guess, arg_spec, arg_tensors, keep=False, record=True)
    >>> outputs = RootFn.apply(call, *leaves, *arg_tensors)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from shardfn._torch_internals import is_functorch_wrapped
from shardfn.primitives import autocast_state
from shardfn.transforms.recording import RngState, rng_state, set_rng
from shardfn.transforms.shard_params.accumulator import Accumulator, NoReduce
from shardfn.transforms.shard_params.backward import Backward
from shardfn.transforms.shard_params.deferred import DeferredReductions
from shardfn.transforms.shard_params.exchange import Reduction, Tags, UnitGather
from shardfn.transforms.shard_params.functions import UnitFn
from shardfn.transforms.shard_params.plan import RUNNING, Plan, Unit
from shardfn.transforms.shard_params.prefetch import Phase, Prefetcher, PrefetchGuess
from shardfn.transforms.shard_params.tree import (
    CallRecord,
    TreeSpec,
    arguments_signature,
    call_module,
    check_arguments_kept,
    detached,
    is_float,
    plain,
    recorded_vjp,
)
from shardfn.transforms.shard_params.unit_modes import UnitRecorder, UnitReplayer

__all__ = ["ApplyCall"]

Params = dict[str, torch.Tensor]


class ApplyCall(Backward):
    """The state of one ``apply`` call, shared by its forward and its backward.

    Args:
        plan: the model's plan, for the dtypes of the shards given.
        guess: the model's guess of the unit order (updated after this forward).
        arg_spec, arg_tensors: the call's arguments, taken apart.
        keep: keep the full parameters for backward (``reshard_after_forward=False``).
        record: a backward may follow (grad mode): save what it needs.
        mutable: also return the buffers as the forward left them.
    """

    def __init__(self, plan: Plan, guess: PrefetchGuess, arg_spec: TreeSpec,
                 arg_tensors: Sequence[torch.Tensor], keep: bool, record: bool,
                 mutable: bool = False):
        self.plan, self.guess, self.arg_spec = plan, guess, arg_spec
        # per tensor argument: may a gradient be asked for it (the root's graph is
        # recorded in forward, before backward says which inputs need one)
        self.arg_wants = [is_float(t) and (t.requires_grad or is_functorch_wrapped(t))
                          for t in arg_tensors]
        self.keep, self.record, self.mutable = keep, record, mutable
        self.phase = Phase.FORWARD
        self.shards: Params = {}  # plain local shards and buffers (as RootFn.forward got them)
        self.local: Params = {}  # replicated leaves and buffers on the compute device, cast
        self.root_plain: Params = {}  # the root's full parameters, plain
        self.root_values: Params = {}  # the root's full parameters in the graph (primals)
        self.overrides: Params = {}  # unit shards as primals of the root's graph
        self.order: list[int] = []  # unit index of each call, in forward order
        self.records: list[CallRecord] = []
        self.replay_at = 0  # the next unit call of the root's graph
        self.tags = Tags()  # message tags of this call's exchanges
        self.kept: dict[int, Params] = {}  # unit index (-1: root) -> full params
        self.kept_uses: dict[int, int] = {}
        self.prefetcher = Prefetcher(plan, guess, self.order, self.start_gather,
                                     lambda index: index in self.kept)
        self.deferred = DeferredReductions()
        self.out_spec: TreeSpec | None = None
        self.rng_root: RngState | None = None
        self.accumulator = Accumulator.current(plan.token)  # reduce_once: add, don't reduce
        self.root_mode: UnitRecorder | UnitReplayer | None = None  # the root's remat mode
        self.root_replay: dict | None = None  # what the root's recorder saved
        self.root_vjp: Callable | None = None  # activations kept: the root's vjp from forward
        self.root_gather: UnitGather | None = None  # its parameters, released until backward
        # buffers as the forward updates them (name -> private copy, made on first use)
        self.buffers: Params = {}
        self.n_outputs = 0  # the model's own output tensors (before the buffers)
        # leaves whose gradient the backward reduces (None: every trainable one)
        self.wanted: frozenset[str] | None = None
        # a recompute in backward runs under the forward's autocast state
        self.autocast = autocast_state.capture() if record and not plan.save else None

    # ---- gathering and reducing -------------------------------------------------------------
    def gather(self, unit: Unit) -> UnitGather:
        return UnitGather(unit, self.shards, self.plan.ax, self.plan.place, self.tags())

    def start_gather(self, unit: Unit, phase: Phase, position: int) -> UnitGather:
        """Issue the gather for a call: in backward, into the storage its forward kept."""
        if phase is Phase.BACKWARD and self.records[position].gather is not None:
            return self.records[position].gather.start(self.shards, self.tags())
        return self.gather(unit)

    def gathered(self, unit: Unit, phase: Phase,
                 position: int) -> tuple[Params, UnitGather | None]:
        """Full parameters of ``unit`` for its call at ``position``, and their gather (None
        when kept from forward); prefetch the next ones."""
        if unit.index in self.kept:
            return self.kept[unit.index], None
        pending = self.prefetcher.take(phase, position, unit)
        full = pending.wait()
        self.prefetcher.ahead(phase, position)
        if self.keep and phase is Phase.FORWARD:
            self.kept[unit.index] = full
        return full, pending

    def reduce(self, unit: Unit, grads: dict[str, torch.Tensor]) -> Reduction | NoReduce:
        """Start reducing ``unit``'s full gradients (or add them to the accumulator); only
        those of the leaves a gradient is wanted for."""
        if self.accumulator is not None:
            if self.wanted is not None:
                grads = {n: g for n, g in grads.items() if n in self.wanted}
            self.accumulator.add(unit.index, grads, self.plan.masters)
            return NoReduce()
        return Reduction(self.plan, unit, grads, self.tags(), self.wanted)

    # ---- what a module call gets ----------------------------------------------------------
    def params_for(self, unit: Unit, full: Params, override: Mapping = (),
                   buffers: Params | None = None) -> Params:
        """What ``functional_call`` on the unit's module gets, by the module's own names.

        Buffers come from ``buffers`` (default: the call's, as the forward has updated
        them so far), private copies the forward may update in place.
        """
        params = {}
        buffers = self.buffers if buffers is None else buffers
        for name, rel in unit.rel:
            if name in override:
                params[rel] = override[name]
            elif name in full:
                params[rel] = full[name]
            elif name in self.plan.buffer_set:
                if name not in buffers:  # first use: a private copy
                    buffers[name] = self.local[name].clone()
                params[rel] = buffers[name]
            elif name in unit.external:
                params[rel] = self.root_plain[name]
            else:  # a replicated (0-dim) parameter
                params[rel] = self.local[name]
        return params

    def replay_autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast state, for a recompute (as ``torch.utils.checkpoint``)."""
        return self.autocast.replay() if self.autocast is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Make this the call the root's :class:`~.plan.UnitCall` s hand their calls to."""
        reset = RUNNING.set(self)
        try:
            yield
        finally:
            RUNNING.reset(reset)

    # ---- forward ---------------------------------------------------------------------------
    def forward_root(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        plan = self.plan
        root, names, place = plan.root, plan.names, plan.place
        self.shards = dict(zip(names, tensors[:len(names)], strict=True))
        local = [n for u in (*plan.units, root) for n in u.replicated] + [
            n for n in names if n in plan.buffer_set]
        self.local = {n: place.cast(place.to_compute(self.shards[n])) for n in local}
        args, kwargs = self.arg_spec.build(tensors[len(names):])
        pending = self.gather(root)
        self.prefetcher.ahead(Phase.FORWARD, -1)
        full = pending.wait()
        if self.keep:
            self.kept[-1] = full
        self.root_plain = {**full, **{n: self.local[n] for n in root.replicated}}
        self.rng_root = rng_state()
        graph = self.record and plan.save
        before = arguments_signature((args, kwargs)) if self.record else ()
        try:
            if graph:
                out = self.forward_root_graph(args, kwargs)
            else:
                params = self.params_for(root, self.root_plain)
                if self.record and plan.policy is not None:
                    self.root_mode = UnitRecorder(plan.policy, params)
                with self.running(), self.root_mode or contextlib.nullcontext():
                    out = call_module(root, params, args, kwargs)
                del params
        finally:
            self.prefetcher.drop()
        if self.record:
            check_arguments_kept("the model's forward (the root)", before, (args, kwargs))
        if graph and not self.keep:  # the root's vjp holds its parameters: free the storage
            pending.release()
            self.root_gather = pending
        if self.root_mode is not None:
            self.root_replay, self.root_mode = self.root_mode.finish(), None
        del pending, full
        self.guess.update(self.order)
        self.root_plain = {}
        self.out_spec, outputs = TreeSpec.of(out)
        self.n_outputs = len(outputs)
        inputs = {id(t) for t in tensors}
        outputs = [x.clone() if id(x) in inputs else x for x in outputs]
        if self.mutable:
            outputs += self.new_buffers()
        self.buffers = {}
        return tuple(outputs)

    def new_buffers(self) -> list[torch.Tensor]:
        """Every buffer (in the model's order) as the forward left it, in the form the
        caller gave it (its dtype and device): private tensors."""
        out = []
        for name in self.plan.buffer_names:
            given = self.shards[name]
            value = self.buffers.get(name)
            if value is None:  # no unit used it: unchanged
                value = given.detach().clone()
            else:
                value = self.plan.place.to_storage(value).to(given.dtype)
            out.append(value)
        return out

    def forward_root_graph(self, args: tuple, kwargs: dict) -> Any:
        """Run the root recording its autograd graph (kept for backward: no recompute).

        Each unit call computes first (on plain inputs, recording its own graph), then
        its output enters the root's graph through ``UnitFn``, as in a recompute.
        """
        plan, root = self.plan, self.plan.root
        spec, tensors = TreeSpec.of((args, kwargs))
        with torch.enable_grad():
            root_train = {n: self.root_plain[n].detach().requires_grad_() for n in root.grad_inputs}
            unit_train = {n: self.shards[n].detach().requires_grad_() for n in plan.unit_trainable}
            tensors = [t.detach().requires_grad_() if self.arg_wants[i] else t
                       for i, t in enumerate(tensors)]
            self.phase, self.replay_at, self.overrides = Phase.FORWARD_GRAPH, 0, unit_train
            self.root_values = {**self.root_plain, **root_train}
            try:
                with self.running():
                    out = call_module(root, self.params_for(root, self.root_values),
                                      *spec.build(tensors))
            finally:
                self.phase = Phase.FORWARD
                self.root_values, self.overrides = {}, {}
        self.deferred.settle([plan.units[index].owned_grads for index in self.order[1:]])
        wanted = {i: tensors[i] for i, w in enumerate(self.arg_wants) if w}
        self.root_vjp = recorded_vjp(out, (root_train, unit_train, wanted))
        return detached(out)

    def call_unit(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A unit call made by the root (through its :class:`~.plan.UnitCall`)."""
        unit = self.plan.units[index]
        with self.unit_scope():
            if self.phase is Phase.RECOMPUTE:
                return self.join_graph(unit, args, kwargs)
            if self.phase is Phase.FORWARD_GRAPH:  # compute on plain inputs, then join
                spec, tensors = TreeSpec.of((args, kwargs))
                self.forward_unit(unit, *spec.build(plain(tensors)))
                return self.join_graph(unit, args, kwargs)
            return self.forward_unit(unit, args, kwargs)

    @contextlib.contextmanager
    def unit_scope(self) -> Iterator[None]:
        """Hide a unit's ops from the root's remat recorder / replayer."""
        if self.root_mode is None:
            yield
        else:
            with self.root_mode.pause():
                yield

    def forward_unit(self, unit: Unit, args: tuple, kwargs: dict) -> Any:
        position = len(self.order)
        self.order.append(unit.index)
        rng_before = rng_state()
        # a recompute in backward starts from the buffers this call found (its own updates
        # to them are thrown away: the forward's count once)
        buffers_before = ({n: self.buffers[n].clone() if n in self.buffers else self.local[n]
                           for n in unit.buffers} if self.record and not self.plan.save
                          else None)
        before = arguments_signature((args, kwargs)) if self.record else ()
        full, gather = self.gathered(unit, Phase.FORWARD, position)
        vjp_fn, recorder = None, None
        if self.record and self.plan.save:
            out, vjp_fn = self.forward_unit_graph(unit, full, args, kwargs)
            if not self.keep:  # autograd holds the parameters: free their storage instead
                gather.release()
            else:
                gather = None
        else:
            gather = None
            params = self.params_for(unit, full)
            if self.record and self.plan.policy is not None:
                recorder = UnitRecorder(self.plan.policy, params)
            with recorder or contextlib.nullcontext():
                out = call_module(unit, params, args, kwargs)
            del params
        del full
        if self.keep:
            self.kept_uses[unit.index] = self.kept_uses.get(unit.index, 0) + 1
        if self.record:
            check_arguments_kept(f"unit {unit.label}", before, (args, kwargs))
            spec, tensors = TreeSpec.of(out)
            self.records.append(CallRecord(
                tensors, [t._version for t in tensors], spec, rng_before, rng_state(),
                recorder.finish() if recorder else None, vjp_fn, gather, buffers_before))
        return out

    def forward_unit_graph(self, unit: Unit, full: Params, args: tuple,
                           kwargs: dict) -> tuple[Any, Callable]:
        """Run a unit recording its autograd graph (w.r.t. its trainable leaves and floating
        inputs): its output, and the vjp its backward calls (no recompute)."""
        values = {**self.local, **self.root_plain, **full}
        spec, tensors = TreeSpec.of((args, kwargs))
        with torch.enable_grad():
            train = {n: values[n].detach().requires_grad_() for n in unit.grad_inputs}
            tensors = [t.detach().requires_grad_() if is_float(t) else t for t in tensors]
            out = call_module(unit, self.params_for(unit, full, train), *spec.build(tensors))
        floats = {i: t for i, t in enumerate(tensors) if is_float(t)}
        return detached(out), recorded_vjp(out, (train, floats))

    def join_graph(self, unit: Unit, args: tuple, kwargs: dict) -> Any:
        """Enter a unit call's outputs into the root's graph through ``UnitFn``."""
        position = self.replay_at
        self.replay_at += 1
        if position >= len(self.order) or self.order[position] != unit.index:
            raise RuntimeError(
                f"shard_params: when recomputed for backward, the root forward made call "
                f"{position} to unit {unit.label}, but in forward the unit calls were "
                f"{[self.plan.unit_paths[i] for i in self.order]}; the root forward must be "
                f"deterministic"
            )
        record = self.records[position]
        if any(t._version != v for t, v in zip(record.outputs, record.versions, strict=True)):
            raise RuntimeError(
                f"shard_params: an output of unit {unit.label} was modified in place after the "
                f"unit returned it; backward replays that output, so update it out of place "
                f"(x = x + y rather than x += y)"
            )
        values = {**self.root_values, **self.overrides}
        arg_spec, arg_tensors = TreeSpec.of((args, kwargs))
        later = self.deferred.offer(position, self.next_owned(position))
        inputs = [values[name] for name in unit.grad_inputs + later]
        outputs = UnitFn.apply(self, position, arg_spec, *inputs, *arg_tensors)
        record.outputs = []  # the graph's outputs now own the storage
        set_rng(record.rng_after)
        return record.spec.build(outputs)

    def next_owned(self, position: int) -> tuple[str, ...]:
        """Shards of the next call's unit: their gradient comes out of this call's backward
        (``deferred``). In a recompute the next call is known; in a forward recording the
        graph it has not run yet, so the model's guess names it (settled after forward)."""
        if self.phase is Phase.FORWARD_GRAPH:
            following = self.guess.unit_at(position + 1)
        else:
            following = self.order[position + 1] if position + 1 < len(self.order) else None
        return () if following is None else self.plan.units[following].owned_grads

    def n_unit_inputs(self, position: int) -> int:
        """How many leaves the ``UnitFn`` of call ``position`` takes (before its arguments)."""
        unit = self.plan.units[self.order[position]]
        return len(unit.grad_inputs) + len(self.deferred.offered[position])
