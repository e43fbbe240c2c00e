"""Hyper-parameters as optimizer state: ``inject_hyperparams`` (optax's).

``inject_hyperparams(adamw)(learning_rate=1e-3, weight_decay=0.1)`` is AdamW whose
numeric hyper-parameters live in its state, as scalar tensors in
``state.hyperparams`` (``{"learning_rate": tensor(0.001), "b1": ..., ...}``). So

* they can be changed between steps by replacing them in the state
  (:func:`set_hyperparams`, or ``state._replace(hyperparams=...)``): the next update
  uses the new values;
* a state saved with ``sf.checkpoint`` and loaded restores them (FairScale OSS's
  ``param_groups`` round trip);
* a schedule is still a schedule: a callable hyper-parameter is evaluated from the
  state's step count on every update and the value used is stored (a value set by
  hand for a scheduled name lasts until the next update).

Every update rebuilds the wrapped optimizer from the stored values (Python doubles:
the values are float64 scalars on the CPU, so ``1e-3`` stays exactly ``1e-3`` and
the updates equal the plain optimizer's bit for bit). Booleans, None and the names in
``static_args`` stay fixed. Under ``shard_opt_state`` the hyper-parameters are
global leaves: replicated, never sharded, saved once.

Example:
    >>> opt = sf.optim.inject_hyperparams(sf.optim.adamw)(learning_rate=1e-3, weight_decay=0.1)
    >>> state = opt.init(params)
    >>> state = sf.optim.set_hyperparams(state, learning_rate=5e-4)
    >>> updates, state = opt.update(grads, state, params)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.optim._compose import is_sharded, marks_full_leaves
from shardfn.optim.base import GradientTransformation, zero_count

__all__ = ["InjectHyperparamsState", "inject_hyperparams", "set_hyperparams"]

PyTree = Any


class InjectHyperparamsState(NamedTuple):
    """State of an :func:`inject_hyperparams` optimizer."""

    count: torch.Tensor  # int64 scalar: number of updates done so far
    hyperparams: dict  # name -> scalar tensor: the values the next update uses
    inner_state: Any  # the wrapped optimizer's state


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: str | Iterable[str] = (),
    hyperparam_dtype: torch.dtype = torch.float64,
) -> Callable[..., GradientTransformation]:
    """Wrap an optimizer factory so its numeric hyper-parameters live in the state.

    Args:
        factory: a function returning a :class:`GradientTransformation`
            (``sf.optim.adamw``, ``sgd``, or your own).
        static_args: names of numeric arguments to keep fixed (not in the state).
        hyperparam_dtype: dtype of floating hyper-parameters in the state (integers are
            int64); float64 keeps Python's values exactly.

    Returns:
        A function with ``factory``'s signature returning a :class:`GradientTransformation`
        with state :class:`InjectHyperparamsState`. Every argument (given or default)
        that is a number or a scalar tensor (not a bool) goes into
        ``state.hyperparams``; a callable is a schedule of the step count whose value is
        stored (as in optax: name other callables, e.g. AdamW's ``mask``, in
        ``static_args``); anything else is passed through unchanged.

    Raises:
        TypeError: from the wrapper, for arguments ``factory`` does not take, a name in
            ``static_args`` it does not have, or a factory that does not return an optimizer
            (a ``shard_opt_state`` one included: shard around the injected optimizer).

    Example:
        >>> lr = sf.optim.schedules.linear_warmup(1e-3, 100)
        >>> opt = sf.optim.inject_hyperparams(sf.optim.adamw)(learning_rate=lr,
        ...                                                   weight_decay=0.1)
        >>> opt = sf.shard_opt_state(opt, mesh, "dp")   # hyper-parameters replicated
    """
    static = (static_args,) if isinstance(static_args, str) else tuple(static_args)
    signature = inspect.signature(factory)
    unknown = [name for name in static if name not in signature.parameters]
    if unknown:
        raise TypeError(f"inject_hyperparams: static_args {unknown} are not parameters of "
                        f"{_name(factory)} (parameters: {list(signature.parameters)})")

    @functools.wraps(factory)
    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        numeric: dict[str, Any] = {}
        schedules: dict[str, Callable] = {}
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if name in static or kind in (inspect.Parameter.VAR_POSITIONAL,
                                          inspect.Parameter.VAR_KEYWORD):
                continue
            if _is_number(value):
                numeric[name] = value
            elif callable(value):
                schedules[name] = value
        integer = {name for name, v in numeric.items() if _is_integer(v)}

        def as_tensor(name: str, value: Any) -> torch.Tensor:
            dtype = torch.int64 if name in integer else hyperparam_dtype
            if isinstance(value, torch.Tensor):
                return value.detach().to(device="cpu", dtype=dtype).reshape(()).clone()
            return torch.tensor(value, dtype=dtype)

        def build(values: dict[str, torch.Tensor]) -> GradientTransformation:
            call = inspect.BoundArguments(signature, dict(bound.arguments))
            for name, value in values.items():
                call.arguments[name] = int(value) if name in integer else float(value)
            opt = factory(*call.args, **call.kwargs)
            if is_sharded(opt):
                raise TypeError(
                    f"inject_hyperparams: {_name(factory)} returned a shard_opt_state optimizer; "
                    "the hyper-parameters would be rebuilt into a new sharding every step. Valid "
                    "order: shard_opt_state(inject_hyperparams(factory)(...), mesh, axis)")
            if not isinstance(opt, GradientTransformation):
                raise TypeError(f"inject_hyperparams: {_name(factory)} returned a "
                                f"{type(opt).__name__}, expected a GradientTransformation")
            return opt

        def values_at(count: torch.Tensor, stored: dict) -> dict[str, torch.Tensor]:
            values = dict(stored)
            for name, schedule in schedules.items():
                value = schedule(count)
                if not _is_number(value):
                    raise TypeError(
                        f"inject_hyperparams: {name}= is callable, so it is taken for a schedule "
                        f"of the step count, but {name}(count) gave a {type(value).__name__}; "
                        f"pass static_args=({name!r},) for a callable that is not a schedule "
                        "(a mask, labels)")
                values[name] = as_tensor(name, value)
            return values

        first = {name: as_tensor(name, v) for name, v in numeric.items()}
        example = build(values_at(zero_count(), first))  # bad values fail here, when built

        def init(params: PyTree) -> InjectHyperparamsState:
            count = zero_count()
            values = values_at(count, first)
            return InjectHyperparamsState(count, values, build(values).init(params))

        def update(updates, state, params=None):
            if not isinstance(state, InjectHyperparamsState):
                raise TypeError(f"inject_hyperparams({_name(factory)}): expected an "
                                f"InjectHyperparamsState from its init, got "
                                f"{type(state).__name__}")
            stored = {name: _checked(name, state.hyperparams.get(name))
                      for name in (*numeric, *schedules)}
            extra = sorted(set(state.hyperparams) - set(stored))
            if extra:
                raise ValueError(f"inject_hyperparams({_name(factory)}): the state has "
                                 f"hyper-parameters {extra} the optimizer does not take "
                                 f"(it takes {sorted(stored)})")
            values = values_at(state.count, stored)
            updates, inner_state = build(values).update(updates, state.inner_state, params)
            return updates, InjectHyperparamsState(state.count + 1, values, inner_state)

        return marks_full_leaves(GradientTransformation(init, update), [example])

    return wrapped


def set_hyperparams(state: PyTree, **values: float | torch.Tensor) -> PyTree:
    """``state`` with the given hyper-parameters replaced in every :class:`InjectHyperparamsState`.

    Finds them however deep (inside ``chain``'s tuple, ``shard_opt_state``'s
    ``ShardedOptState``, ``masked``/``multi_transform`` states); the next update uses
    the new values (a scheduled one until that update recomputes it). The tensors
    keep their dtype; nothing is mutated.

    Args:
        state: an optimizer state (or a tree holding one).
        **values: name -> new value (a number or a scalar tensor).

    Returns:
        The new state.

    Raises:
        ValueError: if no injected state holds one of the names (lists the names held).

    Example:
        >>> state = sf.optim.set_hyperparams(state, learning_rate=1e-4)
        >>> state.hyperparams["learning_rate"]   # for a plain injected optimizer
        tensor(0.0001, dtype=torch.float64)
    """
    found: set[str] = set()
    held: set[str] = set()

    def replace(node: Any) -> Any:
        if not isinstance(node, InjectHyperparamsState):
            return node
        held.update(node.hyperparams)
        new = dict(node.hyperparams)
        for name, value in values.items():
            if name in new:
                found.add(name)
                old = new[name]
                if isinstance(value, torch.Tensor):
                    new[name] = value.detach().to("cpu", old.dtype).reshape(()).clone()
                else:  # a Python number: exactly, in the stored dtype
                    new[name] = torch.tensor(value, dtype=old.dtype)
        return node._replace(hyperparams=new)

    out = pytree.tree_map(replace, state,
                          is_leaf=lambda x: isinstance(x, InjectHyperparamsState))
    missing = sorted(set(values) - found)
    if missing:
        raise ValueError(f"set_hyperparams: no inject_hyperparams state holds {missing} "
                         f"(hyper-parameters found: {sorted(held)})")
    return out


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype != torch.bool
    return isinstance(value, (int, float))


def _is_integer(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex())
    return isinstance(value, int)


def _checked(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = "missing" if value is None else repr(value)
        raise ValueError(f"inject_hyperparams: state.hyperparams[{name!r}] must be a scalar "
                         f"tensor, got {got}")
    return value


def _name(factory: Callable) -> str:
    return getattr(factory, "__name__", type(factory).__name__)
