"""FSDP + TP: ``shard_params`` over a ``tensor_split`` model on a 2-D mesh.

``sf.shard_params(sf.tensor_split(fmodel, mesh, "tp", plan), mesh, "dp", units=Block)``
is ZeRO-3 over ``dp`` of each rank's tensor-parallel shards, what FSDP2 does on
a 2-D DeviceMesh whose TP part is DTensor. It is built from two pieces:

* :class:`TpLocalModel`: the tensor-split model seen as an ordinary
  :class:`~shardfn.FunctionalModel` whose leaves are this rank's TP shards
  (``init_subset`` cuts them out of the unsplit model's init, one submodule at a
  time; ``module`` is the TP skeleton whose split layers run the Megatron
  collectives over ``tp``);
* ``shard_params`` of that local model over ``dp``: its plan, units, prefetch,
  remat, precision and offload work unchanged, and its gradients are reduced
  over ``dp`` only. TP-split leaves need nothing over ``tp`` (each tp rank owns
  its slice's gradient) and replicated-over-tp leaves (LayerNorms, ``pos``,
  rowwise biases) already have equal gradients on every tp rank (the ``f``/``g``
  pair counts the replicated computation once), so nothing is reduced twice.

The result is a :class:`FsdpTpModel`. Its ``specs`` map each leaf to a
:class:`FsdpTpLayout` (the TP layout of the full leaf, then the dp layout of the
TP shard); ``gather`` (``gather_params``) rebuilds the full leaves (fused qkv included), and
``sf.optim.clip_by_global_norm(c, model.specs)`` counts every element once.

Example:
    >>> tp = sf.tensor_split(sf.functional(GPT(cfg)), mesh, "tp", gpt_tp_plan())
    >>> model = sf.shard_params(tp, mesh, "dp", units=Block)
    >>> shards = model.init(0); logits = model.apply(shards, tokens)
    >>> full = model.gather(shards)                   # == fmodel.init(0)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardfn._functional_layout import FunctionalNames
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.spec import FusedLayout, Layout, LeafLayout, gather, local_shape, shard, spec_axes
from shardfn.transforms._tp_checks import check_apply, check_init, checking, value_hashes
from shardfn.transforms._tp_rng import call_streams
from shardfn.transforms.tensor_split import TensorSplitModel

if TYPE_CHECKING:  # shard_params imports this module
    from shardfn.transforms.shard_params.accumulator import AccumulateMode

__all__ = ["FsdpTpLayout", "FsdpTpModel", "TpLocalModel", "copy_sharing_meshes",
           "over_tensor_split", "tp_local_model"]

Params = dict[str, torch.Tensor]


def copy_sharing_meshes(module: nn.Module) -> nn.Module:
    """``copy.deepcopy(module)``, except that every :class:`~shardfn.Mesh` it holds is shared.

    A mesh holds process groups, which cannot be copied; the split layers of a
    ``tensor_split`` skeleton keep their mesh as an attribute.

    Example:
        >>> skeleton = copy_sharing_meshes(tp.module)
    """
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, Mesh):
                memo[id(value)] = value
    return copy.deepcopy(module, memo)


# ---------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class FsdpTpLayout(LeafLayout):
    """The 2-D layout of one leaf: a TP split of the full leaf, then a dp split of the TP shard.

    Attributes:
        tp: the leaf's ``tensor_split`` layout (a :class:`~shardfn.Layout` of the full
            shape, or a :class:`FusedLayout` for a fused qkv, on dim 0 for ``nn.Linear``
            or dim 1 for GPT-2's ``Conv1D``).
        dp: the ``shard_params`` layout of this rank's TP shard: ``P(dp)`` on dim 0 of
            the TP-local shape (zero-padded; whatever dim a ``FusedLayout`` fuses), ``P()``
            for 0-dim parameters and buffers.

    A split of a split is no single ``P``: ``sf.gather``/``sf.shard`` call its
    ``gather_leaf``/``shard_leaf`` (as ``FsdpTpModel.gather`` / ``shard`` do).
    ``sharded_axes`` is what ``clip_by_global_norm`` reads.

    Example:
        >>> model.specs["blocks.0.mlp.fc2.weight"].sharded_axes
        ('tp', 'dp')
    """

    tp: Layout | FusedLayout
    dp: Layout

    @property
    def shape(self) -> tuple[int, ...]:
        """The global (unsplit) shape."""
        return tuple(self.tp.shape)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """Every mesh axis some part of the leaf is split over (TP axes first)."""
        tp_axes = (self.tp.axis,) if isinstance(self.tp, FusedLayout) else spec_axes(self.tp)
        return tuple(dict.fromkeys(tp_axes + spec_axes(self.dp)))

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        """This rank's (tp, dp) shard shape."""
        return local_shape(self.dp.shape, self.dp, mesh)

    def shard_leaf(self, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """The tp shard of the full ``x``, then its dp shard (no communication)."""
        return shard(shard(x, self.tp, mesh, replicated_over=()), self.dp, mesh,
                     replicated_over=())

    def gather_leaf(self, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """All-gather over dp (the tp shard), then over tp (the full leaf)."""
        return gather(gather(x, self.dp, mesh), self.tp, mesh)


# ---------------------------------------------------------------- the TP-local model


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class TpLocalModel(FunctionalModel):
    """A ``tensor_split`` model as a plain functional model over this rank's TP shards.

    Same names, tied aliases, owners and module paths as ``tp.fmodel``; the leaf
    shapes (``param_shapes``, ``check``) are the TP-local ones; ``module`` is the TP
    skeleton; ``init_subset`` cuts the unsplit init. Made by :func:`tp_local_model`.

    Attributes:
        tp: the :class:`~shardfn.TensorSplitModel` it views.
    """

    tp: TensorSplitModel | None = None

    def init_subset(self, seed: int, module_paths: Sequence[str],
                    device: torch.device | str | None = None, *,
                    recurse: bool = False) -> Params:
        """This rank's TP shards of ``tp.fmodel.init_subset(seed, module_paths, ...)``.

        Example:
            >>> local.init_subset(0, ["blocks.0.mlp.fc1"])["blocks.0.mlp.fc1.weight"].shape
        """
        full = self.tp.fmodel.init_subset(seed, module_paths, device, recurse=recurse)
        check_init(self.tp, value_hashes(full) if checking(self.tp) else {},
                   "tensor_split.init (FSDP x TP)")  # check mode: same over tp
        return self.tp.cut(full)

    def params_from(self, module: nn.Module) -> Params:
        """This rank's TP shards of a materialised (unsplit) module's values."""
        return self.tp.shard(self.tp.fmodel.params_from(module))

    def train(self, mode: bool = True) -> TpLocalModel:
        """A copy in training (or eval) mode, its skeleton's meshes shared."""
        skeleton = copy_sharing_meshes(self.module)
        skeleton.train(mode)
        return dataclasses.replace(self, module=skeleton,
                                   tp=dataclasses.replace(self.tp, module=skeleton))

    def __repr__(self) -> str:
        return f"TpLocalModel({self.tp!r})"


def tp_local_model(tp: TensorSplitModel) -> TpLocalModel:
    """The :class:`TpLocalModel` of ``tp``: its local shard shapes, its TP skeleton.

    Example:
        >>> local = tp_local_model(sf.tensor_split(fmodel, mesh, "tp", plan))
        >>> local.param_shapes()["mlp.fc1.weight"].shape   # rows / tp
    """
    fmodel, local_shapes = tp.fmodel, tp.local_shapes
    plan = fmodel._plan
    leaves = {name: leaf._replace(shape=torch.Size(local_shapes[name]))
              for name, leaf in plan.leaves.items()}
    fields = {f.name: getattr(fmodel, f.name) for f in dataclasses.fields(FunctionalModel)}
    fields.update(module=tp.module, _plan=plan._replace(leaves=leaves))
    return TpLocalModel(**fields, tp=tp)


# ---------------------------------------------------------------- the 2-D model


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class FsdpTpModel(FunctionalNames):
    """ZeRO-3 over ``dp`` of a ``tensor_split`` model's TP shards; see :func:`over_tensor_split`.

    Attributes:
        tp: the :class:`~shardfn.TensorSplitModel` (its ``fmodel`` is the unsplit model,
            ``functional``; ``param_names`` ... ``frozen_names`` are its own).
        sharded: the ``ShardedModel`` of the :class:`TpLocalModel` over ``dp``; its
            ``specs`` (``dp_specs`` here) lay out each TP shard.
    """

    tp: TensorSplitModel
    sharded: Any  # a shard_params ShardedModel (of tp_local_model(tp))

    @property
    def functional(self) -> FunctionalModel:
        """The unsplit, unsharded functional model (``tp.fmodel``)."""
        return self.tp.fmodel

    @property
    def mesh(self) -> Mesh:
        return self.sharded.mesh

    @property
    def axis(self) -> Any:
        """The data-parallel (sharding) axis."""
        return self.sharded.axis

    @property
    def tp_axis(self) -> str:
        return self.tp.axis

    @property
    def names(self) -> tuple[str, ...]:
        return self.tp.names

    @property
    def units(self) -> tuple[str, ...]:
        return self.sharded.units

    @property
    def dp_specs(self) -> dict[str, Layout]:
        """``name -> Layout`` of each TP shard over ``dp`` (``sf.gather`` takes these)."""
        return self.sharded.specs

    @property
    def specs(self) -> dict[str, FsdpTpLayout]:
        """``name -> FsdpTpLayout``: both splits of every leaf."""
        dp = self.sharded.specs
        return {name: FsdpTpLayout(self.tp.specs[name], dp[name]) for name in self.names}

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's (tp, dp) shards of ``tp.fmodel.init(seed)``, one unit at a time.

        Example:
            >>> shards = model.init(0)
        """
        return self.sharded.init(seed, device)

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """This rank's (tp, dp) shards of full leaves, any subset of them (no communication).

        Args:
            tree: ``name -> full Tensor`` for any of ``functional``'s leaves (its ``init``,
                a gradient tree, the trainable part).

        Returns:
            ``name -> local shard`` in ``names`` order; :meth:`gather` is its inverse.

        Raises:
            TypeError / ValueError: a name that is not a leaf, or a leaf that is not full.

        Example:
            >>> shards = model.shard(fmodel.init(0))
        """
        return self.sharded.shard(self.tp.shard(tree))

    def gather(self, shards: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves from every rank's shards: all-gather over dp, then over tp.

        Differentiable; works on gradients and on any subset of the leaves
        (``split_trainable``'s first part); as ``sf.gather(shards, model.specs, mesh)``.
        Every rank must call it with the same names.

        Args:
            shards: ``name -> local (tp, dp) shard`` for any of the leaves.

        Returns:
            ``name -> full Tensor`` in ``names`` order.

        Raises:
            TypeError / ValueError: a name that is not a leaf, or a leaf whose shape is
                not its local shard's.

        Example:
            >>> full = model.gather(shards)   # == tp.fmodel.init(0)
        """
        return self.tp.gather_leaves(self.sharded.gather(shards))

    gather_params = gather  # its first name

    def params_from(self, module: nn.Module) -> Params:
        """This rank's shards of a module's values: ``shard(functional.params_from(module))``.

        Example:
            >>> shards = model.params_from(net)
        """
        return self.shard(self.tp.fmodel.params_from(module))

    def apply(self, shards: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """Run the model on this rank's shards (as ``ShardedModel.apply``; TP collectives inside).

        Every rank of a tp group must pass the same inputs (its dp rank's batch).

        Example:
            >>> local_logits = model.apply(shards, tokens)
        """
        check_apply(self.tp, args, kwargs)  # check mode: same plan and inputs over tp
        with call_streams(self.tp.mesh.index(self.tp.axis)):  # split-region dropout streams
            return self.sharded.apply(shards, *args, mutable=mutable, **kwargs)

    def apply_with_buffers(self, shards: Mapping[str, torch.Tensor], *args: Any,
                           **kwargs: Any) -> tuple[Any, Params]:
        """``apply(shards, *args, mutable=True, **kwargs)``."""
        return self.apply(shards, *args, mutable=True, **kwargs)

    def check(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Raise naming the leaf unless ``shards`` has this rank's (tp, dp) shard shapes."""
        self.sharded.check(shards)

    def split_trainable(self, shards: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """``(trainable, rest)``, as ``ShardedModel.split_trainable``."""
        return self.sharded.split_trainable(shards)

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        """Inverse of :meth:`split_trainable`."""
        return self.sharded.merge(trainable, rest)

    def accumulate_grads(self, loss_fn: Callable, num_micro_batches: int,
                         mode: AccumulateMode = "reduce_once") -> Callable:
        """As ``ShardedModel.accumulate_grads`` (reductions over dp only)."""
        return self.sharded.accumulate_grads(loss_fn, num_micro_batches, mode)

    def train(self, mode: bool = True) -> FsdpTpModel:
        """The same 2-D model with its skeletons in training (or eval) mode."""
        return FsdpTpModel(self.tp, self.sharded.train(mode))

    def eval(self) -> FsdpTpModel:
        """Same as ``train(False)``."""
        return self.train(False)

    def __repr__(self) -> str:
        return f"FsdpTpModel(dp={self.axis!r}, {self.tp!r}, units={list(self.units)})"


def _check_axes(tp: TensorSplitModel, mesh: Mesh, axis: Any, replicate_axis: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard_params: mesh must be an sf.Mesh, got {type(mesh).__name__}")
    if mesh is not tp.mesh and (mesh.axis_names, mesh.shape, mesh.ranks) != (
            tp.mesh.axis_names, tp.mesh.shape, tp.mesh.ranks):
        def axes(m: Mesh) -> dict[str, int]:
            return dict(zip(m.axis_names, m.shape, strict=True))

        raise ValueError(f"shard_params: the mesh {axes(mesh)} is not the mesh the model was "
                         f"tensor_split over ({axes(tp.mesh)}); use one mesh")
    for what, given in (("axis", axis), ("replicate_axis", replicate_axis)):
        if given is None and what == "replicate_axis":
            continue
        names = (given,) if isinstance(given, str) else tuple(given)
        for name in names:
            if name not in mesh.axis_names:
                raise ValueError(f"shard_params: {what} {name!r} is not an axis of the mesh "
                                 f"{mesh.axis_names}")
            if name == tp.axis:
                raise ValueError(f"shard_params: {what} {given!r} includes {tp.axis!r}, the "
                                 f"axis the model is tensor-split over; shard over the other "
                                 f"(data-parallel) axis, e.g. shard_params(tp_model, mesh, 'dp')")


def over_tensor_split(shard_fn: Callable, tp: TensorSplitModel, mesh: Mesh, axis: Any,
                      unit_paths: tuple[str, ...], options: Mapping[str, Any]) -> FsdpTpModel:
    """``shard_params`` of a :class:`~shardfn.TensorSplitModel`: FSDP over ``axis``, TP inside.

    Called by ``shard_params`` (which passes itself as ``shard_fn`` and the units it
    resolved on the *unsplit* model, so ``units=Block``, ``units=n`` (sizes of the
    unsplit modules) and paths mean what they mean there).

    Args:
        shard_fn: ``shard_params``.
        tp: the tensor-split model.
        mesh: its mesh (the same one).
        axis: the data-parallel axis (or tuple of axes), not the tp axis.
        unit_paths: module paths of the units (empty: one unit).
        options: the other ``shard_params`` keywords.

    Returns:
        The :class:`FsdpTpModel`.

    Raises:
        ValueError: ``axis`` (or ``replicate_axis``) is or includes the tp axis, an
            axis the mesh lacks, or another mesh than the model's.

    Communication per step: the TP model's (per block: Megatron's psums over ``tp``)
    plus FSDP's ``3 Psi_tp (dp-1)/dp`` over ``dp``, ``Psi_tp`` = a rank's TP shard bytes.
    """
    _check_axes(tp, mesh, axis, options.get("replicate_axis"))
    local = tp_local_model(tp)
    sharded = shard_fn(local, mesh, axis, units=list(unit_paths) or None, **options)
    return FsdpTpModel(tp, sharded)
