"""The optimizer interface (optax's): a pair of pure functions ``init`` and ``update``.

An optimizer is a :class:`GradientTransformation`. ``init(params)`` builds its
state; ``update(updates, state, params)`` turns gradients into *updates* — the
deltas to add to the parameters, so negative for descent — and returns the new
state. :func:`apply_updates` adds them. Nothing is mutated: params, gradients
and states passed in are left as they were, and new tensors come back.

States are NamedTuples of tensors (pytrees), so they can be saved, sharded and
gathered like parameters. Step counters are int64 scalar tensors on the CPU:
the scalar hyper-parameters of a step (bias corrections, scheduled learning
rates) are computed from them in Python double precision, exactly as
``torch.optim`` does, without a device sync.

Example:
    >>> opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> params = apply_updates(params, updates)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.optim._compose import fold, is_sharded, marks_full_leaves
from shardfn.optim._tree import (
    flatten_tensors,
    foreach_floating,
    foreach_groups,
    frozen_zero,
    is_frozen,
    leaves_like,
)
from shardfn.optim.donation import current_donation, donated, writable_in_place
from shardfn.primitives._compiled import tracing

PyTree = Any
Schedule = Callable[[torch.Tensor], float | torch.Tensor]
ScalarOrSchedule = float | torch.Tensor | Schedule

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "ScaleByScheduleState",
    "ScalarOrSchedule",
    "Schedule",
    "apply_updates",
    "chain",
    "donating",
    "identity",
    "scale",
    "scale_by_schedule",
    "set_to_zero",
]


class GradientTransformation(NamedTuple):
    """A pure optimizer: ``init(params) -> state`` and ``update(updates, state, params)``.

    ``update`` returns ``(updates, new_state)``; ``params`` is optional and only
    needed by transforms that read the parameters (weight decay).

    Example:
        >>> opt = sgd(0.1)
        >>> state = opt.init({"w": torch.zeros(3)})
        >>> updates, state = opt.update({"w": torch.ones(3)}, state)
    """

    init: Callable[[PyTree], Any]
    update: Callable[..., tuple[PyTree, Any]]


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`."""

    count: torch.Tensor  # int64 scalar: number of updates done so far


def zero_count() -> torch.Tensor:
    """A fresh step counter: an int64 scalar tensor on the CPU holding 0."""
    return torch.zeros((), dtype=torch.int64)


def resolve_scalar(value: Any, count: torch.Tensor) -> float:
    """The Python float of a hyper-parameter that may be a schedule of the step count.

    Args:
        value: a number, a scalar tensor, or ``schedule(count) -> number | scalar tensor``.
        count: updates done so far (an int64 scalar tensor); step ``t`` (1-based) uses
            ``schedule(t - 1)``, like ``torch.optim.lr_scheduler`` and optax.

    Returns:
        The value as a Python float (double precision, as torch.optim uses); in code that
        ``torch.compile`` traces, a schedule's tensor value stays a float64 0-dim tensor.
    """
    if callable(value):
        value = value(count)
    if isinstance(value, torch.Tensor) and tracing():
        return value.to(torch.float64)  # traced: float() would end the graph (a data read)
    return float(value)


def check_scalar(
    value: Any, name: str, *, low: float = 0.0, high: float | None = None,
    schedule_ok: bool = False,
) -> None:
    """Validate a hyper-parameter: a number (or, if ``schedule_ok``, a schedule).

    Schedules are checked only when called.

    Raises:
        TypeError: if ``value`` is neither a number, a scalar tensor nor an allowed callable.
        ValueError: if a number is NaN or out of ``[low, high)`` (the message names ``name``).
    """
    if callable(value):
        if schedule_ok:
            return
        raise TypeError(f"{name} must be a number, got the callable {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a schedule, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    if value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def donating(opt: GradientTransformation) -> GradientTransformation:
    """``opt`` whose ``update`` donates its ``updates`` (gradients) and ``state`` arguments.

    The caller must not use the gradients or the state it passed in after the
    call (the returned state and updates may share their memory). ``init`` is
    unchanged. Adam/AdamW, SGD, ``scale``, ``scale_by_schedule``,
    ``clip_by_global_norm`` and ``set_to_zero`` write in place; ``chain``,
    ``masked`` and ``multi_transform`` pass the donation on to what they wrap.

    Args:
        opt: any :class:`GradientTransformation`.

    Returns:
        A :class:`GradientTransformation` with the same state.

    Example:
        >>> opt = donating(chain(clip_by_global_norm(1.0), adamw(1e-3)))
        >>> updates, state = opt.update(grads, state, params)
    """
    if not isinstance(opt, GradientTransformation):
        hint = (" (a ShardedOptimizer donates with shard_opt_state(..., donate=True))"
                if callable(getattr(opt, "rewrap", None)) else "")
        raise TypeError(f"donating expects a GradientTransformation, got "
                        f"{type(opt).__name__}{hint}")

    def update(updates, state, params=None):
        with donated(updates=True, state=True):
            return opt.update(updates, state, params)

    return GradientTransformation(opt.init, update)


def apply_updates(params: PyTree, updates: PyTree, *, donate: bool = False) -> PyTree:
    """Add ``updates`` to ``params`` leaf by leaf (a new tree; inputs are not mutated).

    Each result keeps its parameter's dtype (a float32 update on bf16 params
    gives bf16 params).

    Args:
        params: the parameter tree.
        updates: a tree of the same structure and leaf shapes.
        donate: ``params`` are dead after the call: add in place into them (under
            ``torch.no_grad``, so leaf tensors that require grad work too) and return
            the same tensors. Falls back to a new tree when a parameter cannot be
            written safely (two leaves sharing memory, a ``torch.func``-wrapped tensor).
            Bitwise the same values either way.

    Returns:
        The new parameter tree.

    Raises:
        ValueError: naming the leaf where the trees differ.

    Example:
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    param_leaves, treedef = flatten_tensors(params, "params")
    update_leaves = leaves_like(
        updates, params, treedef, param_leaves, what="params", other_what="updates"
    )
    if donate and writable_in_place(param_leaves, allow_requires_grad=True):
        def add_(ps, us):
            torch._foreach_add_(ps, us)
            return (ps,)

        with torch.no_grad():
            foreach_groups(add_, [param_leaves, update_leaves], 1)
        return params

    def add(ps, us):
        return ([r.to(p.dtype) for r, p in zip(torch._foreach_add(ps, us), ps, strict=True)],)

    (new,) = foreach_groups(add, [param_leaves, update_leaves], 1)
    return pytree.tree_unflatten(treedef, new)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms one after the other; the state is the tuple of their states.

    With a ``shard_opt_state`` optimizer among ``transforms`` the whole chain is sharded
    the same way: ``chain(a, shard_opt_state(b, mesh, "dp"), c)`` is
    ``shard_opt_state(chain(a, b, c), mesh, "dp")`` (a ``ShardedOptimizer``), so every
    transform sees the dp-averaged gradient's pieces and ``clip_by_global_norm`` clips by
    the global norm, as unsharded. Refused when built: two sharded parts with different
    sharding, or a part marked :func:`~shardfn.optim.needs_full_leaves`.

    Args:
        *transforms: the transforms, in the order they act on the updates.

    Returns:
        A transform whose state is ``tuple(t.init(params) for t in transforms)`` (a
        ``ShardedOptimizer`` whose state's ``inner`` is that tuple, when one is sharded).

    Raises:
        TypeError: naming the argument that is not a transform.
        ValueError: for a composition with a sharded optimizer that cannot mean anything.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), sgd(0.1, momentum=0.9))
        >>> zero = chain(clip_by_global_norm(1.0), sf.shard_opt_state(adamw(1e-3), mesh, "dp"))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation) and not is_sharded(t):
            raise TypeError(f"chain: argument {i} is a {type(t).__name__}, "
                            f"expected a GradientTransformation (or a ShardedOptimizer)")
    sharded = fold([(f"argument {i}", t) for i, t in enumerate(transforms)], "chain")
    if sharded is not None:
        return sharded.rewrap(chain(*(t.inner if is_sharded(t) else t for t in transforms)))

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transforms got a state that is not a "
                             f"tuple of {len(transforms)} states: {type(state).__name__}")
        new_state = []
        for t, s in zip(transforms, state, strict=True):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return marks_full_leaves(GradientTransformation(init, update), transforms)


def _stateless(params) -> EmptyState:
    """The ``init`` of a transform that keeps no state."""
    return EmptyState()


def identity() -> GradientTransformation:
    """Pass updates through unchanged (stateless).

    Example:
        >>> multi_transform({"train": adam(1e-3), "keep": identity()}, labels)
    """

    def update(updates, state, params=None):
        leaves, treedef = flatten_tensors(updates, "updates")
        if any(is_frozen(u) for u in leaves):  # non-floating leaves: zero updates
            return pytree.tree_unflatten(
                treedef, [frozen_zero(u) if is_frozen(u) else u for u in leaves]), state
        return updates, state

    return GradientTransformation(_stateless, update)


def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros (freezes the leaves it is applied to).

    Example:
        >>> multi_transform({"train": adam(1e-3), "frozen": set_to_zero()}, labels)
    """

    def update(updates, state, params=None):
        leaves, treedef = flatten_tensors(updates, "updates")
        if leaves and current_donation().updates and writable_in_place(leaves):
            torch._foreach_zero_(leaves)
            return updates, state
        return pytree.tree_map(torch.zeros_like, updates), state

    return GradientTransformation(_stateless, update)


def scale(factor: float) -> GradientTransformation:
    """Multiply every update by a constant ``factor``.

    Example:
        >>> chain(clip_by_global_norm(1.0), scale(-0.1))   # plain SGD with lr 0.1
    """
    check_scalar(factor, "factor", low=-float("inf"))
    factor = float(factor)

    def update(updates, state, params=None):
        leaves, treedef = flatten_tensors(updates, "updates")
        return pytree.tree_unflatten(treedef, _scaled(leaves, factor)), state

    return GradientTransformation(_stateless, update)


def scale_by_schedule(schedule: Schedule) -> GradientTransformation:
    """Multiply updates by ``schedule(count)``, ``count`` being the updates done so far.

    Args:
        schedule: ``schedule(step) -> float | scalar tensor`` (see ``optim.schedules``).

    Returns:
        A transform with state :class:`ScaleByScheduleState`.

    Example:
        >>> lr = schedules.warmup_cosine_decay(1.0, 100, 1000)
        >>> chain(clip_by_global_norm(1.0), scale(-1e-3), scale_by_schedule(lr))
    """
    if not callable(schedule):
        raise TypeError(f"scale_by_schedule: schedule must be callable, got {schedule!r}")

    def init(params):
        return ScaleByScheduleState(count=zero_count())

    def update(updates, state, params=None):
        factor = resolve_scalar(schedule, state.count)
        leaves, treedef = flatten_tensors(updates, "updates")
        new = _scaled(leaves, factor)
        return pytree.tree_unflatten(treedef, new), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def _scaled(leaves: list[torch.Tensor], factor: Any) -> list[torch.Tensor]:
    """``leaves * factor``: in place when the updates are donated, else new tensors.

    Non-floating leaves get zero updates of their dtype (they are frozen)."""
    def frozen(i):
        return (frozen_zero(leaves[i]),)

    if leaves and current_donation().updates and writable_in_place(leaves):
        def scale_(us):
            torch._foreach_mul_(us, factor)
            return (us,)

        return foreach_floating(scale_, [leaves], 1, frozen)[0]
    return foreach_floating(lambda us: (torch._foreach_mul(us, factor),), [leaves], 1, frozen)[0]
