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
  holding ``"ep"`` or ``replicate_axis="ep"``). ``shard_params`` shards the *unsplit*
  leaves, so rank ``r``'s shard of an expert leaf is its own block of experts (with
  ``axis="ep"``); each MoE layer runs on the rows of the gathered leaf that rank owns
  (:class:`OwnRows`). Storage is rank-local, but the unit's all-gather brings every rank's
  experts for the call (FairScale never moves them): see docs/moe.md.

Gradients are those of ``sf.expert_parallel``: of the mean over ``"ep"`` (and, with
``grad_reduce="mean"``, over the sharding axes) of every rank's loss; ``grad_reduce="sum"``
sums over both. In the first layout ``shard_params`` reduces over ``axis``, and this module
adds the ep part in the graph, on the shards ``apply`` is given: a non-expert shard enters
through ``pvary`` over ``"ep"`` (backward psum of the shard's gradient: ``1/dp`` of the
bytes of a psum of the leaf) and, for the mean, every trainable shard counts ``1/ep`` (an
expert's gradient already sums every ep rank's tokens: the all-to-all's backward). In the
second ``shard_params``' reduction over ``"ep"`` is the whole of it: each rank's gradient of
an expert block is zero outside its rows, so the reduce-scatter's sum is that rank's.

Example:
    >>> ep = sf.expert_parallel(sf.functional(net), mesh, "ep")       # {"dp": 2, "ep": 2}
    >>> model = sf.shard_params(ep, mesh, "dp")
    >>> shards = model.init(0); out, aux = model.apply(shards, x)
    >>> full = model.gather(shards)                                    # == fm.init(0)
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardfn._functional_layout import FunctionalNames
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.models.moe_dispatch import AllToAllExperts
from shardfn.primitives.collectives import pvary
from shardfn.spec import Layout, LeafLayout
from shardfn.transforms._fsdp_tp import FsdpTpLayout, copy_sharing_meshes
from shardfn.transforms.experts import ExpertParallelModel, counted_once

__all__ = ["EpLocalModel", "ExpertParallelModel", "FsdpEpLayout", "FsdpEpModel", "OwnRows",
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
    layout of this rank's ep leaf (``P(dp)`` on dim 0, zero-padded).

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


@dataclasses.dataclass(frozen=True, eq=False)
class OwnRows:
    """A dispatch that hands ``inner`` this rank's block of a *full* expert leaf.

    Under ``shard_params`` over the ep axis the unit gathers the unsplit ``[E, ...]``
    leaves; the experts rank ``r`` computes are rows ``r E/ep .. (r+1) E/ep`` of them.
    """

    inner: AllToAllExperts

    def __deepcopy__(self, memo: dict) -> OwnRows:
        return self  # holds the mesh: shared, never copied

    def __call__(self, experts: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        mesh, axis = self.inner.mesh, self.inner.axis
        size, rank = mesh.size(axis), mesh.index(axis)
        total = experts.gate_up_proj.shape[0]
        if total % size or total != len(counts):
            raise ValueError(f"shard_params over expert_parallel: a gathered expert leaf has "
                             f"{total} experts, the router chose among {len(counts)}; "
                             f"expected both E, divisible by ep={size} (axis {axis!r})")
        block = slice(rank * (total // size), (rank + 1) * (total // size))
        view = types.SimpleNamespace(gate_up_proj=experts.gate_up_proj[block],
                                     down_proj=experts.down_proj[block],
                                     act_fn=getattr(experts, "act_fn", None))
        view.run = functools.partial(type(experts).run, view)
        return self.inner(view, rows, counts)


def _own_rows_model(ep: ExpertParallelModel) -> FunctionalModel:
    """``ep.inner`` (full shapes) over a copy of ep's skeleton whose dispatches take their
    rank's rows of the gathered experts (:class:`OwnRows`)."""
    skeleton = copy_sharing_meshes(ep.module)
    for sub in skeleton.modules():
        if isinstance(getattr(sub, "dispatch", None), AllToAllExperts):
            sub.dispatch = OwnRows(sub.dispatch)
    return dataclasses.replace(ep.inner, module=skeleton)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class FsdpEpModel(FunctionalNames):
    """``shard_params`` of an ``expert_parallel`` model; see :func:`over_expert_parallel`.

    Attributes:
        ep: the :class:`~shardfn.transforms.experts.ExpertParallelModel`.
        sharded: the ``ShardedModel`` (of :class:`EpLocalModel` when ``ep_inside``, else of
            the unsplit leaves over a skeleton with :class:`OwnRows` dispatches).
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
        """``name -> layout``: :class:`FsdpEpLayout` (ep, then dp), or with the ep axis
        among the sharding axes ``shard_params``' own layouts of the full leaves."""
        if self.ep_inside:
            return dict(self.sharded.specs)
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
        return self.sharded.shard(tree if self.ep_inside else self.ep.shard(tree))

    def gather(self, shards: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves of every rank's shards (params or gradients, any subset;
        differentiable), as ``sf.gather(shards, model.specs, mesh)``.

        Example:
            >>> full = model.gather(shards)   # == fm.init(0)
        """
        leaves = self.sharded.gather(shards)
        return leaves if self.ep_inside else self.ep.gather(leaves)

    gather_params = gather

    def params_from(self, module: nn.Module) -> Params:
        """This rank's shards of a module's values."""
        return self.shard(self.ep.inner.params_from(module))

    def _enter_ep(self, shards: Mapping[str, torch.Tensor]) -> Params:
        """The shards as the ep model's ``apply`` takes its leaves: non-expert ones through
        ``pvary`` over ep, each trainable one counting ``1/ep`` for the mean."""
        size = self.ep.mesh.size(self.ep.axis)
        trainable = set(self.trainable_names) & set(shards)
        if self.ep_inside or size == 1 or not trainable:
            return dict(shards)
        varied = pvary({n: shards[n] for n in trainable if n not in self.experts},
                       self.ep.axis, mesh=self.ep.mesh)
        mean = self.sharded.grad_reduce == "mean"
        out = {}
        for name, leaf in shards.items():
            leaf = varied.get(name, leaf)
            out[name] = counted_once(leaf, size) if mean and name in trainable else leaf
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
                f"experts {'gathered over the sharding axes' if self.ep_inside else 'split'})")


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
    ``axis`` (Psi: a rank's ep leaves in the first layout, the unsplit ones in the second),
    plus (first layout) a psum over ep of each non-expert shard's gradient.
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
    local = _own_rows_model(ep) if inside else ep_local_model(ep)
    sharded = shard_fn(local, mesh, axis, units=list(unit_paths), **options)
    return FsdpEpModel(ep, sharded, inside)
