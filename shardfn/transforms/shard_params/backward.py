"""The backward half of one `shard_params` ``apply`` call (a base of ``call.ApplyCall``).

``RootFn.backward`` runs :meth:`Backward.backward_root`: with activations kept
(``remat=None``) it refills the root's parameter storage and runs the vjp the
forward recorded; with ``remat`` it gathers the root again and recomputes its
forward under ``torch.func.vjp``, each unit call replaying its output through
``UnitFn``. Either way every ``UnitFn.backward`` runs :meth:`Backward.backward_unit`:
refill (or gather) the unit, run its recorded vjp (or recompute it), claim the next
call's deferred reduction, issue its own; then the root reduces its own gradient
and waits for what is left (:meth:`Backward.finish_backward`).

Example:
    >>> grads = call.backward_root(arg_tensors, cotangents, outputs_float, needs_grad)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from shardfn.transforms.recording import replay_rng
from shardfn.transforms.shard_params.plan import Unit
from shardfn.transforms.shard_params.prefetch import Phase
from shardfn.transforms.shard_params.tree import CallRecord, TreeSpec, call_module, float_outputs
from shardfn.transforms.shard_params.unit_modes import UnitReplayer

__all__ = ["Backward"]

Params = dict[str, torch.Tensor]


class Backward:
    """The backward methods of ``ApplyCall`` (which holds the state they use)."""

    def backward_root(self, arg_tensors, grads, outputs_float, needs_grad) -> tuple:
        plan, root = self.plan, self.plan.root
        if self.phase is not Phase.FORWARD:
            raise RuntimeError("shard_params: backward through one apply() call can run only "
                               "once (it frees what it saved); call model.apply again")
        self.phase = Phase.BACKWARD
        trainable = [n for n, need in zip(plan.names, needs_grad, strict=False)
                     if need and n in plan.trainable_set]
        if len(trainable) < len(plan.trainable_set):  # some leaves want no gradient
            self.wanted = frozenset(trainable)
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
        if self.root_vjp is not None:
            return self.backward_root_graph(arg_tensors, cotangents, needs_grad)
        full = self.kept.pop(-1, None)
        if full is None:
            pending = self.gather(root)
            self.prefetcher.ahead(Phase.BACKWARD, len(self.order))
            full = pending.wait()
        self.root_plain = {**full, **{n: self.local[n] for n in root.replicated}}
        root_train = {n: self.root_plain[n] for n in root.grad_inputs}
        unit_train = {n: self.shards[n] for n in plan.unit_trainable}
        n_leaves = len(plan.names)
        float_args = {i: t for i, t in enumerate(arg_tensors)
                      if t.is_floating_point() and needs_grad[n_leaves + i]}

        def recompute(root_train, unit_train, float_args):
            args, kwargs = self.arg_spec.build([float_args.get(i, t)
                                                for i, t in enumerate(arg_tensors)])
            self.phase, self.replay_at, self.overrides = Phase.RECOMPUTE, 0, unit_train
            self.root_values = {**self.root_plain, **root_train}
            if self.root_replay is not None:
                self.root_mode = UnitReplayer(self.root_replay)
            try:  # from the buffers as the forward found them (its updates count once)
                with (self.running(), replay_rng(self.rng_root), self.replay_autocast(),
                      self.root_mode or contextlib.nullcontext()):
                    out = call_module(root, self.params_for(root, self.root_values, buffers={}),
                                      args, kwargs)
            finally:
                self.root_mode = None
            return float_outputs(out, outputs_float)

        _, vjp_fn = torch.func.vjp(recompute, root_train, unit_train, float_args)
        # create_graph=False: autograd's first-order formulas, as the kept vjp (remat=None)
        # and plain loss.backward() use (torch.func's create_graph ones round differently)
        g_root, g_units, g_args = vjp_fn(cotangents, create_graph=False)
        del vjp_fn, full, root_train
        return self.finish_backward(g_root, g_units, g_args, len(arg_tensors))

    def backward_root_graph(self, arg_tensors, cotangents, needs_grad) -> tuple:
        """Backward of a forward that kept its vjp: refill the root's parameters, run it."""
        kept = self.kept.pop(-1, None)
        if kept is None:
            self.root_gather.start(self.shards, self.tags())
            self.prefetcher.ahead(Phase.BACKWARD, len(self.order))
            self.root_gather.wait()
        g_root, g_units, g_args = self.root_vjp(cotangents)
        self.root_vjp = None
        if self.root_gather is not None:
            self.root_gather.release()
            self.root_gather = None
        n_leaves = len(self.plan.names)
        g_args = {i: g for i, g in g_args.items() if needs_grad[n_leaves + i]}
        return self.finish_backward(g_root, g_units, g_args, len(arg_tensors))

    def finish_backward(self, g_root, g_units, g_args, n_args: int) -> tuple:
        """Reduce the root's gradients, collect the units' and return the leaves' grads."""
        plan = self.plan
        self.prefetcher.drop()
        self.root_values, self.overrides, self.root_plain, self.records = {}, {}, {}, []
        self.root_replay = None
        g_units = dict(g_units)
        root_reduce = self.reduce(plan.root, dict(g_root))
        for grads in self.deferred.wait_unclaimed():  # the first call's, and any unclaimed
            for name, grad in grads.items():
                g_units[name] = g_units[name] + grad
        reduced = root_reduce.wait()
        self.phase = Phase.DONE
        trainable = plan.trainable_set if self.wanted is None else self.wanted
        leaf_grads = [(reduced[n] if n in reduced else g_units.get(n)) if n in trainable else None
                      for n in plan.names]
        return (*leaf_grads, *[g_args.get(i) for i in range(n_args)])

    def backward_unit(self, position: int, arg_spec: TreeSpec, arg_tensors, grads,
                      outputs_float, needs_grad) -> tuple:
        unit = self.plan.units[self.order[position]]
        full, _ = self.gathered(unit, Phase.BACKWARD, position)
        if unit.index in self.kept:
            self.kept_uses[unit.index] -= 1
            if not self.kept_uses[unit.index]:
                del self.kept[unit.index]
        later = self.deferred.offered[position]
        n_inputs = len(unit.grad_inputs) + len(later)
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
        record = self.records[position]
        if record.vjp_fn is not None:  # activations kept: the forward's vjp, on refilled params
            g_train, g_args = record.vjp_fn(cotangents)
            g_train = dict(g_train)
            record.vjp_fn = None
            if record.gather is not None:
                record.gather.release()
                record.gather = None
        else:
            g_train, g_args = self.recompute_vjp(unit, record, full, arg_spec, arg_tensors,
                                                 cotangents, outputs_float,
                                                 needs_grad[n_inputs:])
        full = None
        external = {n: g_train.pop(n).detach() for n in unit.external if n in g_train}
        # the next call's reduction, issued in its backward (which ran just before this one)
        # and in flight during this one's: finished before this one's starts, so at most
        # one reduction is in flight
        later_grads = self.deferred.claim(position)
        own = self.deferred.defer(position, self.reduce(unit, g_train))
        grad_inputs = [external[n] if n in external else own.get(n) for n in unit.grad_inputs]
        return (*grad_inputs, *[later_grads.get(n) for n in later],
                *[g_args.get(i) if needs_grad[n_inputs + i] else None
                  for i in range(len(arg_tensors))])

    def recompute_vjp(self, unit: Unit, record: CallRecord, full: Params, arg_spec: TreeSpec,
                      arg_tensors, cotangents, outputs_float, needs_grad) -> tuple[dict, Any]:
        """Recompute a unit call under ``torch.func.vjp`` (replaying what its policy
        recorded, with the forward's RNG state) and apply it to ``cotangents``."""
        values = {**self.local, **self.root_plain, **full}
        train = {n: values[n] for n in unit.grad_inputs}
        float_args = {i: t for i, t in enumerate(arg_tensors)
                      if t.is_floating_point() and needs_grad[i]}

        def recompute(train, float_args):
            args, kwargs = arg_spec.build([float_args.get(i, t) for i, t in enumerate(arg_tensors)])
            replayer = UnitReplayer(record.replay) if record.replay is not None else None
            buffers = {n: t.clone() for n, t in (record.buffers or {}).items()}
            with (replay_rng(record.rng_before), self.replay_autocast(),
                  replayer or contextlib.nullcontext()):
                out = call_module(unit, self.params_for(unit, full, train, buffers), args, kwargs)
            return float_outputs(out, outputs_float)

        _, vjp_fn = torch.func.vjp(recompute, train, float_args)
        record.replay = record.buffers = None  # the recompute has what it needs
        g_train, g_args = vjp_fn(cotangents, create_graph=False)  # as backward_root's
        return dict(g_train), g_args
