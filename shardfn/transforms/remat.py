"""`remat`: activation rematerialisation that works under torch.func and torch.autograd.

``remat(fn, policy)`` returns a function with ``fn``'s values and gradients whose
backward recomputes ``fn`` instead of keeping its intermediates. It is one
``autograd.Function`` (forward + ``setup_context`` style, so ``torch.func.grad``,
``grad_and_value``, ``vjp`` and ``vmap`` accept it):

The two dispatch modes are :mod:`shardfn.transforms.recording`'s (shared with
``shard_params``), which documents how ops are recorded and matched:

* **forward** runs ``fn`` under ``no_grad`` inside a *recording* dispatch mode.
  The policy looks at every op; the outputs of the ops it saves are kept (moved
  to CPU first for offloaded ones). The tensor inputs are saved for backward and
  the RNG state (CPU, and CUDA for the inputs' devices) is remembered.
* **backward** restores that RNG state and recomputes ``fn`` (plain autograd:
  ``enable_grad`` + ``torch.autograd.grad``, as ``torch.utils.checkpoint``; under
  torch.func: ``torch.func.vjp``) inside a *replay* dispatch mode: each saved op
  returns its saved output instead of running, every other op runs again. Ops are
  matched by (op, how many times it ran before) and checked by input shapes, so a
  recomputation that takes another path raises instead of replaying wrong values.
  First-order gradients are autograd's bit for bit, under torch.func too.

Policies use JAX's names (``checkpoint_policies``). A policy is a function
``policy(op, name) -> bool | Offload``: ``op`` is the aten op, ``name`` is ``None``
or the tag given with :func:`checkpoint_name`; ``True`` saves the output,
``False`` recomputes it, ``Offload(device)`` saves it on ``device``.
Never saved: view and in-place ops, ops whose output aliases an input, random
ops (so the RNG stream of the recomputation matches the forward's), and outputs
mutated in place later in the forward.

Memory: the inputs plus what the policy saves, kept from forward to backward,
and one recomputation of ``fn``'s intermediates in flight during its backward.
Compute: one extra forward of ``fn`` minus the saved ops. Communication:
collectives inside ``fn`` run again in the recomputation unless their outputs are saved.
Under ``torch.func.grad``/``vjp`` (which differentiate with create_graph=True)
the backward detaches its recomputation from the outer graph, so recomputed
values are freed block by block; when an outer transform or create_graph=True
may differentiate again it keeps the graph, and grad of grad is exact.
Autocast: the recomputation replays the autocast state ``fn`` was called under
(:mod:`shardfn.primitives.autocast_state`), whatever state the backward runs in;
autocast's casts are not counted for replay (its weight cache skips some), and
its cached casts of arguments are not closures.
Arguments ``fn`` updates in place (BatchNorm's running stats, ``num_batches_tracked``)
are updated once, by the forward; the recomputation starts from a copy of their
value before it and updates a fresh clone.
Limits: ``fn`` must be a pure function of its arguments: tensors it reads from
a closure get no gradient (under plain autograd a closed-over tensor that
requires grad raises). Forward-mode AD (jvp, hessian) calls ``fn`` directly.
See docs/remat.md.

Example:
    >>> block = sf.remat(mlp_block, policy=sf.checkpoint_policies.dots_saveable)
    >>> grads = torch.func.grad(lambda p, x: block(p, x).sum())(params, x)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shardfn import _functional_swap, pytree
from shardfn import _torch_internals as ti
from shardfn.primitives import autocast_state
from shardfn.transforms import recording
from shardfn.transforms.recording import CASTS, Offload, Policy, Recorder, Replayer, Saved
from shardfn.transforms.remat_model import RematModel, is_model, remat_model, rematerialise_with

__all__ = [
    "Offload",
    "checkpoint_name",
    "checkpoint_policies",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload",
    "offload_dot_with_no_batch_dims",
    "remat",
    "save_and_offload_only_these_names",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
]

aten = torch.ops.aten

# ----------------------------------------------------------------------------- policies
DOT_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.addbmm.default, aten.mv.default, aten.addmv.default, aten.dot.default,
    aten.vdot.default, aten.linear.default, aten.matmul.default, aten.convolution.default,
    aten._convolution.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
})
NO_BATCH_DOT_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.mv.default, aten.addmv.default,
    aten.dot.default, aten.vdot.default,
})


def nothing_saveable(op, name: str | None) -> bool:
    """Save nothing: recompute the whole function (the default)."""
    return False


def everything_saveable(op, name: str | None) -> bool:
    """Save every op output: no recomputation (more memory than plain autograd)."""
    return True


def dots_saveable(op, name: str | None) -> bool:
    """Save the outputs of matmul-like ops (mm, addmm, bmm, linear, conv, attention)."""
    return op in DOT_OPS


def dots_with_no_batch_dims_saveable(op, name: str | None) -> bool:
    """Save the outputs of 2-D matmuls (mm, addmm, mv, dot); recompute bmm and the rest."""
    return op in NO_BATCH_DOT_OPS


def save_only_these_names(*names: str) -> Policy:
    """Save only values tagged with :func:`checkpoint_name` under one of ``names``."""
    wanted = frozenset(names)
    return lambda op, name: name in wanted


def save_anything_except_these_names(*names: str) -> Policy:
    """Save every op output except the values tagged with one of ``names``."""
    excluded = frozenset(names)
    return lambda op, name: name not in excluded


def save_and_offload_only_these_names(*, names_which_can_be_saved=(),
                                      names_which_can_be_offloaded=(),
                                      offload_device: str = "cpu") -> Policy:
    """Save some tagged values, offload others to ``offload_device``, recompute the rest."""
    saved, offloaded = frozenset(names_which_can_be_saved), frozenset(names_which_can_be_offloaded)
    if saved & offloaded:
        raise ValueError(f"names both saved and offloaded: {sorted(saved & offloaded)}")

    def policy(op, name):
        return True if name in saved else Offload(offload_device) if name in offloaded else False

    return policy


def offload(policy: Policy, device: str = "cpu") -> Policy:
    """``policy``, but every value it saves is offloaded to ``device`` instead."""

    def offloaded(op, name):
        decision = policy(op, name)
        return Offload(device) if decision is True else decision

    return offloaded


def offload_dot_with_no_batch_dims(device: str = "cpu") -> Policy:
    """Offload the outputs of 2-D matmuls to ``device`` (JAX's offload_dot_with_no_batch_dims)."""
    return offload(dots_with_no_batch_dims_saveable, device)


def save_from_both_policies(first: Policy, second: Policy) -> Policy:
    """Save what either policy saves (``first``'s answer wins when both save)."""
    return lambda op, name: first(op, name) or second(op, name)


class _Policies(NamedTuple):
    nothing_saveable: Policy = nothing_saveable
    everything_saveable: Policy = everything_saveable
    dots_saveable: Policy = dots_saveable
    checkpoint_dots: Policy = dots_saveable
    dots_with_no_batch_dims_saveable: Policy = dots_with_no_batch_dims_saveable
    save_only_these_names: Callable[..., Policy] = save_only_these_names
    save_anything_except_these_names: Callable[..., Policy] = save_anything_except_these_names
    save_and_offload_only_these_names: Callable[..., Policy] = save_and_offload_only_these_names
    offload: Callable[..., Policy] = offload
    offload_dot_with_no_batch_dims: Callable[..., Policy] = offload_dot_with_no_batch_dims
    save_from_both_policies: Callable[..., Policy] = save_from_both_policies


checkpoint_policies = _Policies()
"""The policies, under JAX's ``jax.checkpoint_policies`` names."""

# ----------------------------------------------------------------------------- tags
def checkpoint_name(x: Any, name: str) -> Any:
    """Tag ``x`` (a tensor or pytree of tensors) as ``name`` for remat policies; returns ``x``.

    Under :func:`remat` with ``save_only_these_names(name)`` (or another
    name-based policy) the op that produced ``x`` is saved, not recomputed.
    Elsewhere it is the identity.

    Example:
        >>> h = sf.checkpoint_name(torch.relu(x @ w), "hidden")
    """
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name: name must be a string, got {name!r}")
    recording.tag(x, name, leaves=pytree.tree_leaves_deep)
    return x


# ----------------------------------------------------------------------------- the Function
def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _higher_order_possible(tensors) -> bool:
    """Whether something may differentiate this backward (grad of grad, create_graph=True).

    torch.func.grad and vjp always differentiate with create_graph=True; keeping that
    graph for a remat backward would hold every recomputed value until the end.
    """
    stack = ti.get_interpreter_stack()
    if stack:  # the innermost is the transform running this backward
        return any(i.key() in (ti.TransformType.Grad, ti.TransformType.Jvp) for i in stack[:-1])
    return torch.is_grad_enabled() and any(recording.base_tensor(t).requires_grad for t in tensors)


class _Call:
    """One call of a remat'ed function: how to rebuild its arguments, what forward saved."""

    def __init__(self, fn: Callable, policy: Policy, args: tuple, kwargs: dict):
        leaves, self.treedef = pytree.tree_flatten_deep((args, kwargs))
        self.positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.tensors = [leaves[i] for i in self.positions]
        self.static = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.fn, self.policy = fn, policy
        self.autocast = autocast_state.capture()  # recomputation replays the forward's state
        self.uncounted = CASTS if self.autocast.any_enabled else frozenset()
        self.saved: dict[tuple, Saved] = {}
        self.mutated: dict[int, torch.Tensor] = {}  # input index -> its value before forward
        self.rng: recording.RngState | None = None
        self.out_treedef = None
        self.out_static: list = []
        self.out_positions: list[int] = []
        self.out_differentiable: list[bool] = []

    def run(self, tensors) -> Any:
        leaves = list(self.static)
        for position, t in zip(self.positions, tensors, strict=True):
            leaves[position] = t
        args, kwargs = pytree.tree_unflatten_deep(self.treedef, leaves)
        return self.fn(*args, **kwargs)

    def flatten_output(self, out) -> tuple[torch.Tensor, ...]:
        leaves, self.out_treedef = pytree.tree_flatten_deep(out)
        self.out_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.out_static = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        tensors = tuple(leaves[i] for i in self.out_positions)
        self.out_differentiable = [_differentiable(t) for t in tensors]
        return tensors

    def output_tensors(self, out) -> list[torch.Tensor]:
        leaves = pytree.tree_leaves_deep(out)
        return [leaves[i] for i in self.out_positions]

    def unflatten_output(self, tensors) -> Any:
        leaves = list(self.out_static)
        for position, t in zip(self.out_positions, tensors, strict=True):
            leaves[position] = t
        return pytree.tree_unflatten_deep(self.out_treedef, leaves)


def _storage(t: torch.Tensor) -> int:
    return recording.storage_ptr(recording.base_tensor(t))


def _check_writes_seen(tensors, versions, mutated) -> None:
    """Refuse an argument changed in place by an op that remat could not see coming."""
    kept = {_storage(tensors[i]) for i in mutated}  # views share a version counter
    for index, (t, version) in enumerate(zip(tensors, versions, strict=True)):
        if t._version != version and index not in mutated and _storage(t) not in kept:
            raise ValueError(
                f"remat: the function changed its tensor argument {index} (shape "
                f"{tuple(t.shape)}, {t.dtype}) in place with an op that does not declare the "
                "write, so the recomputation cannot start from its value before the forward; "
                "update a copy instead (x = x + ...)")


def _recompute_vjp(call: _Call, recompute: Callable, primals: list, cotangents: tuple,
                   keep_graph: bool) -> list:
    """The gradients of ``recompute``'s outputs, run from the forward's RNG and autocast
    state, with respect to ``primals`` for ``cotangents`` (None where unused).

    Under plain autograd with nothing to differentiate this backward again it is
    ``torch.utils.checkpoint``'s recipe: recompute on detached leaves under
    ``enable_grad`` and ``torch.autograd.grad`` them, so autograd's own first-order
    formulas run (bit for bit its gradients; also an ``autograd.Function`` without
    ``setup_context``). Under a torch.func transform, or when a second derivative may be
    taken, ``torch.func.vjp``; with ``create_graph=False`` unless a higher order is
    possible, so its formulas are still the first-order ones (``silu``'s backward,
    e.g., rounds otherwise).
    """
    if keep_graph or ti.get_interpreter_stack():
        with recording.replay_rng(call.rng), call.autocast.replay():
            _, vjp_fn = torch.func.vjp(recompute, *primals)
        return list(vjp_fn(cotangents, create_graph=keep_graph))
    leaves = [t.detach().requires_grad_() for t in primals]
    with recording.replay_rng(call.rng), call.autocast.replay(), torch.enable_grad():
        outs = recompute(*leaves, fresh=True)
    pairs = [(o, g) for o, g in zip(outs, cotangents, strict=True) if o.requires_grad]
    if not pairs:
        return [None] * len(leaves)
    return list(torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                    allow_unused=True))


class _RematFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors):
        call.rng = recording.rng_state(tensors)
        recorder = Recorder(call.policy, list(tensors), uncounted=call.uncounted)
        versions = [t._version for t in tensors]
        with torch.no_grad(), recorder:
            out = call.run(tensors)
        call.saved = recorder.finish()
        call.mutated = recorder.mutated
        _check_writes_seen(tensors, versions, call.mutated)
        # an argument returned as it is leaves as a view of it (autograd refuses to save
        # for backward a tensor that is also an output, as torch.utils.checkpoint avoids)
        arguments = {id(t) for t in tensors}
        return tuple(o.view_as(o) if id(o) in arguments else o
                     for o in call.flatten_output(out))

    @staticmethod
    def setup_context(ctx, inputs, output):
        call: _Call = inputs[0]
        ctx.call = call
        # an argument fn updated in place (num_batches_tracked += 1) is rebuilt from its
        # value before the forward; unless differentiated it is not kept a second time (so
        # the caller may update it again before this backward, as plain BatchNorm allows)
        ctx.save_for_backward(*(
            None if i in call.mutated and not (ctx.needs_input_grad[i + 1] and _differentiable(t))
            else t
            for i, t in enumerate(inputs[1:])))
        constant = [o for o in output if not _differentiable(o)]
        if constant:
            ctx.mark_non_differentiable(*constant)

    @staticmethod
    def backward(ctx, *grads):
        call: _Call = ctx.call
        tensors = list(ctx.saved_tensors)
        present = [t for t in tensors if t is not None]
        keep_graph = _higher_order_possible(present)
        if not keep_graph:  # else the outer create_graph would keep every recomputed value
            tensors = [None if t is None else t.detach() for t in tensors]
        wrt = [i for i, t in enumerate(tensors)
               if ctx.needs_input_grad[i + 1] and t is not None and _differentiable(t)]
        outs = [i for i, g in enumerate(grads) if g is not None and call.out_differentiable[i]]

        def recompute(*inputs, fresh: bool = False):
            full = list(tensors)
            for i, t in zip(wrt, inputs, strict=True):
                full[i] = t
            for i, before in call.mutated.items():  # fn updates a fresh copy, not the caller's
                now = full[i]  # (a differentiated one: the value before, the gradient to now)
                full[i] = before.clone() if now is None else before + (now - now.detach())
            with Replayer(call.saved, uncounted=call.uncounted, fresh=fresh):
                out = call.output_tensors(call.run(full))
            return tuple(out[i] for i in outs)

        input_grads: list = [None] * len(tensors)
        if wrt and outs:
            cotangents = tuple(grads[i] if keep_graph else grads[i].detach() for i in outs)
            grads_in = _recompute_vjp(call, recompute, [tensors[i] for i in wrt], cotangents,
                                      keep_graph)
            for i, g in zip(wrt, grads_in, strict=True):
                input_grads[i] = g
        call.saved = {}  # free early; a second backward (retain_graph) recomputes everything
        # (call.mutated stays: a second backward must rebuild the same arguments)
        return (None, *input_grads)


# ----------------------------------------------------------------------------- remat
def remat(fn: Callable | Any, policy: Policy = nothing_saveable) -> Callable | RematModel:
    """Wrap ``fn`` so that its backward recomputes its intermediates (activation checkpointing).

    Works under ``torch.func.grad`` / ``grad_and_value`` / ``vjp`` / ``vmap`` and
    plain ``torch.autograd``; gradients flow to every floating tensor leaf of the
    arguments (params dicts, activations). Random ops replay the same values.
    Of a model (``init``, ``apply``, ``names``: any kind) it returns a
    :class:`~shardfn.transforms.remat_model.RematModel` whose ``apply`` is
    rematerialised whole (composition by type: docs/composing.md, docs/remat.md).

    Memory per call, from forward to backward: ``fn``'s tensor arguments plus the
    outputs the policy saves; during backward one recomputation of ``fn`` is
    alive. Compute: ``fn``'s forward once more, less the saved ops.
    Communication: that of ``fn``, once more in backward for recomputed collectives.

    Args:
        fn: a pure function of tensors / pytrees of tensors (non-tensor leaves are
            passed through unchanged) returning a tensor or a pytree; or a model.
        policy: which op outputs to keep instead of recomputing, e.g.
            ``checkpoint_policies.dots_saveable``; default: save nothing.

    Returns:
        A function with ``fn``'s signature, values and gradients (a model: the
        ``RematModel``; ``fn`` itself when it is one under ``policy`` already).

    Raises:
        TypeError: ``fn`` is neither callable nor a model, or ``policy`` is not callable.
        ValueError: ``fn`` is a ``RematModel`` under another policy.

    Example:
        >>> def block(p, x):
        ...     return x + torch.tanh(x @ p["w1"]) @ p["w2"]
        >>> fast = sf.remat(block, policy=sf.checkpoint_policies.dots_saveable)
        >>> grads = torch.func.grad(lambda p, x: fast(p, x).sum())(params, x)
        >>> model = sf.remat(sf.functional(net))   # model.apply recomputed in backward
    """
    if not callable(policy):
        raise TypeError(f"remat: policy must be a function (op, name) -> bool | Offload, "
                        f"e.g. checkpoint_policies.dots_saveable; got {policy!r}")
    return remat_model(fn, policy) if is_model(fn) else _remat_function(fn, policy)


def _remat_function(fn: Callable, policy: Policy = nothing_saveable) -> Callable:
    """:func:`remat` of a function."""
    if not callable(fn):
        raise TypeError(f"remat: fn must be callable or a model, got {type(fn).__name__}")

    @functools.wraps(fn)
    def rematerialised(*args, **kwargs):
        call = _Call(fn, policy, args, kwargs)
        if ti.in_transform(ti.TransformType.Jvp):
            return fn(*args, **kwargs)  # forward-mode AD (jvp, jacfwd, hessian): no remat
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in call.tensors)
        if not ti.in_transform(ti.TransformType.Grad) and not needs_grad:
            return fn(*args, **kwargs)  # nothing will differentiate this call
        return call.unflatten_output(_RematFunction.apply(call, *call.tensors))

    return rematerialised


# layers that checkpoint themselves (Hugging Face's gradient_checkpointing_enable()) run as
# remat inside sf.functional / shard_params / tensor_split calls; a RematModel's apply too
_functional_swap.checkpoint_layers_with(_remat_function)
rematerialise_with(_remat_function)
