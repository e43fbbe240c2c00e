"""``sf.remat(model, policy)``: a model whose ``apply`` is rematerialised as one call.

``sf.remat`` of a *function* wraps the function (:mod:`shardfn.transforms.remat`); of a
*model* (anything with ``init``, ``apply`` and ``names``: the model protocol,
:mod:`shardfn.model`) it returns a :class:`RematModel`: the same model, whose
``apply`` runs ``inner.apply`` under ``sf.remat(..., policy)``, so backward recomputes
the whole call (collectives inside it included) instead of keeping its
intermediates. Every other member of the protocol is ``inner``'s.

Buffers (``mutable=True``): the forward runs once and returns copies of the buffers as
it left them (detached: buffers are state, never differentiated); the recomputation in
backward updates copies of its own, which are dropped, so BatchNorm's running
statistics and ``num_batches_tracked`` move once per call.

Composition by type (docs/composing.md):

* ``remat(remat(m, p), p)`` is ``remat(m, p)``; two different policies are refused;
* ``shard_params(remat(fm, p), mesh, "dp")`` is ``shard_params(fm, mesh, "dp",
  remat=p)`` (each unit rematerialised; FSDP x TP too);
* ``tensor_split(remat(fm, p), ...)`` is ``remat(tensor_split(fm, ...), p)``;
* ``with_precision(remat(m, p), q)`` is ``remat(with_precision(m, q), p)``;
* ``remat(shard_params(fm, ...), p)`` stays a ``RematModel`` over the sharded model:
  the whole call, all-gathers included, runs again in backward.

Memory: the arguments of ``apply`` (parameters, inputs) plus what the policy saves,
from forward to backward. Compute: one more forward of ``inner`` less the saved ops.
Communication: the collectives of ``inner.apply`` once more in backward.

This module sits below :mod:`shardfn.transforms.remat`, which registers the function
transform here (:func:`rematerialise_with`) so that the two do not import each other.

Example:
    >>> model = sf.remat(sf.functional(net), sf.checkpoint_policies.dots_saveable)
    >>> grads = torch.func.grad(lambda p: model.apply(p, x).sum())(model.init(0))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardfn._functional_leaves import refuse_differentiated_state
from shardfn.model import WrapsModel, refuse_pipeline
from shardfn.transforms.recording import Policy

__all__ = ["RematModel", "is_model", "remat_model", "rematerialise_with", "split_remat"]

Params = dict[str, torch.Tensor]

#: the function transform ``(fn, policy) -> fn`` (``shardfn.transforms.remat``'s), set once
#: where it is defined; a registration keeps this module below it
_FUNCTION_TRANSFORM: list[Callable[[Callable, Policy], Callable]] = []


def rematerialise_with(transform: Callable[[Callable, Policy], Callable]) -> None:
    """Register the function transform a :class:`RematModel` runs ``inner.apply`` under.

    Args:
        transform: ``(fn, policy) -> fn`` (``sf.remat`` of a function).

    Returns:
        None.

    Example:
        >>> rematerialise_with(remat_function)   # once, in shardfn/transforms/remat.py
    """
    _FUNCTION_TRANSFORM[:] = [transform]


def is_model(x: Any) -> bool:
    """Whether ``x`` is a model for ``sf.remat`` (has ``init``, ``apply`` and ``names``).

    A bound method (``model.apply``) or any other function is not: ``sf.remat`` wraps it
    as a function.

    Example:
        >>> is_model(sf.functional(net)), is_model(sf.functional(net).apply)
        (True, False)
    """
    return all(hasattr(x, name) for name in ("init", "apply", "names"))


def _policy_name(policy: Policy) -> str:
    return getattr(policy, "__name__", repr(policy))


@dataclasses.dataclass(frozen=True)
class RematModel(WrapsModel):
    """A model whose ``apply`` is rematerialised whole by ``policy``; see :func:`remat_model`.

    Attributes:
        inner: the model it wraps (any kind).
        policy: the remat policy (``sf.checkpoint_policies``).
    """

    inner: Any
    policy: Policy

    # ---------------------------------------------------------------- apply

    def apply(self, params: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """``inner.apply(params, *args, mutable=mutable, **kwargs)``, rematerialised.

        Same values and gradients as ``inner.apply``; backward recomputes the call
        (what ``policy`` saves apart). With ``mutable=True`` returns ``(output,
        new_buffers)``, the buffers as the forward left them, updated once.

        Raises:
            TypeError: ``mutable`` is not a bool.
            ValueError: a buffer or frozen parameter is being differentiated (named).

        Example:
            >>> out, buffers = model.apply(params, x, mutable=True)
        """
        if not isinstance(mutable, bool):
            raise TypeError(f"apply: mutable must be True or False, got {mutable!r}")
        # checked here: inside the remat forward torch.func's levels are already unwrapped
        refuse_differentiated_state(params, getattr(self.inner, "buffer_names", ()),
                                    getattr(self.inner, "frozen_names", ()),
                                    f"remat({type(self.inner).__name__}).apply")
        if not _FUNCTION_TRANSFORM:  # pragma: no cover - shardfn.transforms.remat sets it
            raise RuntimeError("remat: import shardfn first (it registers the transform)")
        rematerialised = _FUNCTION_TRANSFORM[0](self.inner.apply, self.policy)
        out = rematerialised(params, *args, mutable=mutable, **kwargs)
        if not mutable:
            return out
        # state, never differentiated; copied: the recomputation may replay a saved copy of a
        # buffer that BatchNorm then updates again in place without a version bump
        out, buffers = out
        return out, {name: b.detach().clone() for name, b in buffers.items()}

    def apply_with_buffers(self, params: Mapping[str, torch.Tensor], *args: Any,
                           **kwargs: Any) -> tuple[Any, Params]:
        """``apply(params, *args, mutable=True, **kwargs)``: ``(output, new_buffers)``."""
        return self.apply(params, *args, mutable=True, **kwargs)

    def train(self, mode: bool = True) -> RematModel:
        """The same policy over ``inner.train(mode)``."""
        return RematModel(self.inner.train(mode), self.policy)

    def eval(self) -> RematModel:
        """Same as ``train(False)``."""
        return self.train(False)

    # every other member of the protocol is inner's (shardfn.model.WrapsModel)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        raise AttributeError(f"RematModel has no {name!r}: its members are the model "
                             f"protocol's (shardfn.model.MEMBERS), each the wrapped "
                             f"{type(self.inner).__name__}'s where it has one; that model "
                             f"is .inner")

    def __repr__(self) -> str:
        return f"RematModel({self.inner!r}, policy={_policy_name(self.policy)})"


def split_remat(model: Any) -> tuple[Any, Policy | None]:
    """``(inner, policy)`` of a :class:`RematModel`, ``(model, None)`` of anything else.

    Example:
        >>> split_remat(sf.remat(fm, p)) == (fm, p)
        True
    """
    if isinstance(model, RematModel):
        return model.inner, model.policy
    return model, None


def remat_model(model: Any, policy: Policy) -> RematModel:
    """``model`` rematerialised whole by ``policy`` (what ``sf.remat(model, policy)`` returns).

    Args:
        model: any model kind (``init``, ``apply``, ``names``, ...).
        policy: a remat policy (``sf.checkpoint_policies``).

    Returns:
        ``RematModel(model, policy)``; ``model`` itself when it is already a
        ``RematModel`` under ``policy``.

    Raises:
        ValueError: ``model`` is a ``RematModel`` under another policy.

    Example:
        >>> remat_model(remat_model(fm, p), p) == remat_model(fm, p)
        True
    """
    refuse_pipeline(model, "remat")
    inner, current = split_remat(model)
    if current is None:
        return RematModel(model, policy)
    if current is policy or current == policy:
        return model
    raise ValueError(f"remat: the model is already remat(..., {_policy_name(current)}); one "
                     f"model has one remat policy: apply sf.remat once, to "
                     f"{type(inner).__name__}, with the policy you want (to save what either "
                     f"saves: sf.checkpoint_policies.save_from_both_policies(a, b)); for "
                     f"per-unit remat of a sharded model pass remat= to shard_params")
