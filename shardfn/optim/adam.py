"""Adam and AdamW (torch.optim.Adam / torch.optim.AdamW), as pure transforms.

The arithmetic is torch.optim's, op for op, over the flat leaf list with
``torch._foreach_add_``-style kernels (t = number of this update, 1-based):

    g = g + weight_decay * p                    Adam's L2 decay (adam only)
    m = lerp(m, g, 1 - b1)                      = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step_size = lr / (1 - b1**t)                Python doubles, like torch
    denom = sqrt(v) / sqrt(1 - b2**t) + eps
    update = (-step_size * m) / denom           no decoupled decay
    update = addcdiv(p * (1 - lr * wd), m, denom, -step_size) - p    AdamW's decay

The last line is torch's own in-place sequence (``p.mul_(1 - lr * wd)`` then
``p.addcdiv_(m, denom, value=-step_size)``) run on a copy of ``p``; the new
value is within a factor 2 of ``p`` for all but entries crossing zero, where
the subtraction is exact (Sterbenz), so ``apply_updates(params, update)``
reproduces torch's parameters bit for bit there, and to within one rounding
elsewhere.
Memory: two buffers per parameter (``mu``, ``nu``) in the parameter's dtype.
Under donation (:func:`~shardfn.optim.donating`) the moments are updated in
place and the updates are written into the gradients: the same arithmetic,
bitwise the same results, no per-step allocation of state-sized buffers.
Not supported: amsgrad, maximize, complex parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.optim._tree import (
    bool_per_leaf,
    flatten_tensors,
    foreach_floating,
    frozen_zero,
    leaves_like,
)
from shardfn.optim.base import (
    GradientTransformation,
    ScalarOrSchedule,
    check_scalar,
    resolve_scalar,
    zero_count,
)
from shardfn.optim.donation import current_donation, same_dtypes, writable_in_place
from shardfn.primitives._compiled import tracing

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """State of :func:`adam` and :func:`adamw`."""

    count: torch.Tensor  # int64 scalar: number of updates done so far
    mu: Any  # first moment (exp_avg), a tree like params
    nu: Any  # second moment (exp_avg_sq), a tree like params


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam as in ``torch.optim.Adam``, with L2 weight decay added to the gradient.

    Args:
        learning_rate: a number or a schedule ``f(step) -> lr`` (step = updates done).
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
        weight_decay: L2 penalty ``weight_decay * p`` added to the gradient before the
            moments (needs ``params`` in ``update``).

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Example:
        >>> opt = adam(1e-3)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    return _adam("adam", learning_rate, b1, b2, eps, weight_decay, decoupled=False, mask=None)


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.01, mask: Any = None
          ) -> GradientTransformation:
    """AdamW as in ``torch.optim.AdamW``: decoupled decay ``p *= 1 - lr * weight_decay``.

    Args:
        learning_rate, b1, b2, eps: as in :func:`adam`.
        weight_decay: decoupled decay factor (needs ``params`` in ``update``).
        mask: which leaves decay: a tree (or prefix tree) of bools, or a callable
            ``mask(params) -> bool tree``; None decays every leaf. The Adam step itself
            applies to all leaves.

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamState`.

    Example:
        >>> no_decay_on_vectors = lambda params: tree_map(lambda p: p.ndim >= 2, params)
        >>> opt = adamw(1e-3, weight_decay=0.1, mask=no_decay_on_vectors)
    """
    return _adam("adamw", learning_rate, b1, b2, eps, weight_decay, decoupled=True, mask=mask)


def _adam(name, learning_rate, b1, b2, eps, weight_decay, *, decoupled, mask):
    check_scalar(learning_rate, "learning_rate", schedule_ok=True)
    check_scalar(b1, "b1", high=1.0)
    check_scalar(b2, "b2", high=1.0)
    check_scalar(eps, "eps")
    check_scalar(weight_decay, "weight_decay")
    b1, b2, eps, weight_decay = float(b1), float(b2), float(eps), float(weight_decay)

    def init(params):
        leaves, _ = flatten_tensors(params, "params")
        for leaf_name, leaf in zip(pytree.tree_paths(params), leaves, strict=True):
            if leaf.is_complex():
                raise TypeError(f"{name}: leaf {leaf_name!r} is complex, which is not supported")
        return AdamState(
            count=zero_count(),
            mu=pytree.tree_map(torch.zeros_like, params),
            nu=pytree.tree_map(torch.zeros_like, params),
        )

    def update(updates, state, params=None):
        grads, treedef = flatten_tensors(updates, "updates")
        mus = leaves_like(state.mu, updates, treedef, grads, what="updates",
                          other_what=f"{name} state (mu)")
        nus = leaves_like(state.nu, updates, treedef, grads, what="updates",
                          other_what=f"{name} state (nu)")
        if params is None and weight_decay != 0 and grads:  # an empty group needs none
            raise ValueError(f"{name} with weight_decay != 0 needs params: "
                             f"call update(updates, state, params)")
        param_leaves, decays = None, None
        if params is not None:  # checked even when unused: a mismatch is caught here
            param_leaves = leaves_like(params, updates, treedef, grads, what="updates",
                                       other_what="params")
        if decoupled and weight_decay != 0:
            decays = [True] * len(grads) if mask is None else bool_per_leaf(
                mask, params, f"{name} mask")

        lr = resolve_scalar(learning_rate, state.count)
        step_size, bias_correction2_sqrt = _bias_corrections(lr, b1, b2, state.count)
        donation = current_donation()
        # donated: moments updated in place (as torch.optim does), updates written into the
        # gradients once the moments no longer need them; the arithmetic is the same
        moments_in_place = donation.state and writable_in_place([*mus, *nus, *grads])
        updates_in_place = donation.updates and writable_in_place(grads) and \
            same_dtypes(grads, mus)

        def step(gs, ms, vs, ps, ds):
            if weight_decay != 0 and not decoupled:
                if updates_in_place:
                    torch._foreach_add_(gs, ps, alpha=weight_decay)
                else:
                    gs = torch._foreach_add(gs, ps, alpha=weight_decay)
            if moments_in_place:
                torch._foreach_lerp_(ms, gs, 1 - b1)
                torch._foreach_mul_(vs, b2)
            else:
                ms = torch._foreach_lerp(ms, gs, 1 - b1)
                vs = torch._foreach_mul(vs, b2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            flags = ds if ds is not None else [False] * len(gs)
            us = list(gs) if updates_in_place else [None] * len(gs)
            plain = [i for i, d in enumerate(flags) if not d]
            if plain:  # update = (-step_size * m) / denom, the term torch's addcdiv_ adds
                if updates_in_place:
                    for i in plain:
                        torch.mul(ms[i], -step_size, out=us[i])
                    plain_us = [us[i] for i in plain]
                else:
                    plain_us = torch._foreach_mul([ms[i] for i in plain], -step_size)
                torch._foreach_div_(plain_us, [denom[i] for i in plain])
                for i, u in zip(plain, plain_us, strict=True):
                    us[i] = u
            decayed = [i for i, d in enumerate(flags) if d]
            if decayed:  # torch's p.mul_(1 - lr * wd).addcdiv_(m, denom, -step_size) on a copy
                dps = [ps[i] for i in decayed]
                if updates_in_place:
                    for i in decayed:
                        torch.mul(ps[i], 1 - lr * weight_decay, out=us[i])
                    qs = [us[i] for i in decayed]
                else:
                    qs = torch._foreach_mul(dps, 1 - lr * weight_decay)
                _addcdiv_(qs, [ms[i] for i in decayed], [denom[i] for i in decayed], -step_size)
                torch._foreach_sub_(qs, dps)  # update = new p - p
                for i, q in zip(decayed, qs, strict=True):
                    us[i] = q
            return us, ms, vs

        def frozen(i):  # a non-floating leaf: zero update, moments untouched
            p = None if param_leaves is None else param_leaves[i]
            return frozen_zero(grads[i], p), mus[i], nus[i]

        new_updates, new_mu, new_nu = foreach_floating(
            step, [grads, mus, nus, param_leaves, decays], 3, frozen, param_leaves)
        return pytree.tree_unflatten(treedef, new_updates), AdamState(
            count=state.count + 1,
            mu=pytree.tree_unflatten(treedef, new_mu),
            nu=pytree.tree_unflatten(treedef, new_nu),
        )

    return GradientTransformation(init, update)


def _bias_corrections(lr: float | torch.Tensor, b1: float, b2: float, count: torch.Tensor
                      ) -> tuple[Any, Any]:
    """``(step_size, bias_correction2_sqrt)`` of update ``t = count + 1``.

    Eager: Python doubles, as torch.optim computes them (no device sync). In code that
    ``torch.compile`` traces: float64 0-dim tensors made with the same operations
    (``pow``, a true division, ``pow(x, 0.5)`` rather than ``sqrt``), so a compiled step
    gives the same doubles without recompiling on every new count (a Python number
    read from ``count`` would be a constant of the graph).
    """
    if not tracing():
        t = int(count) + 1
        return lr / (1 - b1**t), (1 - b2**t) ** 0.5
    f64 = torch.float64
    t = count.to(f64) + 1
    lr_t = lr.to(f64) if isinstance(lr, torch.Tensor) else torch.full((), lr, dtype=f64)
    step_size = torch.div(lr_t, 1 - torch.pow(b1, t))  # not lr / x: that is x.reciprocal() * lr
    half = torch.full((), 0.5, dtype=f64)  # a tensor exponent: torch turns pow(x, 0.5) into sqrt
    return step_size, torch.pow(1 - torch.pow(b2, t), half)


def _addcdiv_(qs: list[torch.Tensor], ms: list[torch.Tensor], ds: list[torch.Tensor],
              value: float | torch.Tensor) -> None:
    """``q += value * m / d`` for each triple: ``_foreach_addcdiv_``, or with a tensor ``value``
    (a traced step) the same arithmetic in addcdiv's own order, ``q + (value * m) / d``."""
    if isinstance(value, torch.Tensor):
        torch._foreach_add_(qs, torch._foreach_div(torch._foreach_mul(ms, value), ds))
    else:
        torch._foreach_addcdiv_(qs, ms, ds, value=value)
