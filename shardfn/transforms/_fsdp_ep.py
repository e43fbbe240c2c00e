"""FSDP x EP: ``shard_params`` over an ``expert_parallel`` model.

``sf.shard_params(sf.expert_parallel(fm, mesh, "ep"), mesh, axis)`` shards the parameters
of an expert-parallel model (ZeRO-3 / FSDP, HSDP) while its MoE layers keep dispatching
tokens over ``"ep"``. Two layouts, chosen by where ``"ep"`` is:

* ``"ep"`` is not a sharding axis (``{"dp": 2, "ep": 2}``, ``axis="dp"``: DeepSpeed's
  ZeRO-3 MoE layout). :class:`EpLocalModel` is the ep model seen as an ordinary
  :class:`~shardfn.FunctionalModel` over this rank's leaves (its ``E / ep`` experts, every
  other leaf whole; its skeleton the ep model's, whose MoE layers hold the all-to-all), and
  ``shard_params`` shards *that* over ``axis``: each expert leaf is split over ``"ep"``,
  then its block over ``"dp"`` (:class:`FsdpEpLayout`), every other leaf over ``"dp"``.
  A rank stores ``1/(ep dp)`` of the experts and ``1/dp`` of the rest.
* ``"ep"`` is a sharding axis (``shard_params(ep_model, mesh, "ep")``, FairScale's MoE
  test: the rest of the model ZeRO-3 over the ranks that split the experts; also a tuple
  holding ``"ep"`` or ``replicate_axis="ep"``). The same :class:`EpLocalModel` is sharded
  with its expert leaves *ignored* (``shard_params(..., ignored_params=experts)``, FSDP's
  ``ignored_params``; FairScale's experts in an FSDP of their own process group,
  DeepSpeed's expert-data-parallel group): each rank holds and computes its ``E / ep``
  experts whole, no unit gathers them, and every other leaf is ZeRO-3 over the sharding
  axes. No expert byte crosses ``"ep"`` but the tokens' all-to-alls.

Gradients are those of ``sf.expert_parallel``: of the mean over ``"ep"`` (and, with
``grad_reduce="mean"``, over the sharding axes) of every rank's loss; ``grad_reduce="sum"``
sums over both. ``shard_params`` reduces the leaves it shards over its axes, and this
module adds the rest in the graph, on the shards ``apply`` is given. In the first layout a
non-expert shard enters through ``pvary`` over ``"ep"`` (backward psum of the shard's
gradient: ``1/dp`` of the bytes of a psum of the leaf) and, for the mean, every trainable
shard counts ``1/ep`` (an expert's gradient already sums every ep rank's tokens: the
all-to-all's backward). In the second ``shard_params``' reduction spans ``"ep"`` for the
non-expert leaves, and an (ignored) expert leaf enters through ``pvary`` over the replica
axes, the sharding and replicate axes but ``"ep"`` (backward psum over the ranks holding
the same experts: DeepSpeed's expert-data-parallel group) and, for the mean, counts
``1 / (sharding and replicate ranks)``.

Example:
    >>> ep = sf.expert_parallel(sf.functional(net), mesh, "ep")       # {"dp": 2, "ep": 2}
    >>> model = sf.shard_params(ep, mesh, "dp")
    >>> shards = model.init(0); out, aux = model.apply(shards, x)
    >>> full = model.gather(shards)                                    # == fm.init(0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardfn._functional_layout import FunctionalNames
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.primitives.collectives import pvary
from shardfn.spec import Layout, LeafLayout
from shardfn.transforms._fsdp_tp import FsdpTpLayout
from shardfn.transforms.experts import ExpertParallelModel, counted_once

__all__ = ["EpLocalModel", "ExpertParallelModel", "FsdpEpLayout", "FsdpEpModel",
           "ep_local_model", "over_expert_parallel"]

Params = dict[str, torch.Tensor]


def _axes(axis: Any) -> tuple[str, ...]:
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


@dataclasses.dataclass(frozen=True)
class FsdpEpLayout(FsdpTpLayout):
    """The 2-D layout of one leaf: its ``expert_parallel`` split, then the dp split of that.

    An :class:`~shardfn.transforms._fsdp_tp.FsdpTpLayout` whose first split (``tp``, also
    named ``ep`` here) is the leaf's layout in ``ExpertParallelModel.specs`` (``P("ep")``
    on dim 0 for experts, ``P()`` else), so ``sf.gather``/``sf.shard``, checkpoints and
    ``clip_by_global_norm`` read it as they read FSDP x TP's; ``dp`` is the ``shard_params``
    layout of this rank's ep leaf (``P(dp)`` on dim 0, zero-padded; ``P()`` for the expert
    leaves held whole when ``"ep"`` is a sharding axis).

    Example:
        >>> model.specs["experts.down_proj"].sharded_axes
        ('ep', 'dp')
    """

    @property
    def ep(self) -> Layout:
        """The ``expert_parallel`` layout of the full leaf (the first split)."""
        return self.tp


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class EpLocalModel(FunctionalModel):
    """An ``expert_parallel`` model as a plain functional model over this rank's leaves.

    Same names as ``ep.inner``; expert leaves have their ``E / ep`` shapes; ``module`` is
    the ep skeleton (MoE layers dispatching over the axis); ``init_subset`` cuts the
    unsplit init. Made by :func:`ep_local_model`.

    Attributes:
        ep: the :class:`~shardfn.transforms.experts.ExpertParallelModel` it views.
    """

    ep: ExpertParallelModel | None = None

    def init_subset(self, seed: int, module_paths: Sequence[str],
                    device: torch.device | str | None = None, *,
                    recurse: bool = False) -> Params:
        """This rank's leaves of ``ep.inner.init_subset(...)`` (its block of the experts)."""
        return self.ep.shard(self.ep.inner.init_subset(seed, module_paths, device,
                                                       recurse=recurse))

    def params_from(self, module: nn.Module) -> Params:
        """This rank's leaves of a materialised (unsplit) module's values."""
        return self.ep.params_from(module)

    def train(self, mode: bool = True) -> EpLocalModel:
        """A copy in training (or eval) mode (the dispatch and its mesh shared)."""
        ep = self.ep.train(mode)
        return dataclasses.replace(self, module=ep.module, ep=ep)

    def __repr__(self) -> str:
        return f"EpLocalModel({self.ep!r})"


def ep_local_model(ep: ExpertParallelModel) -> EpLocalModel:
    """The :class:`EpLocalModel` of ``ep``: expert leaves ``E / ep`` rows, ep's skeleton.

    Example:
        >>> ep_local_model(ep).param_shapes()["experts.down_proj"].shape[0]   # E / ep
    """
    fmodel, size = ep.inner, ep.mesh.size(ep.axis)
    plan = fmodel._plan
    leaves = {name: leaf._replace(shape=torch.Size((leaf.shape[0] // size,
                                                    *leaf.shape[1:])))
              if name in ep.experts else leaf for name, leaf in plan.leaves.items()}
    fields = {f.name: getattr(fmodel, f.name) for f in dataclasses.fields(FunctionalModel)}
    fields.update(module=ep.module, _plan=plan._replace(leaves=leaves))
    return EpLocalModel(**fields, ep=ep)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class FsdpEpModel(FunctionalNames):
    """``shard_params`` of an ``expert_parallel`` model; see :func:`over_expert_parallel`.

    Attributes:
        ep: the :class:`~shardfn.transforms.experts.ExpertParallelModel`.
        sharded: the ``ShardedModel`` of the :class:`EpLocalModel` (its expert leaves
            ``ignored_params`` when ``ep_inside``).
        ep_inside: whether the ep axis is one of ``sharded``'s axes (second layout).
    """

    ep: ExpertParallelModel
    sharded: Any  # a shard_params ShardedModel
    ep_inside: bool

    functional = property(lambda self: self.ep.inner)
    mesh = property(lambda self: self.sharded.mesh)
    axis = property(lambda self: self.sharded.axis)
    ep_axis = property(lambda self: self.ep.axis)
    names = property(lambda self: self.ep.names)
    units = property(lambda self: self.sharded.units)
    experts = property(lambda self: self.ep.experts)

    @property
    def specs(self) -> dict[str, Layout | LeafLayout]:
        """``name -> layout``: :class:`FsdpEpLayout` (the ep split, then shard_params')."""
        dp, ep = self.sharded.specs, self.ep.specs
        return {name: FsdpEpLayout(ep[name], dp[name]) for name in self.names}

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's shards of ``functional.init(seed)``, one unit at a time."""
        return self.sharded.init(seed, device)

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """This rank's shards of full leaves, any subset of them (no communication).

        Example:
            >>> shards = model.shard(fm.init(0))
        """
        return self.sharded.shard(self.ep.shard(tree))

    def gather(self, shards: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves of every rank's shards (params or gradients, any subset;
        differentiable), as ``sf.gather(shards, model.specs, mesh)``.

        Example:
            >>> full = model.gather(shards)   # == fm.init(0)
        """
        return self.ep.gather(self.sharded.gather(shards))

    gather_params = gather

    def params_from(self, module: nn.Module) -> Params:
        """This rank's shards of a module's values."""
        return self.shard(self.ep.inner.params_from(module))

    def _enter_ep(self, shards: Mapping[str, torch.Tensor]) -> Params:
        """The shards as the ep model's ``apply`` takes its leaves (module docstring). First
        layout: the non-expert ones through ``pvary`` over ep, every trainable one counting
        ``1/ep`` for the mean. Second: the expert leaves through ``pvary`` over the replica
        axes, counting ``1/`` the data-parallel ranks (``shard_params`` reduces the rest)."""
        ep_axis = self.ep.axis
        if self.ep_inside:
            data = _axes(self.sharded.axis) + _axes(self.sharded.replicate_axis)
            entering, count = set(self.experts), math.prod(self.mesh.size(a) for a in data)
            varied_axes, to_vary = tuple(a for a in data if a != ep_axis), set(self.experts)
        else:
            entering, count = set(self.names), self.ep.mesh.size(ep_axis)
            varied_axes, to_vary = (ep_axis,), set(self.names) - set(self.experts)
        trainable = entering & set(self.trainable_names) & set(shards)
        if count == 1 or not trainable:
            return dict(shards)
        varied = pvary({n: shards[n] for n in trainable & to_vary}, varied_axes,
                       mesh=self.ep.mesh) if varied_axes else {}
        mean = self.sharded.grad_reduce == "mean"
        out = {}
        for name, leaf in shards.items():
            leaf = varied.get(name, leaf)
            out[name] = counted_once(leaf, count) if mean and name in trainable else leaf
        return out

    def apply(self, shards: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """Run the model on this rank's shards and tokens (as ``ShardedModel.apply``; the
        MoE layers' all-to-alls over ep inside). Gradients: see the module docstring.

        Example:
            >>> out, aux = model.apply(shards, x)
        """
        self.sharded.check(shards)
        return self.sharded.apply(self._enter_ep(shards), *args, mutable=mutable, **kwargs)

    def apply_with_buffers(self, shards: Mapping[str, torch.Tensor], *args: Any,
                           **kwargs: Any) -> tuple[Any, Params]:
        """``apply(shards, *args, mutable=True, **kwargs)``."""
        return self.apply(shards, *args, mutable=True, **kwargs)

    def check(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Raise naming the leaf unless ``shards`` has this rank's shard shapes."""
        self.sharded.check(shards)

    def split_trainable(self, shards: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """``(trainable, rest)``, as ``ShardedModel.split_trainable``."""
        return self.sharded.split_trainable(shards)

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        """Inverse of :meth:`split_trainable`."""
        return self.sharded.merge(trainable, rest)

    def train(self, mode: bool = True) -> FsdpEpModel:
        """The same model with its skeletons in training (or eval) mode."""
        return FsdpEpModel(self.ep.train(mode), self.sharded.train(mode), self.ep_inside)

    def eval(self) -> FsdpEpModel:
        """Same as ``train(False)``."""
        return self.train(False)

    def __repr__(self) -> str:
        return (f"FsdpEpModel(axis={self.axis!r}, {self.ep!r}, units={list(self.units)}, "
                f"experts {'held whole per rank' if self.ep_inside else 'split over ep, dp'})")


def over_expert_parallel(shard_fn: Callable, ep: ExpertParallelModel, mesh: Mesh, axis: Any,
                         unit_paths: tuple[str, ...], options: Mapping[str, Any]) -> FsdpEpModel:
    """``shard_params`` of an :class:`ExpertParallelModel` (called by ``shard_params``).

    Args:
        shard_fn: ``shard_params``.
        ep: the expert-parallel model.
        mesh: its mesh (the same one).
        axis: the sharding axis or axes (may include the ep axis: the second layout).
        unit_paths: the units ``shard_params`` resolved on the unsplit model.
        options: the other ``shard_params`` keywords.

    Returns:
        The :class:`FsdpEpModel`.

    Raises:
        ValueError: another mesh than the model's, or an axis the mesh lacks.

    Communication per step: the ep model's all-to-alls, plus FSDP's ``3 Psi (N-1)/N`` over
    ``axis`` (Psi: a rank's ep leaves in the first layout, the non-expert ones in the
    second), plus (first layout) a psum over ep of each non-expert shard's gradient, or
    (second) a psum of the rank's expert gradients over the replica axes.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_params: mesh must be an sf.Mesh, got {type(mesh).__name__}")
    if mesh is not ep.mesh and (mesh.axis_names, mesh.shape, mesh.ranks) != (
            ep.mesh.axis_names, ep.mesh.shape, ep.mesh.ranks):
        shape = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        raise ValueError(f"shard_params: the mesh {shape} is not the mesh the model was "
                         f"expert_parallel over; use one mesh")
    for name in _axes(axis) + _axes(options.get("replicate_axis")):
        if name not in mesh.axis_names:
            raise ValueError(f"shard_params: axis {name!r} is not an axis of the mesh "
                             f"{mesh.axis_names}")
    inside = ep.axis in _axes(axis) + _axes(options.get("replicate_axis"))
    if inside:  # the experts held whole on each rank, never gathered (docstring)
        options = {**options, "ignored_params": _with_experts(options.get("ignored_params"),
                                                              ep.experts)}
    sharded = shard_fn(ep_local_model(ep), mesh, axis, units=list(unit_paths), **options)
    return FsdpEpModel(ep, sharded, inside)


def _with_experts(ignored: Any, experts: Collection[str]) -> Any:
    """``ignored_params=`` with the expert leaves added (a collection or a predicate; a
    value of another kind is passed on for ``shard_params`` to refuse)."""
    if ignored is None:
        return frozenset(experts)
    if callable(ignored):
        return lambda name, leaf: name in experts or bool(ignored(name, leaf))
    if isinstance(ignored, str) or not isinstance(ignored, Collection):
        return ignored
    return frozenset(experts) | frozenset(ignored)
