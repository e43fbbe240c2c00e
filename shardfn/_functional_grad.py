"""``grad_and_value``: ``torch.func.grad_and_value`` that runs on the autograd engine when it can.

``torch.func.grad_and_value`` takes its gradient with ``autograd.grad(...,
create_graph=True)`` (so that transforms can nest): the backward then records a
graph of its own and keeps every tensor the forward saved alive until the call
returns, and every op of the step goes through functorch's wrappers. For a
training step that is the outermost transform none of that is needed.
:func:`grad_and_value` has the same signature and results; called outside any
functorch transform (and outside ``torch.compile``) it detaches the
differentiated arguments' leaves, makes them require grad, runs ``fn`` under
``enable_grad`` and takes a first-order ``torch.autograd.grad``, which frees each
saved tensor as soon as the backward has used it. Inside ``vmap``/``grad``/``vjp``
or while compiling, it is ``torch.func.grad_and_value`` itself.

shardfn's collectives are ``autograd.Function``s correct under both (see
``shardfn/primitives``), so a step is the same function either way.

Example:
    >>> import shardfn as sf
    >>> fm = sf.functional(torch.nn.Linear(3, 1))
    >>> params = fm.init(0)
    >>> x = torch.randn(4, 3)
    >>> grads, loss = grad_and_value(lambda p, x: fm.apply(p, x).square().mean())(params, x)
    >>> sorted(grads)
    ['bias', 'weight']
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad_and_value as functorch_grad_and_value

from shardfn._torch_internals import get_interpreter_stack, torch_tree_flatten, torch_tree_unflatten

__all__ = ["check_argnums", "detached_inputs", "engine_usable", "grad_and_value", "results",
           "split_output"]


def engine_usable() -> bool:
    """No functorch transform active and not tracing for ``torch.compile`` (asked first:
    dynamo cannot trace the interpreter-stack query, and needs no graph break for it)."""
    return not torch.compiler.is_compiling() and not get_interpreter_stack()


def grad_and_value(fn: Callable, argnums: int | tuple[int, ...] = 0,
                   has_aux: bool = False) -> Callable:
    """``torch.func.grad_and_value(fn, argnums, has_aux)``, first order on the autograd engine.

    Outside any functorch transform the gradient is taken by ``torch.autograd.grad``
    with ``create_graph=False`` on detached copies (views) of the differentiated
    arguments' leaves: the same values as ``torch.func``, fewer tensors alive during
    the backward and no per-op functorch wrapping. Inside a transform or under
    ``torch.compile`` it calls ``torch.func.grad_and_value``.

    Args:
        fn: returns a scalar tensor (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which positional argument(s) to differentiate (pytrees of float tensors).
        has_aux: ``fn`` returns ``(value, aux)``; aux comes back detached.

    Returns:
        A function returning ``(grads, value)`` or ``(grads, (value, aux))``; ``grads``
        has the structure of the differentiated argument (a tuple of them for a tuple
        ``argnums``).

    Example:
        >>> g, v = grad_and_value(lambda w, x: (w * x).sum())(torch.ones(2), torch.arange(2.))
        >>> g, v
        (tensor([0., 1.]), tensor(1.))
    """
    functorch_version = functorch_grad_and_value(fn, argnums=argnums, has_aux=has_aux)
    check_argnums(argnums)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any):
        if not engine_usable():
            return functorch_version(*args, **kwargs)
        args, inputs, specs = detached_inputs(args, argnums)
        with torch.enable_grad():
            out = fn(*args, **kwargs)
        value, aux = split_output(out, has_aux)
        if value.requires_grad:
            grads = torch.autograd.grad(value, inputs, allow_unused=True,
                                        materialize_grads=True)
        else:  # the value does not depend on the arguments
            grads = tuple(torch.zeros_like(t) for t in inputs)
        return results(list(grads), specs, argnums, value, aux, has_aux)

    return call


def check_argnums(argnums: Any) -> tuple[int, ...]:
    """``argnums`` as a tuple of ints; TypeError for anything else (torch.func's rule)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(n, int) for n in nums):
        raise TypeError(f"grad_and_value: argnums must be an int or a non-empty tuple of ints, "
                        f"got {argnums!r}")
    return nums


def detached_inputs(args: tuple, argnums: int | tuple[int, ...]
                    ) -> tuple[list, list[torch.Tensor], list[tuple[Any, int]]]:
    """The arguments with every differentiated leaf replaced by a detached leaf requiring grad.

    Args:
        args: the positional arguments of the call.
        argnums: which of them are differentiated.

    Returns:
        ``(args, inputs, specs)``: the new argument list, the new leaves in order (torch
        pytree order, argument by argument) and per differentiated argument its tree spec
        and number of leaves (for :func:`results`).

    Raises:
        ValueError: an argnum out of range; TypeError: a leaf that is not a floating tensor.
    """
    nums = check_argnums(argnums)
    if max(nums) >= len(args) or min(nums) < -len(args):
        raise ValueError(f"grad_and_value: argnums {argnums!r} out of range for "
                         f"{len(args)} positional arguments")
    args_out = list(args)
    specs, inputs = [], []
    for n in nums:
        leaves, spec = torch_tree_flatten(args_out[n])
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                what = (f"a tensor of dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor)
                        else f"a {type(leaf).__name__}")
                raise TypeError(f"grad_and_value: argument {n} must be a pytree of floating "
                                f"point tensors, got a leaf that is {what}")
        mine = [leaf.detach().requires_grad_() for leaf in leaves]
        args_out[n] = torch_tree_unflatten(mine, spec)
        specs.append((spec, len(mine)))
        inputs += mine
    return args_out, inputs, specs


def results(grads: list[torch.Tensor], specs: list[tuple[Any, int]],
            argnums: int | tuple[int, ...], value: torch.Tensor, aux: Any, has_aux: bool):
    """``(grads, value)`` or ``(grads, (value, aux))`` as ``torch.func.grad_and_value`` gives
    them: ``grads`` (one per input of :func:`detached_inputs`, in order) rebuilt into the
    differentiated arguments' trees, value and aux detached."""
    trees, start = [], 0
    for spec, count in specs:
        trees.append(torch_tree_unflatten(grads[start:start + count], spec))
        start += count
    result = trees[0] if isinstance(argnums, int) else tuple(trees)
    value = value.detach()
    if has_aux:
        leaves, spec = torch_tree_flatten(aux)
        aux = torch_tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t
                                    for t in leaves], spec)
        return result, (value, aux)
    return result, value


def split_output(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """``(value, aux)`` of ``fn``'s output, with torch.func's errors."""
    aux = None
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise RuntimeError("grad_and_value(f)(*args): output of function f should be a "
                               "tuple: (output, aux) if has_aux is True")
        out, aux = out
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"grad_and_value(f)(*args): Expected f(*args) to return a Tensor, "
                           f"got {type(out)}")
    if out.dim() != 0:
        raise RuntimeError(f"grad_and_value(f)(*args): Expected f(*args) to return a scalar "
                           f"Tensor, got tensor with {out.dim()} dims. Maybe you wanted to use "
                           f"the vjp or jacrev APIs instead?")
    return out, aux
