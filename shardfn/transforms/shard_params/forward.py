"""The forward of one `shard_params` ``apply`` call: functions over the call
(``call.ApplyCall``) that build its :class:`~.record.ForwardState` and seal it into
the :class:`~.record.ForwardRecord` the backward reads.

``RootFn.forward`` runs :func:`forward_root`: gather the root, run its module with
:data:`~.plan.RUNNING` set, so that each :class:`~.plan.UnitCall` in it comes to
:func:`call_unit`. A unit call gathers its unit and runs it (:func:`forward_unit`),
keeping its graph's vjp (``remat=None``) or what its policy saves; when the root's
graph is recorded (or recomputed in backward) its outputs then join that graph
through ``UnitFn`` (:func:`join_graph`, which the recompute of :mod:`.backward` uses
too). ``UnitFn`` is handed in by :mod:`.functions`, which defines it.

Example:
    >>> outputs = forward_root(call, tensors, UnitFn)   # inside RootFn.forward
    >>> call.forward.order, call.forward.root.out_spec  # what it did, sealed
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardfn.transforms.recording import rng_state, set_rng
from shardfn.transforms.shard_params.plan import RUNNING, Running, Unit
from shardfn.transforms.shard_params.prefetch import Phase
from shardfn.transforms.shard_params.record import (
    CallInputs,
    CallRecord,
    ForwardState,
    RootRecord,
    RootRun,
    joined,
)
from shardfn.transforms.shard_params.steps import gather, gathered, params_for
from shardfn.transforms.shard_params.tree import (
    TreeSpec,
    arguments_signature,
    call_module,
    check_arguments_kept,
    detached,
    is_float,
    plain,
    recorded_vjp,
)
from shardfn.transforms.shard_params.unit_modes import UnitRecorder

if TYPE_CHECKING:
    from shardfn.transforms.shard_params.call import ApplyCall

__all__ = ["call_unit", "forward_root", "join_graph", "running", "unit_outputs"]

Params = dict[str, torch.Tensor]


@contextlib.contextmanager
def running(call: ApplyCall) -> Iterator[None]:
    """Make ``call`` the one the root's :class:`~.plan.UnitCall` s hand their calls to."""
    reset = RUNNING.set(Running(call.config.plan.token, functools.partial(call_unit, call)))
    try:
        yield
    finally:
        RUNNING.reset(reset)


def forward_root(call: ApplyCall, tensors: Sequence[torch.Tensor],
                 unit_fn: type) -> tuple[torch.Tensor, ...]:
    """``RootFn.forward``: run the whole model on the leaves and tensor arguments
    ``tensors``; seal what it did into ``call.forward``.

    Returns:
        The output's tensors, then (``mutable=True``) every buffer as it left them.
    """
    config, progress = call.config, call.progress
    plan = config.plan
    root, names, place = plan.root, plan.names, plan.place
    shards = dict(zip(names, tensors[:len(names)], strict=True))
    local = [n for u in (*plan.units, root) for n in u.whole] + [
        n for n in names if n in plan.buffer_set]
    call.inputs = CallInputs(shards, {n: place.cast(place.to_compute(shards[n])) for n in local})
    state = call.forward_state = ForwardState()
    args, kwargs = config.arg_spec.build(tensors[len(names):])
    pending = gather(call, root)
    call.prefetcher.ahead(Phase.FORWARD, -1)
    full = pending.wait()
    if config.keep_root:  # reshard_after_forward False or "units": backward reuses them
        progress.kept[-1] = full
    run = progress.run = RootRun(unit_fn, {**full, **{n: call.inputs.local[n]
                                                      for n in root.whole}})
    rng_root = rng_state()
    graph = config.record and plan.save
    before = arguments_signature((args, kwargs)) if config.record else ()
    root_vjp = root_replay = root_gather = None
    try:
        if graph:
            out, root_vjp = _forward_root_graph(call, run, args, kwargs)
        else:
            params = params_for(call, root, run.plain, state.buffers)
            if config.record and plan.policy is not None:
                run.mode = UnitRecorder(plan.policy, params)
            with running(call), run.mode or contextlib.nullcontext():
                out = call_module(root, params, args, kwargs)
            del params
    finally:
        call.prefetcher.drop()
        progress.run = None
    if config.record:
        check_arguments_kept("the model's forward (the root)", before, (args, kwargs))
    if graph and not config.keep_root:  # the root's vjp holds its parameters: free them
        pending.release()
        root_gather = pending
    if run.mode is not None:
        root_replay = run.mode.finish()
    del pending, full, run
    config.guess.update(state.order)
    out_spec, outputs = TreeSpec.of(out)
    call.forward = state.seal(RootRecord(out_spec, len(outputs), root_replay, rng_root,
                                         root_vjp, root_gather))
    call.forward_state = None
    inputs = {id(t) for t in tensors}
    outputs = [x.clone() if id(x) in inputs else x for x in outputs]
    if config.mutable:
        outputs += _new_buffers(call, state.buffers)
    return tuple(outputs)


def _new_buffers(call: ApplyCall, buffers: Params) -> list[torch.Tensor]:
    """Every buffer (in the model's order) as the forward left it (``buffers``), in the
    form the caller gave it (its dtype and device): private tensors."""
    plan, out = call.config.plan, []
    for name in plan.buffer_names:
        given = call.inputs.shards[name]
        value = buffers.get(name)
        if value is None:  # no unit used it: unchanged
            value = given.detach().clone()
        else:
            value = plan.place.to_storage(value).to(given.dtype)
        out.append(value)
    return out


def _forward_root_graph(call: ApplyCall, run: RootRun, args: tuple,
                        kwargs: dict) -> tuple[Any, Callable]:
    """Run the root recording its autograd graph (kept for backward: no recompute):
    its output, and the vjp its backward calls.

    Each unit call computes first (on plain inputs, recording its own graph), then
    its output enters the root's graph through ``UnitFn``, as in a recompute.
    """
    plan, progress = call.config.plan, call.progress
    root = plan.root
    spec, tensors = TreeSpec.of((args, kwargs))
    arg_wants = call.config.arg_wants
    with torch.enable_grad():
        root_train = {n: run.plain[n].detach().requires_grad_() for n in root.grad_inputs}
        unit_train = {n: call.inputs.shards[n].detach().requires_grad_()
                      for n in plan.unit_trainable}
        tensors = [t.detach().requires_grad_() if arg_wants[i] else t
                   for i, t in enumerate(tensors)]
        run.values, run.overrides = {**run.plain, **root_train}, unit_train
        run.done = call.forward_state
        progress.phase = Phase.FORWARD_GRAPH
        try:
            with running(call):
                out = call_module(root, params_for(call, root, run.values,
                                                   call.forward_state.buffers),
                                  *spec.build(tensors))
        finally:
            progress.phase = Phase.FORWARD
    order = call.forward_state.order
    call.deferred.settle([plan.units[index].owned_grads for index in order[1:]])
    wanted = {i: tensors[i] for i, w in enumerate(arg_wants) if w}
    return detached(out), recorded_vjp(out, (root_train, unit_train, wanted))


def call_unit(call: ApplyCall, index: int, args: tuple, kwargs: dict) -> Any:
    """A unit call made by the root (through its :class:`~.plan.UnitCall`)."""
    unit = call.config.plan.units[index]
    phase = call.progress.phase
    with _unit_scope(call.progress.run):
        if phase is Phase.RECOMPUTE:
            return join_graph(call, unit, args, kwargs)
        if phase is Phase.FORWARD_GRAPH:  # compute on plain inputs, then join
            spec, tensors = TreeSpec.of((args, kwargs))
            forward_unit(call, unit, *spec.build(plain(tensors)))
            return join_graph(call, unit, args, kwargs)
        return forward_unit(call, unit, args, kwargs)


@contextlib.contextmanager
def _unit_scope(run: RootRun) -> Iterator[None]:
    """Hide a unit's ops from the root's remat recorder / replayer."""
    if run.mode is None:
        yield
    else:
        with run.mode.pause():
            yield


def forward_unit(call: ApplyCall, unit: Unit, args: tuple, kwargs: dict) -> Any:
    """Gather ``unit`` and run it on ``args``; with ``record``, leave its
    :class:`~.record.CallRecord` for the backward."""
    config, progress, state = call.config, call.progress, call.forward_state
    plan = config.plan
    position = len(state.order)
    state.order.append(unit.index)
    rng_before = rng_state()
    # a recompute in backward starts from the buffers this call found (its own updates
    # to them are thrown away: the forward's count once)
    buffers_before = ({n: state.buffers[n].clone() if n in state.buffers
                       else call.inputs.local[n] for n in unit.buffers}
                      if config.record and not plan.save else None)
    before = arguments_signature((args, kwargs)) if config.record else ()
    full, gather = gathered(call, unit, Phase.FORWARD, position)
    vjp_fn, recorder = None, None
    if config.record and plan.save:
        out, vjp_fn = _forward_unit_graph(call, unit, full, args, kwargs)
        if not config.keep:  # autograd holds the parameters: free their storage instead
            gather.release()
        else:
            gather = None
    else:
        gather = None
        params = params_for(call, unit, full, state.buffers)
        if config.record and plan.policy is not None:
            recorder = UnitRecorder(plan.policy, params)
        with recorder or contextlib.nullcontext():
            out = call_module(unit, params, args, kwargs)
        del params
    del full
    if config.keep:
        progress.kept_uses[unit.index] = progress.kept_uses.get(unit.index, 0) + 1
    if config.record:
        check_arguments_kept(f"unit {unit.label}", before, (args, kwargs))
        spec, tensors = TreeSpec.of(out)
        state.records.append(CallRecord(
            tuple(tensors), tuple(t._version for t in tensors), spec, rng_before,
            rng_state(), recorder.finish() if recorder else None, vjp_fn, gather,
            buffers_before))
    return out


def _forward_unit_graph(call: ApplyCall, unit: Unit, full: Params, args: tuple,
                        kwargs: dict) -> tuple[Any, Callable]:
    """Run a unit recording its autograd graph (w.r.t. its trainable leaves and floating
    inputs): its output, and the vjp its backward calls (no recompute)."""
    values = {**call.inputs.local, **call.progress.run.plain, **full}
    spec, tensors = TreeSpec.of((args, kwargs))
    with torch.enable_grad():
        train = {n: values[n].detach().requires_grad_() for n in unit.grad_inputs}
        tensors = [t.detach().requires_grad_() if is_float(t) else t for t in tensors]
        out = call_module(unit, params_for(call, unit, full, call.forward_state.buffers,
                                           train), *spec.build(tensors))
    floats = {i: t for i, t in enumerate(tensors) if is_float(t)}
    return detached(out), recorded_vjp(out, (train, floats))


def join_graph(call: ApplyCall, unit: Unit, args: tuple, kwargs: dict) -> Any:
    """Enter a unit call's outputs into the root's graph through ``UnitFn``: the call
    the forward made at this point of the root's run (``run.done``: the forward so far
    when its graph is recorded, all of it when recomputed in backward)."""
    run = call.progress.run
    position = run.replay_at
    run.replay_at += 1
    order, records = run.done.order, run.done.records
    if position >= len(order) or order[position] != unit.index:
        raise RuntimeError(
            f"shard_params: when recomputed for backward, the root forward made call "
            f"{position} to unit {unit.label}, but in forward the unit calls were "
            f"{[call.config.plan.unit_paths[i] for i in order]}; the root forward must be "
            f"deterministic"
        )
    record = records[position]
    if any(t._version != v for t, v in zip(record.outputs, record.versions, strict=True)):
        raise RuntimeError(
            f"shard_params: an output of unit {unit.label} was modified in place after the "
            f"unit returned it; backward replays that output, so update it out of place "
            f"(x = x + y rather than x += y)"
        )
    values = {**run.values, **run.overrides}
    arg_spec, arg_tensors = TreeSpec.of((args, kwargs))
    later = call.deferred.offer(position, _next_owned(call, order, position))
    inputs = [values[name] for name in unit.grad_inputs + later]
    outputs = run.unit_fn.apply(call, position, arg_spec, len(inputs), *inputs, *arg_tensors)
    records[position] = record = joined(record)  # the graph's outputs own the storage
    set_rng(record.rng_after)
    return record.spec.build(outputs)


def _next_owned(call: ApplyCall, order: Sequence[int], position: int) -> tuple[str, ...]:
    """Shards of the next call's unit: their gradient comes out of this call's backward
    (``deferred``). In a recompute the next call is known; in a forward recording the
    graph it has not run yet, so the model's guess names it (settled after forward)."""
    if call.progress.phase is Phase.FORWARD_GRAPH:
        following = call.config.guess.unit_at(position + 1)
    else:
        following = order[position + 1] if position + 1 < len(order) else None
    return () if following is None else call.config.plan.units[following].owned_grads


def unit_outputs(call: ApplyCall, position: int) -> tuple[torch.Tensor, ...]:
    """The outputs unit call ``position`` computed in forward (``UnitFn.forward`` hands
    them back into the root's graph)."""
    return call.progress.run.done.records[position].outputs
