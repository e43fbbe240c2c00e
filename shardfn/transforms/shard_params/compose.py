"""How ``shard_params`` composes with the other model transforms, by type (docs/composing.md).

``shard_params`` is given a model; what it does with it depends on the model's kind:

* ``sf.functional(module)``: shard it (ZeRO-3 / FSDP, HSDP);
* ``sf.tensor_split(...)``: FSDP x TP (:mod:`shardfn.transforms._fsdp_tp`);
* ``sf.with_precision(m, p)``: ``shard_params(m, ..., precision=p)``, the policy
  applied per unit (all-gathers in ``param_dtype``, reduce-scatters in
  ``reduce_dtype``); with ``precision=q`` as well, ``q`` must be ``p``;
* a model that is already sharded (``ShardedModel``, ``FsdpTpModel``, ``FsdpEpModel``):
  refused, with the one call that means what was asked (shard once, over every axis).

And the other way round, ``sf.with_precision(shard_params(fm, ...), p)`` is the
sharded model rebuilt with ``precision=p`` (:func:`register` tells ``with_precision``
how), so the three spellings are one model: same values, gradients and bytes.

Remat the same way (:func:`take_remat`): ``shard_params(sf.remat(fm, r), mesh, "dp")``
is ``shard_params(fm, mesh, "dp", remat=r)``, each unit rematerialised (FSDP x TP too:
``shard_params(sf.remat(sf.tensor_split(fm, ...), r), ...)``); with ``remat=q`` as well,
``q`` must be ``r``. A function (``sf.remat(fm.apply)``) is refused saying so. The other
way round, ``sf.remat(shard_params(fm, ...), r)`` stays a ``RematModel`` over the sharded
model: the whole call, all-gathers included, recomputed in backward.

Example:
    >>> model, precision = take_model(sf.with_precision(fm, p), None, "dp", ShardedModel)
    >>> model is fm and precision == p
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardfn.model import refuse_pipeline
from shardfn.transforms._fsdp_ep import FsdpEpModel
from shardfn.transforms._fsdp_tp import FsdpTpModel
from shardfn.transforms.precision import Precision, split_precision, takes_precision
from shardfn.transforms.recording import Policy
from shardfn.transforms.remat_model import split_remat

__all__ = ["register", "take_model", "take_remat"]

#: the ShardedModel fields that are shard_params keywords (``precision`` and ``units`` apart)
_OPTIONS = ("reshard_after_forward", "prefetch", "replicate_axis", "grad_reduce", "offload",
            "remat", "ignored_params")


def _axes(axis: Any) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _policy_name(policy: Policy) -> str:
    return getattr(policy, "__name__", repr(policy))


def take_remat(model: Any, remat: Policy | None) -> tuple[Any, Policy | None]:
    """The model ``shard_params`` shards and its ``remat=`` policy: ``sf.remat(m, r)`` is
    ``m`` with ``remat=r`` (called before :func:`take_model`).

    Args:
        model: what was given to ``shard_params``.
        remat: its ``remat=`` keyword.

    Returns:
        ``(model, remat)``: a ``RematModel`` taken off, its policy as ``remat``; anything
        else unchanged.

    Raises:
        ValueError: ``remat=`` is another policy than the ``RematModel``'s.

    Example:
        >>> take_remat(sf.remat(fm, p), None) == (fm, p)
        True
    """
    inner, policy = split_remat(model)
    if policy is None:
        return model, remat
    if remat is not None and remat is not policy and remat != policy:
        raise ValueError(f"shard_params: the model is sf.remat(..., {_policy_name(policy)}) "
                         f"and remat={_policy_name(remat)} was passed too; one model has one "
                         f"remat policy: shard_params(fm, mesh, axis, remat=policy), or "
                         f"shard_params(sf.remat(fm, policy), mesh, axis)")
    return inner, policy


def take_model(model: Any, precision: Precision | None, axis: Any,
               sharded_kind: type) -> tuple[Any, Precision | None]:
    """The model ``shard_params`` shards and the policy it computes under.

    Args:
        model: what was given to ``shard_params``.
        precision: its ``precision=`` keyword.
        axis: its ``axis``.
        sharded_kind: :class:`~shardfn.transforms.shard_params.api.ShardedModel` (passed
            in: this module sits below ``api``).

    Returns:
        ``(model, precision)``: a ``with_precision`` wrapper taken off, its policy as
        ``precision``; anything else unchanged.

    Raises:
        ValueError: ``precision=`` differs from the wrapper's policy, or ``model`` is
            already sharded (the message names the call to make instead).
        TypeError: ``model`` is a function (``sf.remat(fm.apply)``): remat is ``remat=``.

    Example:
        >>> take_model(sf.with_precision(fm, p), p, "dp", ShardedModel) == (fm, p)
        True
    """
    refuse_pipeline(model, "shard_params")
    inner, policy = split_precision(model)
    if policy is not None:
        if precision is not None and precision != policy:
            raise ValueError(f"shard_params: the model is with_precision(..., {policy}) and "
                             f"precision={precision} was passed too; one model has one "
                             f"policy: shard_params(fm, mesh, axis, precision=policy), or "
                             f"shard_params(sf.with_precision(fm, policy), mesh, axis)")
        model, precision = inner, policy
    if isinstance(model, sharded_kind | FsdpTpModel | FsdpEpModel):
        kind, over = type(model).__name__, _axes(model.axis)
        again = "again over the same axis" if set(over) & set(_axes(axis)) else "over another axis"
        raise ValueError(
            f"shard_params: the model is already a {kind} sharded over {model.axis!r}; "
            f"sharding it {again} ({axis!r}) is not a composition shardfn has. Shard once, "
            f"from the unsharded model: shard_params(fm, mesh, {axis!r}, ...) with the options "
            f"you want (precision=, remat=, units=); over two axes, "
            f"shard_params(fm, mesh, ('a', 'b')) (ZeRO-3 over both) or "
            f"shard_params(fm, mesh, 'a', replicate_axis='b') (HSDP); with tensor parallelism, "
            f"shard_params(sf.tensor_split(fm, mesh, 'tp', plan), mesh, 'dp')")
    if callable(model) and not hasattr(model, "apply"):
        raise TypeError(f"shard_params takes a model (sf.functional(module)), got the function "
                        f"{getattr(model, '__name__', model)!r}; to rematerialise each unit "
                        f"pass remat=: shard_params(fm, mesh, axis, "
                        f"remat=sf.checkpoint_policies.nothing_saveable), or the model: "
                        f"shard_params(sf.remat(fm, policy), mesh, axis)")
    return model, precision


def _rebuild(shard_fn: Callable, model: Any, policy: Precision) -> Any:
    """``model`` (a ShardedModel) built again by ``shard_fn`` with ``precision=policy``."""
    options = {name: getattr(model, name) for name in _OPTIONS}
    return shard_fn(model.functional, model.mesh, model.axis, units=list(model.units),
                    precision=policy, **options)


def register(sharded_kind: type, shard_fn: Callable) -> None:
    """Tell ``with_precision`` that ``sharded_kind`` and :class:`FsdpTpModel` take ``precision=``.

    ``with_precision(model, p)`` of either is then the model rebuilt by ``shard_fn``
    with ``precision=p`` (same options, units, mesh and axis).

    Args:
        sharded_kind: ``ShardedModel``.
        shard_fn: ``shard_params``.

    Example:
        >>> register(ShardedModel, shard_params)   # once, where both are defined
    """
    takes_precision(sharded_kind, lambda model: model.precision,
                    lambda model, policy: _rebuild(shard_fn, model, policy))
    takes_precision(FsdpTpModel, lambda model: model.sharded.precision,
                    lambda model, policy: FsdpTpModel(model.tp,
                                                      _rebuild(shard_fn, model.sharded, policy)))
