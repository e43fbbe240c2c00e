"""The model protocol: what every model kind of shardfn is, in one place.

A *model* is a frozen record with pure functions over ``name -> Tensor`` trees of
*this rank's leaves*. ``sf.functional(module)`` makes the unsharded one; every model
transform (``shard_params``, ``tensor_split``, FSDP x TP, HSDP, ``pipeline_stages``,
``with_precision``, ``remat``) takes a model and returns one, so transforms compose
by type (docs/composing.md) and the same conformance suite
(:func:`shardfn.testing.check_model`) runs against every kind.

The members (every kind implements all of them; see docs/architecture.md):

==================  =========================================================
``functional``      the unsharded :class:`~shardfn.functional.FunctionalModel`
                    this model computes (the reference a test compares with)
``mesh``            the mesh its leaves are laid out over (None: unsharded)
``names``           the leaves of this rank's tree, in ``functional.names`` order
``param_names``,    this rank's parameters / buffers / trainable parameters /
``buffer_names``,   frozen parameters (subsets of ``names``)
``trainable_names``,
``frozen_names``
``specs``           ``name -> layout`` over ``mesh`` for every leaf of ``names``
                    (what ``sf.gather``/``sf.shard`` and ``sf.checkpoint`` read)
``init(seed)``      this rank's leaves of ``functional.init(seed)``
``apply(params,     the forward on this rank's leaves; with ``mutable=True``
*args, mutable)``   ``(output, new_buffers)``
``params_from(m)``  this rank's leaves of a materialised module's values
``shard(tree)``     this rank's leaves of full leaves, *any subset* of the names
                    (parameters, gradients, the trainable part)
``gather(tree)``    the full leaves of this rank's leaves, any subset (every rank
                    passes the same names); differentiable
``split_trainable`` ``(trainable, rest)`` by name, and ``merge`` its inverse
``train(mode)``,    a copy in training / eval mode (``self`` unchanged)
``eval()``
==================  =========================================================

Example:
    >>> import torch, shardfn as sf
    >>> fm = sf.functional(torch.nn.Linear(3, 2))
    >>> isinstance(fm, sf.Model)
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["MEMBERS", "Model", "WrapsModel", "missing_members", "refuse_pipeline"]

Params = dict[str, torch.Tensor]

#: every member a model kind has (checked by :func:`missing_members` and the
#: conformance suite)
MEMBERS = ("functional", "mesh", "names", "param_names", "buffer_names", "trainable_names",
           "frozen_names", "specs", "init", "apply", "params_from", "shard", "gather",
           "split_trainable", "merge", "train", "eval")


@runtime_checkable
class Model(Protocol):
    """The protocol every model kind implements (see the module docstring).

    ``isinstance(x, sf.Model)`` checks that the members exist; what they must do is
    checked by :func:`shardfn.testing.check_model`.

    Example:
        >>> isinstance(sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp"), sf.Model)
        True
    """

    @property
    def functional(self) -> Any: ...  # the unsharded FunctionalModel

    @property
    def mesh(self) -> Any: ...  # Mesh | None

    @property
    def names(self) -> tuple[str, ...]: ...

    @property
    def param_names(self) -> tuple[str, ...]: ...

    @property
    def buffer_names(self) -> tuple[str, ...]: ...

    @property
    def trainable_names(self) -> tuple[str, ...]: ...

    @property
    def frozen_names(self) -> tuple[str, ...]: ...

    @property
    def specs(self) -> Mapping[str, Any]: ...

    def init(self, seed: int, device: torch.device | str | None = None) -> Params: ...

    def apply(self, params: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any: ...

    def params_from(self, module: nn.Module) -> Params: ...

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params: ...

    def gather(self, tree: Mapping[str, torch.Tensor]) -> Params: ...

    def split_trainable(self, params: Mapping[str, torch.Tensor]) -> tuple[Params, Params]: ...

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


def missing_members(model: Any) -> list[str]:
    """The protocol members ``model`` lacks (empty: it has them all).

    Args:
        model: anything.

    Returns:
        The names from :data:`MEMBERS` that ``getattr`` does not find.

    Example:
        >>> missing_members(object())[:2]
        ['functional', 'mesh']
    """
    out = []
    for name in MEMBERS:
        try:
            getattr(model, name)
        except AttributeError:
            out.append(name)
    return out


def refuse_pipeline(model: Any, transform: str) -> None:
    """Refuse to wrap a pipeline: it runs its own step (``value_and_grad``) stage by stage.

    Args:
        model: what was given to ``transform``.
        transform: the transform's name (``"shard_params"``, ``"tensor_split"``, ``"remat"``).

    Raises:
        TypeError: ``model`` is a pipeline; the message names the valid order (transform
            each stage model, then pipeline them).

    Example:
        >>> refuse_pipeline(sf.functional(net), "remat")   # nothing: not a pipeline
    """
    if callable(getattr(model, "value_and_grad", None)) and hasattr(model, "stage_models"):
        raise TypeError(
            f"{transform}: the model is a {type(model).__name__}, which runs its own pipelined "
            f"step; apply {transform} to each stage model instead, then pipeline them: "
            f"split = sf.pipeline_split(units, balance); sf.pipeline_stages("
            f"[sf.{transform}(stage, ...) for stage in split], mesh, 'pp', ...)")


class WrapsModel:
    """Base of a model kind that wraps another, ``inner``, and changes only ``apply``
    (``with_precision``, ``remat``): every other member of the protocol is ``inner``'s.

    A subclass is a frozen dataclass with an ``inner`` field; it writes ``apply``,
    ``train`` and ``eval`` (a copy over ``inner.train(mode)`` with its own options).

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Doubled(WrapsModel):
        ...     inner: Any
        ...     def apply(self, params, *args, mutable=False, **kwargs):
        ...         return 2 * self.inner.apply(params, *args, **kwargs)
    """

    inner: Any

    @property
    def functional(self) -> Any:
        """``inner.functional``: the unsharded model this one computes."""
        return self.inner.functional

    @property
    def mesh(self) -> Any:
        """``inner.mesh``."""
        return self.inner.mesh

    @property
    def names(self) -> tuple[str, ...]:
        """``inner.names``: this rank's leaves."""
        return self.inner.names

    @property
    def param_names(self) -> tuple[str, ...]:
        return self.inner.param_names

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return self.inner.buffer_names

    @property
    def trainable_names(self) -> tuple[str, ...]:
        return self.inner.trainable_names

    @property
    def frozen_names(self) -> tuple[str, ...]:
        return self.inner.frozen_names

    @property
    def specs(self) -> Mapping[str, Any]:
        """``inner.specs``: the layouts of this rank's leaves."""
        return self.inner.specs

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        return self.inner.init(seed, device)

    def params_from(self, module: nn.Module) -> Params:
        return self.inner.params_from(module)

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        return self.inner.shard(tree)

    def gather(self, tree: Mapping[str, torch.Tensor]) -> Params:
        return self.inner.gather(tree)

    def split_trainable(self, params: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        return self.inner.split_trainable(params)

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        return self.inner.merge(trainable, rest)
