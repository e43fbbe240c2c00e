"""Loss scaling for fp16 training: a pure dynamic loss scaler and a finite-step guard.

fp16 gradients underflow unless the loss is multiplied by a large factor
before differentiation and the gradients divided by it afterwards. The dynamic
scaler (``torch.amp.GradScaler`` / FairScale ``ShardedGradScaler`` semantics)
halves the scale when a step produced inf/NaN gradients — skipping that step —
and doubles it after ``growth_interval`` finite steps in a row.

With sharded gradients every rank sees only its shard, so the inf/NaN check is
reduced over every mesh axis the gradients are split over (``axes=``): one
overflowing shard skips the step on all ranks together and their scales stay
equal.

State is a NamedTuple of tensors, so it is saved and restored with the rest.

Example:
    >>> scaler = dynamic_loss_scale(init_scale=2.0**16)
    >>> sstate = scaler.init()
    >>> grads = torch.func.grad(lambda p: scaler.scale(loss_fn(p, batch), sstate))(params)
    >>> finite = all_finite(grads, axes="dp", mesh=mesh)
    >>> grads = scaler.unscale(grads, sstate)
    >>> updates, opt_state = skip_nonfinite(opt).update(grads, opt_state, params, finite=finite)
    >>> sstate = scaler.update(sstate, finite)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh
from shardfn.optim._compose import is_sharded
from shardfn.optim.base import GradientTransformation

__all__ = [
    "LossScaler",
    "ScaleState",
    "all_finite",
    "dynamic_loss_scale",
    "skip_nonfinite",
    "static_loss_scale",
]


class ScaleState(NamedTuple):
    """State of a loss scaler.

    Attributes:
        scale: float32 scalar, the current loss scale.
        good_steps: int64 scalar, finite steps since the last change of scale.
    """

    scale: torch.Tensor
    good_steps: torch.Tensor


class LossScaler(NamedTuple):
    """A pure loss scaler.

    Attributes:
        init: ``init() -> ScaleState``.
        scale: ``scale(loss, state) -> loss * scale``.
        unscale: ``unscale(grads, state) -> grads / scale`` as float32 (master precision:
            unscaled fp16 gradients would underflow again).
        update: ``update(state, finite) -> state`` after a step (``finite``: bool or
            bool tensor, the same on every rank, e.g. from :func:`all_finite`).
    """

    init: Callable[[], ScaleState]
    scale: Callable[[torch.Tensor, ScaleState], torch.Tensor]
    unscale: Callable[[Any, ScaleState], Any]
    update: Callable[[ScaleState, Any], ScaleState]


def _scale(loss: torch.Tensor, state: ScaleState) -> torch.Tensor:
    # type promotion: a 0-dim fp16 loss times the 0-dim float32 scale is float32 (no overflow
    # for scales above the fp16 maximum, 65504); a loss with dims stays fp16 and can overflow
    # to inf, so compute the loss in float32 (Precision(output_dtype=torch.float32))
    return loss * state.scale


def _unscale(grads, state: ScaleState):
    inv = 1.0 / state.scale.to(torch.float32)

    def unscale(g: torch.Tensor) -> torch.Tensor:
        if g.is_floating_point():
            return g.to(torch.float32) * inv
        if g.is_complex():  # at least complex64 (the float32 of a complex leaf)
            return g.to(torch.promote_types(g.dtype, torch.complex64)) * inv
        return g  # non-floating leaves (integer buffers) are frozen: they stay as they are

    return pytree.tree_map(unscale, grads)


def dynamic_loss_scale(init_scale: float = 2.0**16, growth_factor: float = 2.0,
                       backoff_factor: float = 0.5, growth_interval: int = 2000,
                       min_scale: float = 1.0) -> LossScaler:
    """A dynamic loss scaler: back off on overflow, grow after a run of finite steps.

    Args:
        init_scale: the first scale.
        growth_factor: multiply the scale by this after ``growth_interval`` finite steps.
        backoff_factor: multiply the scale by this after a non-finite step.
        growth_interval: finite steps in a row before growing.
        min_scale: the scale never drops below this.

    Returns:
        A :class:`LossScaler`.

    Example:
        >>> scaler = dynamic_loss_scale(init_scale=8.0, growth_interval=2)
        >>> s = scaler.update(scaler.update(scaler.init(), True), True)
        >>> float(s.scale)
        16.0
    """
    if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
        raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; "
                         f"got {growth_factor}, {backoff_factor}, {growth_interval}")

    def init() -> ScaleState:
        return ScaleState(torch.tensor(float(init_scale)), torch.zeros((), dtype=torch.int64))

    def update(state: ScaleState, finite) -> ScaleState:
        if bool(finite):
            good = state.good_steps + 1
            if int(good) >= growth_interval:
                return ScaleState(state.scale * growth_factor, torch.zeros_like(good))
            return ScaleState(state.scale.clone(), good)
        scale = torch.clamp(state.scale * backoff_factor, min=min_scale)
        return ScaleState(scale, torch.zeros_like(state.good_steps))

    return LossScaler(init, _scale, _unscale, update)


def static_loss_scale(scale: float) -> LossScaler:
    """A loss scaler whose scale never changes.

    Example:
        >>> float(static_loss_scale(128.0).init().scale)
        128.0
    """

    def init() -> ScaleState:
        return ScaleState(torch.tensor(float(scale)), torch.zeros((), dtype=torch.int64))

    def update(state: ScaleState, finite) -> ScaleState:
        return state

    return LossScaler(init, _scale, _unscale, update)


def all_finite(tree, axes: AxisName | tuple[()] = (), *, mesh: Mesh | None = None) -> bool:
    """Whether every leaf is free of inf/NaN on every rank of ``axes``.

    Args:
        tree: a pytree of tensors (e.g. this rank's gradient shards).
        axes: the mesh axes the tree is split (or differs) over; the check is
            reduced over them so every rank gets the same answer. ``()``: local only.
        mesh: overrides the current mesh.

    Returns:
        A Python bool, identical on every rank of ``axes``.

    Example:
        >>> all_finite({"w": torch.tensor([1.0, float("inf")])})
        False
    """
    bad = _nonfinite_count(tree)
    if axes:
        from shardfn.primitives import psum

        with torch.no_grad():
            bad = psum(bad, axes, mesh=mesh)
    return bool(bad == 0)


class _SkipState(NamedTuple):
    inner: Any
    skipped: torch.Tensor  # int64 scalar: steps skipped so far


def _nonfinite_count(tree) -> torch.Tensor:
    """The number of inf/NaN elements of the floating and complex leaves (a CPU float32)."""
    # complex leaves too: torch.isfinite is False where the real or imaginary part is inf/nan
    leaves = [x for x in pytree.tree_leaves(tree)
              if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]
    bad = torch.zeros((), dtype=torch.float32)
    for leaf in leaves:
        bad = bad + (~torch.isfinite(leaf)).sum().to(torch.float32).cpu()
    return bad


def _finite_on_every_rank(grads) -> bool:
    """:func:`all_finite` of this rank's ``grads``, summed over the default process group
    (every process gets the same answer; local when torch.distributed is not initialised)."""
    bad = _nonfinite_count(grads)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        nccl = dist.get_backend() == "nccl"
        on_device = bad.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        with torch.no_grad():
            dist.all_reduce(on_device)
        bad = on_device.cpu()
    return bool(bad == 0)


def skip_nonfinite(opt: GradientTransformation) -> GradientTransformation:
    """Wrap ``opt`` so a step with non-finite gradients changes nothing.

    ``update(grads, state, params, finite=...)``: when ``finite`` is False the
    updates are zeros and the wrapped state is returned unchanged (so moments and
    step counts do not advance), like ``GradScaler.step`` skipping
    ``optimizer.step()``. ``finite`` defaults to a check that every process agrees on:
    this rank's inf/NaN count summed over the whole default process group (one scalar
    all-reduce per step, as FSDP's ``ShardedGradScaler`` does), so whatever the
    gradients are (shard_params or tensor_split shards, pipeline stages, a
    ``shard_opt_state`` part) one rank's inf skips the step on every rank, and none
    skips a collective the others enter. Pass ``finite=`` (e.g. :func:`all_finite`
    over chosen axes) to agree over fewer ranks. ``skip_nonfinite(shard_opt_state(opt,
    mesh, "dp"))`` composes by type: it *is* ``shard_opt_state(skip_nonfinite(opt),
    mesh, "dp")`` (one sharded optimizer, so ``chain(clip,
    skip_nonfinite(shard_opt_state(...)))`` still clips the reduced gradients, issue
    #23). Extra keywords (``weight=``) are passed to ``opt.update``.

    Args:
        opt: the optimizer to guard.

    Returns:
        A :class:`GradientTransformation` whose state counts skipped steps.

    Example:
        >>> opt = skip_nonfinite(sf.optim.adamw(1e-3))
    """

    if is_sharded(opt):  # the check goes inside the one sharded optimizer
        return opt.rewrap(skip_nonfinite(opt.inner))

    def init(params) -> _SkipState:
        return _SkipState(opt.init(params), torch.zeros((), dtype=torch.int64))

    def update(grads, state: _SkipState, params=None, *, finite=None, **kwargs):
        if finite is None:
            finite = _finite_on_every_rank(grads)
        if not bool(finite):
            # zero updates shaped like the params (grads may be reduced pieces, ReducedGrads)
            zeros = pytree.tree_map(torch.zeros_like, grads if params is None else params)
            return zeros, _SkipState(state.inner, state.skipped + 1)
        updates, inner = opt.update(grads, state.inner, params, **kwargs)
        return updates, _SkipState(inner, state.skipped.clone())

    return GradientTransformation(init, update)
