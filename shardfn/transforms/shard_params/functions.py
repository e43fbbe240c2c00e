"""The two ``autograd.Function`` s one `shard_params` ``apply`` runs through.

``RootFn`` is the whole ``apply`` (inputs: every leaf and every tensor argument); it
is the only part ``torch.func`` sees. ``UnitFn`` is one unit call inside the root's
graph: its forward hands back the outputs the unit already computed, its backward
does the unit's work. Both only move tensors in and out of the running
``call.ApplyCall`` (passed as their first input): the forward (:mod:`.forward`) and
backward (:mod:`.backward`) functions over it do everything else. They are handed
``UnitFn``, defined here, for the unit calls that join the root's graph.

Example:
    >>> outputs = RootFn.apply(call, *leaves, *arg_tensors)
"""

from __future__ import annotations

from typing import Any

import torch

from shardfn.transforms.shard_params.backward import backward_root, backward_unit
from shardfn.transforms.shard_params.forward import forward_root, unit_outputs
from shardfn.transforms.shard_params.tree import is_float, plain

__all__ = ["RootFn", "UnitFn"]


class RootFn(torch.autograd.Function):
    """The whole apply(): inputs are every leaf and every tensor argument."""

    @staticmethod
    def forward(call: Any, *tensors: torch.Tensor):
        return forward_root(call, tensors, UnitFn)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call = ctx.call = inputs[0]
        ctx.save_for_backward(*inputs[1 + len(call.plan.names):])
        n = ctx.n_outputs = call.n_outputs  # then the new buffers (mutable=True)
        ctx.outputs_float = [is_float(o) for o in output[:n]]
        ctx.mark_non_differentiable(*[o for o in output[:n] if not is_float(o)], *output[n:])

    @staticmethod
    def backward(ctx, *grads):
        saved, grads = plain(ctx.saved_tensors), plain(grads[:ctx.n_outputs])
        return None, *backward_root(ctx.call, UnitFn, saved, grads, ctx.outputs_float,
                                    ctx.needs_input_grad[1:])


class UnitFn(torch.autograd.Function):
    """One unit call inside the root's graph: forward hands back its outputs, backward
    does the work. Inputs: the unit's trainable leaves, the next call's shards it
    returns the gradients of (``deferred``), ``n_inputs`` of them, then the call's
    tensor arguments."""

    @staticmethod
    def forward(call: Any, position: int, arg_spec: Any, n_inputs: int, *tensors: torch.Tensor):
        return tuple(t.detach() for t in unit_outputs(call, position))

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, position, arg_spec, n_inputs = inputs[:4]
        ctx.call, ctx.position, ctx.arg_spec = call, position, arg_spec
        ctx.save_for_backward(*inputs[4 + n_inputs:])
        ctx.outputs_float = [is_float(o) for o in output]
        ctx.mark_non_differentiable(*[o for o in output if not is_float(o)])

    @staticmethod
    def backward(ctx, *grads):
        saved, grads = plain(ctx.saved_tensors), plain(grads)
        return None, None, None, None, *backward_unit(
            ctx.call, ctx.position, ctx.arg_spec, saved, grads, ctx.outputs_float,
            ctx.needs_input_grad[4:])
