"""The backward of one `shard_params` ``apply`` call: functions over the call
(``call.ApplyCall``) and the :class:`~.record.ForwardRecord` its forward sealed.

``RootFn.backward`` runs :func:`backward_root`: with activations kept (``remat=None``)
it refills the root's parameter storage and runs the vjp the forward recorded
(:attr:`~.record.RootRecord.vjp`); with ``remat`` it gathers the root again and
recomputes its forward under ``torch.func.vjp``, each unit call replaying its output
through ``UnitFn`` (:func:`~.forward.join_graph`). Either way every
``UnitFn.backward`` runs :func:`backward_unit`: refill (or gather) the unit, run its
recorded vjp (or recompute it), mark its :class:`~.record.CallRecord` spent, claim
the next call's deferred reduction, issue its own; then the root reduces its own
gradient and waits for what is left (:func:`finish_backward`). What changes meanwhile
is the call's :class:`~.record.Progress` and the records the backward has spent.

Example:
    >>> grads = backward_root(call, UnitFn, arg_tensors, grads, outputs_float, needs_grad)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardfn.transforms.recording import replay_rng
from shardfn.transforms.shard_params.forward import running
from shardfn.transforms.shard_params.plan import Unit
from shardfn.transforms.shard_params.prefetch import Phase
from shardfn.transforms.shard_params.record import CallRecord, RootRun, spent
from shardfn.transforms.shard_params.steps import gather, gathered, params_for, reduce
from shardfn.transforms.shard_params.tree import TreeSpec, call_module, float_outputs
from shardfn.transforms.shard_params.unit_modes import UnitReplayer

if TYPE_CHECKING:
    from shardfn.transforms.shard_params.call import ApplyCall

__all__ = ["backward_root", "backward_unit"]

Params = dict[str, torch.Tensor]


def backward_root(call: ApplyCall, unit_fn: type, arg_tensors, grads, outputs_float,
                  needs_grad) -> tuple:
    """``RootFn.backward``: every leaf's and tensor argument's gradient (None where none
    is wanted), the units' reduced through their ``UnitFn`` s (``unit_fn``)."""
    plan, progress = call.plan, call.progress
    root = plan.root
    if progress.phase is not Phase.FORWARD:
        raise RuntimeError("shard_params: backward through one apply() call can run only "
                           "once (it frees what it saved); call model.apply again")
    progress.phase = Phase.BACKWARD
    trainable = [n for n, need in zip(plan.names, needs_grad, strict=False)
                 if need and n in plan.trainable_set]
    if len(trainable) < len(plan.trainable_set):  # some leaves want no gradient
        progress.wanted = frozenset(trainable)
    cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
    if call.forward.root.vjp is not None:  # (the forward's record is replaced there)
        return _backward_root_graph(call, arg_tensors, cotangents, needs_grad)
    done = call.forward
    full = progress.kept.pop(-1, None)
    if full is None:
        pending = gather(call, root)
        call.prefetcher.ahead(Phase.BACKWARD, len(done.order), done.order)
        full = pending.wait()
    local, shards = call.inputs.local, call.inputs.shards
    run = progress.run = RootRun(unit_fn, {**full, **{n: local[n] for n in root.whole}},
                                 done=done)
    root_train = {n: run.plain[n] for n in root.grad_inputs}
    unit_train = {n: shards[n] for n in plan.unit_trainable}
    n_leaves = len(plan.names)
    float_args = {i: t for i, t in enumerate(arg_tensors)
                  if t.is_floating_point() and needs_grad[n_leaves + i]}
    record = done.root

    def recompute(root_train, unit_train, float_args):
        args, kwargs = call.config.arg_spec.build([float_args.get(i, t)
                                                   for i, t in enumerate(arg_tensors)])
        progress.phase = Phase.RECOMPUTE
        run.values, run.overrides = {**run.plain, **root_train}, unit_train
        run.replay_at = 0
        if record.replay is not None:
            run.mode = UnitReplayer(record.replay)
        try:  # from the buffers as the forward found them (its updates count once); built
            # before the replay, as the forward built them before recording (buffer clones)
            params = params_for(call, root, run.values, {})
            with (running(call), replay_rng(record.rng), call.config.replay_autocast(),
                  run.mode or contextlib.nullcontext()):
                out = call_module(root, params, args, kwargs)
        finally:
            run.mode = None
        return float_outputs(out, outputs_float)

    _, vjp_fn = torch.func.vjp(recompute, root_train, unit_train, float_args)
    # create_graph=False: autograd's first-order formulas, as the kept vjp (remat=None)
    # and plain loss.backward() use (torch.func's create_graph ones round differently)
    g_root, g_units, g_args = vjp_fn(cotangents, create_graph=False)
    del vjp_fn, full, root_train
    return finish_backward(call, g_root, g_units, g_args, len(arg_tensors))


def _backward_root_graph(call: ApplyCall, arg_tensors, cotangents, needs_grad) -> tuple:
    """Backward of a forward that kept its vjp: refill the root's parameters, run it."""
    done = call.forward
    record = done.root
    kept = call.progress.kept.pop(-1, None)
    if kept is None:
        record.gather.start(call.inputs.shards, call.tags())
        call.prefetcher.ahead(Phase.BACKWARD, len(done.order), done.order)
        record.gather.wait()
    g_root, g_units, g_args = record.vjp(cotangents)
    call.forward = done = done._replace(root=record._replace(vjp=None, gather=None))
    if record.gather is not None:
        record.gather.release()
    del record, done
    n_leaves = len(call.plan.names)
    g_args = {i: g for i, g in g_args.items() if needs_grad[n_leaves + i]}
    return finish_backward(call, g_root, g_units, g_args, len(arg_tensors))


def finish_backward(call: ApplyCall, g_root, g_units, g_args, n_args: int) -> tuple:
    """Reduce the root's gradients, collect the units' and return the leaves' grads."""
    plan, progress = call.plan, call.progress
    call.prefetcher.drop()
    progress.run = None
    done = call.forward
    done.records.clear()
    call.forward = done._replace(root=done.root._replace(replay=None))
    del done
    g_units = dict(g_units)
    root_reduce = reduce(call, plan.root, dict(g_root))
    for grads in call.deferred.wait_unclaimed():  # the first call's, and any unclaimed
        for name, grad in grads.items():
            g_units[name] = g_units[name] + grad
    reduced = root_reduce.wait()
    progress.phase = Phase.DONE
    trainable = plan.trainable_set if progress.wanted is None else progress.wanted
    leaf_grads = [(reduced[n] if n in reduced else g_units.get(n)) if n in trainable else None
                  for n in plan.names]
    return (*leaf_grads, *[g_args.get(i) for i in range(n_args)])


def backward_unit(call: ApplyCall, position: int, arg_spec: TreeSpec, arg_tensors, grads,
                  outputs_float, needs_grad) -> tuple:
    """``UnitFn.backward`` of unit call ``position``: the gradients of its ``UnitFn``'s
    inputs (its trainable leaves, the next call's shards, its tensor arguments)."""
    progress, records = call.progress, call.forward.records
    unit = call.plan.units[call.forward.order[position]]
    full, _ = gathered(call, unit, Phase.BACKWARD, position)
    if unit.index in progress.kept:
        progress.kept_uses[unit.index] -= 1
        if not progress.kept_uses[unit.index]:
            del progress.kept[unit.index]
    later = call.deferred.offered[position]
    n_inputs = len(unit.grad_inputs) + len(later)
    cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
    record = records[position]
    records[position] = spent(record)  # freed when this backward returns
    if record.vjp_fn is not None:  # activations kept: the forward's vjp, on refilled params
        g_train, g_args = record.vjp_fn(cotangents)
        g_train = dict(g_train)
        if record.gather is not None:
            record.gather.release()
    else:
        vjp_fn = _recompute(call, unit, record, full, arg_spec, arg_tensors, outputs_float,
                            needs_grad[n_inputs:])
        record = None  # the recompute has what it needs
        g_train, g_args = vjp_fn(cotangents, create_graph=False)  # as backward_root's
        g_train = dict(g_train)
        del vjp_fn
    full = record = None
    external = {n: g_train.pop(n).detach() for n in unit.external if n in g_train}
    # the next call's reduction, issued in its backward (which ran just before this one)
    # and in flight during this one's: finished before this one's starts, so at most
    # one reduction is in flight
    later_grads = call.deferred.claim(position)
    own = call.deferred.defer(position, reduce(call, unit, g_train))
    grad_inputs = [external[n] if n in external else own.get(n) for n in unit.grad_inputs]
    return (*grad_inputs, *[later_grads.get(n) for n in later],
            *[g_args.get(i) if needs_grad[n_inputs + i] else None
              for i in range(len(arg_tensors))])


def _recompute(call: ApplyCall, unit: Unit, record: CallRecord, full: Params,
               arg_spec: TreeSpec, arg_tensors, outputs_float, needs_grad) -> Callable:
    """Recompute a unit call under ``torch.func.vjp`` (replaying what its policy
    recorded, with the forward's RNG state and buffers): its vjp function."""
    values = {**call.inputs.local, **call.progress.run.plain, **full}
    train = {n: values[n] for n in unit.grad_inputs}
    float_args = {i: t for i, t in enumerate(arg_tensors)
                  if t.is_floating_point() and needs_grad[i]}
    replay, found, rng_before = record.replay, record.buffers, record.rng_before

    def recompute(train, float_args):
        args, kwargs = arg_spec.build([float_args.get(i, t) for i, t in enumerate(arg_tensors)])
        replayer = UnitReplayer(replay) if replay is not None else None
        buffers = {n: t.clone() for n, t in (found or {}).items()}
        params = params_for(call, unit, full, buffers, train)  # outside the replay, as recorded
        with (replay_rng(rng_before), call.config.replay_autocast(),
              replayer or contextlib.nullcontext()):
            out = call_module(unit, params, args, kwargs)
        return float_outputs(out, outputs_float)

    _, vjp_fn = torch.func.vjp(recompute, train, float_args)
    replay = found = None  # the recompute has what it needs
    return vjp_fn
