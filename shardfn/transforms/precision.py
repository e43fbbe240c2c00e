"""Mixed precision: a policy (FSDP2 ``MixedPrecisionPolicy`` semantics) and its model wrapper.

The master parameters and the optimizer state stay in full precision (the
dtype ``init`` gives, usually float32). A :class:`Precision` policy says what
the step computes and communicates in:

* ``param_dtype`` — floating parameters are cast to it once per step (per unit
  under ``shard_params``, *before* the all-gather, so bf16 halves its bytes) and
  the forward computes in it; gradients flow back through the cast and arrive
  in the master dtype.
* ``reduce_dtype`` — gradients are reduced (all-reduce / reduce-scatter) in it
  and cast back to the master dtype after; ``data_parallel``,
  ``shard_opt_state`` and ``shard_params`` take ``precision=``. Default (None):
  under ``shard_params`` the ``param_dtype`` (FSDP2's default: a unit's gradient
  is produced in ``param_dtype`` and reduced as it is); under ``data_parallel``
  and ``shard_opt_state`` the gradients' own dtype — with ``with_precision`` they
  reach the reduction already cast back to the master dtype, so it is exact.
* ``output_dtype`` — floating outputs are cast to it (e.g. float32 logits for
  the loss).
* ``cast_inputs`` — floating positional/keyword inputs are cast to
  ``param_dtype``.

Composition (docs/composing.md): ``with_precision`` on either side of ``shard_params``
is ``shard_params(..., precision=policy)``, one model; two different policies on one
model are refused.

Memory: one ``param_dtype`` copy of the parameters in flight (per unit when
sharded). Communication: all-gathers in ``param_dtype``, reductions in
``reduce_dtype``.

Example:
    >>> policy = Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    >>> model = with_precision(sf.functional(net), policy)
    >>> grads = torch.func.grad(loss)(params, batch)   # float32 grads of float32 masters
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn._functional_leaves import refuse_differentiated_state
from shardfn.model import WrapsModel
from shardfn.transforms.remat_model import remat_model, split_remat

__all__ = ["Precision", "cast_floating", "split_precision", "takes_precision", "with_precision"]


class _PrecisionFields(NamedTuple):
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_inputs: bool = True


class Precision(_PrecisionFields):
    """A mixed-precision policy; ``None`` fields leave dtypes as they are.

    Attributes:
        param_dtype: dtype parameters are cast to for compute and all-gather.
        reduce_dtype: dtype gradients are reduced in.
        output_dtype: dtype floating outputs are cast to.
        cast_inputs: cast floating inputs to ``param_dtype``.

    Raises:
        TypeError: if a dtype field is not a ``torch.dtype`` or None.
        ValueError: if a dtype field is not a floating dtype (``torch.int32``, ``torch.bool``
            ...): parameters, reductions and outputs are cast only to floating dtypes.

    Example:
        >>> Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    __slots__ = ()

    def __new__(cls, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None,
                output_dtype: torch.dtype | None = None, cast_inputs: bool = True) -> Precision:
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                            ("output_dtype", output_dtype)):
            if dtype is None:
                continue
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"Precision: {name} must be a torch.dtype or None, got {dtype!r}")
            if not dtype.is_floating_point:
                raise ValueError(f"Precision: {name} must be a floating dtype (e.g. torch.float32, "
                                 f"torch.bfloat16, torch.float16) or None, got {dtype}")
        return super().__new__(cls, param_dtype, reduce_dtype, output_dtype, bool(cast_inputs))


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating tensor leaf of ``tree`` to ``dtype`` (others untouched).

    Differentiable: the gradient comes back in each leaf's original dtype.

    Example:
        >>> cast_floating({"w": torch.ones(2), "i": torch.ones(2, dtype=torch.long)},
        ...               torch.bfloat16)["w"].dtype
        torch.bfloat16
    """
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map_deep(cast, tree)


@dataclasses.dataclass(frozen=True)
class _PrecisionModel(WrapsModel):
    """``with_precision(inner, policy)``: ``apply`` computes under ``policy``; every other
    member of the model protocol (:mod:`shardfn.model`) is ``inner``'s (the leaves, their
    layouts, shard/gather are the master ones), and other attributes pass through."""

    inner: Any
    policy: Precision

    # every other member of the protocol is inner's (shardfn.model.WrapsModel)

    def apply(self, params, *args, mutable: bool = False, **kwargs):
        policy = self.policy  # checked before the cast, which may leave no_grad copies
        refuse_differentiated_state(params, getattr(self.inner, "buffer_names", ()),
                                    getattr(self.inner, "frozen_names", ()),
                                    "with_precision(...).apply")
        given = params
        params = cast_floating(params, policy.param_dtype)
        if policy.cast_inputs:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        if mutable:
            kwargs["mutable"] = True
        out = self.inner.apply(params, *args, **kwargs)
        if not mutable:
            return cast_floating(out, policy.output_dtype)
        out, buffers = out  # buffers back in the dtype they were given (as shard_params')
        return cast_floating(out, policy.output_dtype), {
            name: (b.to(given[name].dtype) if name in given and b.is_floating_point() else b)
            for name, b in buffers.items()}

    def apply_with_buffers(self, params, *args, **kwargs):
        """``apply(params, *args, mutable=True, **kwargs)``: ``(output, new_buffers)``."""
        return self.apply(params, *args, mutable=True, **kwargs)

    def train(self, mode: bool = True) -> _PrecisionModel:
        """The same policy over ``inner.train(mode)``."""
        return _PrecisionModel(self.inner.train(mode), self.policy)

    def eval(self) -> _PrecisionModel:
        """Same as ``train(False)``."""
        return self.train(False)

    def __getattr__(self, name):  # other attributes (``module``, ``check``, ``tp`` ...)
        return getattr(self.inner, name)


#: model kinds that take the policy themselves (``shard_params``' ``precision=``): kind ->
#: ``(policy_of(model), rebuild(model, policy))``; filled by those transforms (a registry
#: keeps this module below them: see shardfn/transforms/shard_params/compose.py)
_TAKES_PRECISION: dict[type, tuple[Callable[[Any], Precision | None],
                                   Callable[[Any, Precision], Any]]] = {}


def takes_precision(kind: type, policy_of: Callable[[Any], Precision | None],
                    rebuild: Callable[[Any, Precision], Any]) -> None:
    """Register a model kind that applies a policy itself: ``with_precision(model, policy)``
    of a ``kind`` becomes ``rebuild(model, policy)`` (the model rebuilt with ``precision=``).

    Args:
        kind: the model class (``ShardedModel``, ``FsdpTpModel``).
        policy_of: ``model -> `` the policy it computes under (None: none yet).
        rebuild: ``(model, policy) -> model`` of the same kind under ``policy``.

    Returns:
        None; ``with_precision`` reads the registry.

    Example:
        >>> takes_precision(ShardedModel, lambda m: m.precision,
        ...                 lambda m, p: shard_params(m.functional, ..., precision=p))
    """
    _TAKES_PRECISION[kind] = (policy_of, rebuild)


def split_precision(model: Any) -> tuple[Any, Precision | None]:
    """``(inner, policy)`` of a ``with_precision`` model, ``(model, None)`` of any other.

    Args:
        model: any model.

    Returns:
        The wrapped model and its :class:`Precision`, or ``model`` and None.

    Example:
        >>> split_precision(with_precision(fm, Precision(torch.bfloat16)))[0] is fm
        True
    """
    if isinstance(model, _PrecisionModel):
        return model.inner, model.policy
    return model, None


def _model_policy(model: Any) -> Precision | None:
    """The policy a model already computes under: its ``with_precision`` wrapper's, or the
    ``precision`` of a kind that takes one itself (None: none)."""
    if isinstance(model, _PrecisionModel):
        return model.policy
    taker = _TAKES_PRECISION.get(type(model))
    return None if taker is None else taker[0](model)


def with_precision(model: Any, policy: Precision) -> Any:
    """Wrap a functional model so ``apply`` computes under ``policy``.

    Composes by type (docs/composing.md): over a model that applies a policy itself
    (``shard_params``, FSDP x TP) it is that model rebuilt with ``precision=policy``,
    so ``with_precision(shard_params(fm, mesh, "dp"), p)``,
    ``shard_params(with_precision(fm, p), mesh, "dp")`` and
    ``shard_params(fm, mesh, "dp", precision=p)`` are one model (every field of ``p``
    honoured: all-gathers in ``param_dtype``, reductions in ``reduce_dtype``).
    ``sf.tensor_split(with_precision(fm, p), ...)`` is ``with_precision(sf.tensor_split(fm,
    ...), p)``; ``with_precision(sf.remat(m, r), p)`` is ``sf.remat(with_precision(m, p), r)``.

    Args:
        model: anything with ``init`` and ``apply(params, *args, **kwargs)``
            (``sf.functional(...)``, ``sf.tensor_split(...)``, ``sf.shard_params(...)``);
            other attributes pass through.
        policy: the :class:`Precision` policy (only ``param_dtype``, ``output_dtype``
            and ``cast_inputs`` matter to the wrapper; ``reduce_dtype`` is read by the
            reducing transforms).

    Returns:
        A model with the same ``init`` and a mixed-precision ``apply``; ``model`` itself
        when it already computes under ``policy``.

    Raises:
        TypeError: ``policy`` is not a :class:`Precision`.
        ValueError: ``model`` already computes under another policy (``with_precision``
            twice, or over ``shard_params(..., precision=q)``): one model has one policy.

    Example:
        >>> model = with_precision(sf.functional(net), Precision(torch.bfloat16))
    """
    if not isinstance(policy, Precision):
        raise TypeError(f"policy must be a shardfn Precision, got {type(policy).__name__}")
    inner, remat_policy = split_remat(model)  # with_precision(remat(m, r), p) is
    if remat_policy is not None:  # remat(with_precision(m, p), r): remat outermost
        under = with_precision(inner, policy)
        return model if under is inner else remat_model(under, remat_policy)
    current = _model_policy(model)
    if current == policy:
        return model  # already under this policy: applying it again means nothing new
    if current is not None:
        kind = ("with_precision(...) model" if isinstance(model, _PrecisionModel)
                else type(model).__name__)
        raise ValueError(f"with_precision: the {kind} already computes under "
                         f"{current}; one model has one policy: apply with_precision once, "
                         f"with the policy you want (e.g. policy._replace(...)), or pass it "
                         f"as shard_params(fm, mesh, axis, precision=policy)")
    taker = _TAKES_PRECISION.get(type(model))
    return _PrecisionModel(model, policy) if taker is None else taker[1](model, policy)
