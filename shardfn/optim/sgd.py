"""Stochastic gradient descent with momentum, Nesterov and L2 weight decay (torch.optim.SGD).

The arithmetic is torch.optim.SGD's, op for op, over the flat leaf list with
``torch._foreach_add_``-style kernels:

    g   = g + weight_decay * p
    buf = g                                     on the first step
    buf = momentum * buf + (1 - dampening) * g  afterwards
    g   = g + momentum * buf  (nesterov)   or   g = buf
    update = -lr * g

so ``apply_updates(params, update)`` equals ``torch.optim.SGD.step()`` up to one
float32 rounding of ``p + update`` (torch fuses it into one ``add_(alpha=-lr)``).
Memory: one buffer per parameter when ``momentum != 0``, none otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.optim._tree import flatten_tensors, foreach_floating, frozen_zero, leaves_like
from shardfn.optim.base import (
    GradientTransformation,
    ScalarOrSchedule,
    check_scalar,
    resolve_scalar,
    zero_count,
)
from shardfn.optim.donation import current_donation, same_dtypes, writable_in_place
from shardfn.primitives._compiled import tracing

__all__ = ["SgdState", "sgd"]


class SgdState(NamedTuple):
    """State of :func:`sgd`."""

    count: torch.Tensor  # int64 scalar: number of updates done so far
    momentum: Any  # tree of momentum buffers like params; None when momentum == 0


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
) -> GradientTransformation:
    """SGD as in ``torch.optim.SGD`` (same hyper-parameters, same arithmetic).

    Args:
        learning_rate: a number or a schedule ``f(step) -> lr`` (step = updates done).
        momentum: momentum factor (0 disables the buffer).
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty added to the gradient (needs ``params`` in ``update``).
        dampening: dampening of the momentum.

    Returns:
        A :class:`GradientTransformation` with state :class:`SgdState`.

    Example:
        >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    check_scalar(learning_rate, "learning_rate", schedule_ok=True)
    check_scalar(momentum, "momentum")
    check_scalar(weight_decay, "weight_decay")
    check_scalar(dampening, "dampening")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum needs momentum > 0 and dampening == 0")
    momentum, weight_decay, dampening = float(momentum), float(weight_decay), float(dampening)

    def init(params):
        buffers = pytree.tree_map(torch.zeros_like, params) if momentum != 0 else None
        return SgdState(count=zero_count(), momentum=buffers)

    def update(updates, state, params=None):
        grads, treedef = flatten_tensors(updates, "updates")
        if params is None and weight_decay != 0 and grads:  # an empty group needs none
            raise ValueError("sgd with weight_decay != 0 needs params: "
                             "call update(updates, state, params)")
        param_leaves = None
        if params is not None:  # checked even when unused: a mismatch is caught here
            param_leaves = leaves_like(params, updates, treedef, grads, what="updates",
                                       other_what="params")
        buffers = None
        if momentum != 0:
            buffers = leaves_like(state.momentum, updates, treedef, grads, what="updates",
                                  other_what="sgd state (momentum)")
        lr = resolve_scalar(learning_rate, state.count)
        # traced by torch.compile: both branches, chosen by a tensor (no recompile per count)
        first_step = (state.count == 0) if tracing() else int(state.count) == 0
        donation = current_donation()
        # donated: momentum buffers updated in place, updates written into the gradients
        buffers_in_place = momentum != 0 and donation.state and \
            writable_in_place([*buffers, *grads])
        updates_in_place = donation.updates and writable_in_place(grads) and \
            (buffers is None or same_dtypes(grads, buffers))

        def step(gs, ps, bufs):
            if weight_decay != 0:
                if updates_in_place:
                    torch._foreach_add_(gs, ps, alpha=weight_decay)
                else:
                    gs = torch._foreach_add(gs, ps, alpha=weight_decay)
            new_bufs = [None] * len(gs)  # one entry per leaf, also without momentum
            if momentum != 0:
                if buffers_in_place:
                    if first_step:
                        torch._foreach_copy_(bufs, gs)
                    else:
                        torch._foreach_mul_(bufs, momentum)
                        torch._foreach_add_(bufs, gs, alpha=1 - dampening)
                    new_bufs = bufs
                elif isinstance(first_step, torch.Tensor):
                    later = torch._foreach_mul(bufs, momentum)
                    torch._foreach_add_(later, gs, alpha=1 - dampening)
                    new_bufs = [torch.where(first_step, g, b) for g, b in zip(gs, later,
                                                                             strict=True)]
                elif first_step:
                    new_bufs = [g.clone() for g in gs]
                else:
                    new_bufs = torch._foreach_mul(bufs, momentum)
                    torch._foreach_add_(new_bufs, gs, alpha=1 - dampening)
                if nesterov:
                    if updates_in_place:
                        torch._foreach_add_(gs, new_bufs, alpha=momentum)
                    else:
                        gs = torch._foreach_add(gs, new_bufs, alpha=momentum)
                elif updates_in_place:
                    torch._foreach_copy_(gs, new_bufs)
                else:
                    gs = new_bufs
            if updates_in_place:
                torch._foreach_mul_(gs, -lr)
                return gs, new_bufs
            return torch._foreach_mul(gs, -lr), new_bufs

        def frozen(i):  # a non-floating leaf: zero update, buffer untouched
            return (frozen_zero(grads[i], None if param_leaves is None else param_leaves[i]),
                    None if buffers is None else buffers[i])

        new_updates, new_bufs = foreach_floating(step, [grads, param_leaves, buffers], 2,
                                                 frozen, param_leaves)
        new_momentum = pytree.tree_unflatten(treedef, new_bufs) if momentum != 0 else None
        return (
            pytree.tree_unflatten(treedef, new_updates),
            SgdState(count=state.count + 1, momentum=new_momentum),
        )

    return GradientTransformation(init, update)
