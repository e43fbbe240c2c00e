"""Small pieces the call layer of `shard_params` is built from: argument trees taken
apart for ``autograd.Function`` s, plain tensors, module calls, recorded vjps.

Example:
    >>> spec, tensors = TreeSpec.of((args, kwargs))
    >>> args, kwargs = spec.build(tensors)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn._functional_swap import call_module as swap_call
from shardfn._torch_internals import temporarily_clear_interpreter_stack, unwrap_functorch
from shardfn.transforms.shard_params.exchange import no_functorch
from shardfn.transforms.shard_params.plan import Unit

__all__ = ["TreeSpec", "arguments_signature", "call_module", "check_arguments_kept",
           "detached", "float_outputs", "is_float", "plain", "recorded_vjp"]

Params = dict[str, torch.Tensor]


class TreeSpec(NamedTuple):
    """A pytree with its tensor leaves taken out (they travel through autograd.Functions).

    Taken apart with :func:`shardfn.pytree.tree_flatten_deep`: dataclasses (HF's
    ``ModelOutput``), Mapping/Sequence subclasses and attribute objects are entered too, so
    no tensor stays inside a constant (it would get no gradient); one that cannot be
    rebuilt raises ``TypeError`` naming its type.
    """

    treedef: Any
    is_tensor: tuple[bool, ...]
    constants: tuple[Any, ...]  # the non-tensor leaves

    @staticmethod
    def of(tree: Any) -> tuple[TreeSpec, list[torch.Tensor]]:
        """The spec of ``tree`` and its tensor leaves, in order."""
        leaves, treedef = pytree.tree_flatten_deep(tree)
        is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
        constants = tuple(x for x, t in zip(leaves, is_tensor, strict=True) if not t)
        return TreeSpec(treedef, is_tensor, constants), [x for x in leaves if
                                                           isinstance(x, torch.Tensor)]

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The tree again, with ``tensors`` as its tensor leaves."""
        tensors, constants = iter(tensors), iter(self.constants)
        leaves = [next(tensors) if t else next(constants) for t in self.is_tensor]
        return pytree.tree_unflatten_deep(self.treedef, leaves)


def call_module(unit: Unit, params: Params, args: tuple, kwargs: dict) -> Any:
    """Run ``unit.module`` on ``params`` (by the module's own names), as ``functional_call``
    with tied weights and strict names, the leaves swapped into the skeleton
    (:func:`shardfn._functional_swap.call_module`)."""
    return swap_call(unit.module, params, args, kwargs)


def arguments_signature(tree: Any) -> tuple:
    """The tensors of a call's arguments, by identity and shape (see
    :func:`check_arguments_kept`)."""
    return tuple((id(t), tuple(t.shape)) for t in pytree.tree_leaves_deep(tree)
                 if isinstance(t, torch.Tensor))


def check_arguments_kept(label: str, before: tuple, tree: Any) -> None:
    """Refuse a call that changed the containers of its arguments in place (a tensor put
    into, or taken out of, an argument object: HF's ``DynamicCache``).

    A unit's backward recomputes it from its arguments as they were, and a recompute of
    the root replays the unit calls without their side effects, so such a change would
    be made twice, or not at all, and the output or gradients would differ.

    Raises:
        ValueError: naming the call and what changed.
    """
    after = arguments_signature(tree)
    if after == before:
        return
    kinds = sorted({type(x).__qualname__ for x in pytree.tree_leaves(tree)
                    if not isinstance(x, torch.Tensor | int | float | bool | str | type(None))})
    raise ValueError(
        f"shard_params: {label} changed its arguments in place ({len(before)} tensors in them "
        f"before the call, {len(after)} after; argument types {kinds[:6]}); its backward "
        f"recomputes it from the arguments as they were, so an in-place update would be lost "
        f"or made twice. Return new values instead; for Hugging Face models pass "
        f"use_cache=False (as HF does under gradient checkpointing), or make this module part "
        f"of a larger unit (units=[...]) that creates and consumes the cache itself")


def plain(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Strip functorch wrappers (saved tensors of a finished vjp level would trip its asserts)."""
    return [None if t is None else unwrap_functorch(t).detach() for t in tensors]


def is_float(x: torch.Tensor) -> bool:
    """Whether ``x`` can carry a gradient (floating or complex)."""
    return x.is_floating_point() or x.is_complex()


def float_outputs(out: Any, outputs_float: Sequence[bool]) -> tuple[torch.Tensor, ...]:
    """The tensors of ``out`` whose flag in ``outputs_float`` is set."""
    tensors = [x for x in pytree.tree_leaves_deep(out) if isinstance(x, torch.Tensor)]
    return tuple(x for x, f in zip(tensors, outputs_float, strict=True) if f)


def detached(tree: Any) -> Any:
    """``tree`` with every tensor detached."""
    return pytree.tree_map_deep(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def recorded_vjp(out: Any, groups: tuple[Mapping, ...]) -> Callable:
    """The vjp of a recorded autograd graph from the floating tensors of ``out`` to the
    tensors of ``groups`` (mappings key -> leaf requiring grad).

    Returns ``fn(cotangents) -> tuple of {key: grad}`` (one per group, zeros where
    unused), like ``torch.func.vjp`` of the same computation. It runs plain autograd
    with functorch disabled, so it may be called inside a ``torch.func`` transform's
    backward; it frees the graph.
    """
    outs = [o for o in pytree.tree_leaves_deep(out) if isinstance(o, torch.Tensor) and is_float(o)]
    inputs = [t for group in groups for t in group.values()]

    def vjp_fn(cotangents: Sequence[torch.Tensor]) -> tuple[dict, ...]:
        pairs = [(o, g) for o, g in zip(outs, cotangents, strict=True) if o.requires_grad]
        grads: Sequence[torch.Tensor | None] = [None] * len(inputs)
        if pairs and inputs:
            # functorch off, and its interpreter stack hidden: an autograd.Function whose
            # backward calls another Function's apply (the collectives') then runs as plain
            # autograd instead of functorch's custom_function_call
            with no_functorch(), temporarily_clear_interpreter_stack():
                grads = torch.autograd.grad([o for o, _ in pairs], inputs,
                                            [g for _, g in pairs], allow_unused=True)
        it = iter(torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g
                  for g, x in zip(grads, inputs, strict=True))
        return tuple({key: next(it) for key in group} for group in groups)

    return vjp_fn
