"""Adam and AdamW (torch.optim.Adam / torch.optim.AdamW), as pure transforms.

The arithmetic is torch.optim's, op for op, over the flat leaf list with
``torch._foreach_*`` kernels (t = number of this update, 1-based):

    g = g + weight_decay * p                    Adam's L2 decay (adam only)
    m = lerp(m, g, 1 - b1)                      = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step_size = lr / (1 - b1**t)                Python doubles, like torch
    denom = sqrt(v) / sqrt(1 - b2**t) + eps
    update = (-step_size * m) / denom
    update += p * (1 - lr * weight_decay) - p   AdamW's decoupled decay (adamw only)

``p * (1 - lr * wd) - p`` is exact in float32 (Sterbenz), so
``apply_updates(params, update)`` reproduces torch's ``p.mul_(1 - lr * wd)``
followed by ``p.addcdiv_(m, denom, value=-step_size)`` to within one rounding.
Memory: two buffers per parameter (``mu``, ``nu``) in the parameter's dtype.
Not supported: amsgrad, maximize, complex parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.optim._tree import bool_per_leaf, flatten_tensors, foreach_groups, leaves_like
from shardfn.optim.base import (
    GradientTransformation,
    ScalarOrSchedule,
    check_scalar,
    resolve_scalar,
    zero_count,
)

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


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW as in ``torch.optim.AdamW``: decoupled decay ``p *= 1 - lr * weight_decay``.

    Args:
        learning_rate: a number or a schedule ``f(step) -> lr`` (step = updates done).
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
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
        if params is None and weight_decay != 0:
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
        t = int(state.count) + 1
        step_size = lr / (1 - b1**t)
        bias_correction2_sqrt = (1 - b2**t) ** 0.5

        def step(gs, ms, vs, ps, ds):
            if weight_decay != 0 and not decoupled:
                gs = torch._foreach_add(gs, ps, alpha=weight_decay)
            ms = torch._foreach_lerp(ms, gs, 1 - b1)
            vs = torch._foreach_mul(vs, b2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            us = torch._foreach_mul(ms, -step_size)
            torch._foreach_div_(us, denom)
            if ds is not None and any(ds):
                decayed = [p for p, d in zip(ps, ds, strict=True) if d]
                shrink = torch._foreach_mul(decayed, 1 - lr * weight_decay)
                torch._foreach_sub_(shrink, decayed)
                torch._foreach_add_([u for u, d in zip(us, ds, strict=True) if d], shrink)
            return us, ms, vs

        new_updates, new_mu, new_nu = foreach_groups(step, [grads, mus, nus, param_leaves, decays],
                                                     3)
        return pytree.tree_unflatten(treedef, new_updates), AdamState(
            count=state.count + 1,
            mu=pytree.tree_unflatten(treedef, new_mu),
            nu=pytree.tree_unflatten(treedef, new_nu),
        )

    return GradientTransformation(init, update)
