"""TP x EP: ``tensor_split`` over an ``expert_parallel`` model (tensor parallelism on the
attention, the experts split over their own axis).

``sf.tensor_split(sf.expert_parallel(fm, mesh, "ep"), mesh, "tp", plan)`` on a mesh with
both axes (``{"ep": 2, "tp": 2}``) splits the layers the plan names (the attention's
q/k/v colwise, its output projection rowwise: Megatron) over ``"tp"`` while the MoE layers
keep sending their rows over ``"ep"``. The order is the one ``shard_params`` takes: split
the experts first, then the other transforms over other axes; ``expert_parallel`` of a
``TensorSplitModel`` is refused with this order in the message.

Which ranks hold which tokens. Rank ``(ep=i, tp=j)`` holds batch ``i``: the ``tp`` ranks of
one ep index pass the *same* tokens (tensor parallelism without sequence parallelism
replicates the activations over ``"tp"``), different ep indices different batches (the ep
ranks are data ranks, as in ``expert_parallel``). An MoE layer sits in a replicated region:
on every tp rank it routes the same tokens the same way, and its all-to-all runs within
the ranks of one tp index (the ``"ep"`` group of ``(*, j)``), so each token reaches each
of its experts exactly once per tp index and nothing is counted twice. The price of this
layout: the expert computation is repeated on the ``tp`` ranks of an ep index (torchtitan
instead splits the replicated tokens over tp before dispatching; not done here).

Gradients: of the mean over ``"ep"`` of every ep rank's loss, as ``expert_parallel``'s. A
trainable non-expert leaf (a tp block or a replicated leaf) enters through ``pvary`` over
``"ep"`` (its gradient psummed over the ranks holding the same tp block), every trainable
leaf counts ``1/ep``; an expert's gradient arrives summed over every ep rank's tokens (the
all-to-all's backward) and is equal on the tp ranks (replicated region: no tp reduction).
So ``sf.gather(grads, model.specs, mesh)`` is the unsplit model's gradient of the mean of
the ep ranks' losses.

Refused (``ValueError`` naming what is at fault): the same axis for tp and ep, another
mesh, a plan entry on an MoE layer or inside it (the router and experts are not split over
tp: no expert tensor parallelism), and sequence-parallel styles (the MoE layer would see
sequence chunks).

Cost per step: ``tensor_split``'s psums over ``"tp"`` plus ``expert_parallel``'s
all-to-alls over ``"ep"`` (once per tp rank, each in its own ep group), plus one psum over
``"ep"`` of each trainable non-expert leaf's gradient (``1/tp`` of the bytes for a tp
block). Memory per rank: ``1/ep`` of the experts, ``1/tp`` of the split attention leaves.

Example:
    >>> mesh = sf.Mesh({"ep": 2, "tp": 2})
    >>> ep = sf.expert_parallel(fm, mesh, "ep")
    >>> model = sf.tensor_split(ep, mesh, "tp", {"blocks.*.attn.qkv": "colwise",
    ...                                         "blocks.*.attn.proj": "rowwise"})
    >>> out = model.apply(model.init(0), x_local)    # x_local: batch of this ep index
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardfn._functional_layout import FunctionalNames
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.primitives.collectives import pvary
from shardfn.spec import Layout, LeafLayout
from shardfn.transforms._tp_model import TensorSplitModel
from shardfn.transforms._tp_styles import SequenceParallel
from shardfn.transforms.experts import ExpertParallelModel, counted_once

__all__ = ["TpEpModel", "local_view", "moe_paths", "over_expert_parallel_tp"]

Params = dict[str, torch.Tensor]


def moe_paths(ep: ExpertParallelModel) -> tuple[str, ...]:
    """Module paths of the MoE layers (or Hugging Face MoE blocks) of ``ep``: the expert
    leaves' names less ``experts.<leaf>`` (``""`` for a model that is one MoE layer).

    Example:
        >>> moe_paths(ep)
        ('blocks.0.mlp', 'blocks.1.mlp')
    """
    return tuple(sorted({".".join(name.split(".")[:-2]) for name in ep.experts}))


def local_view(ep: ExpertParallelModel) -> FunctionalModel:
    """``ep.inner`` over this rank's leaves, for ``tensor_split`` to split: expert leaves
    with ``E / ep`` rows, ``module`` the ep skeleton (MoE layers dispatching over ep).

    Its ``init``/``init_subset`` are not this rank's (they make full experts):
    :meth:`TpEpModel.init` cuts the unsplit init instead. (``_fsdp_ep.ep_local_model`` is
    the same view with those methods; importing it here would close an import cycle.)
    """
    plan, size = ep.inner._plan, ep.mesh.size(ep.axis)
    leaves = {name: leaf._replace(shape=torch.Size((leaf.shape[0] // size, *leaf.shape[1:])))
              if name in ep.experts else leaf for name, leaf in plan.leaves.items()}
    return dataclasses.replace(ep.inner, module=ep.module, _plan=plan._replace(leaves=leaves))


def _inside(path: str, layer: str) -> bool:
    return layer == "" or path == layer or path.startswith(layer + ".")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class TpEpModel(FunctionalNames):
    """``tensor_split`` of an ``expert_parallel`` model; see :func:`over_expert_parallel_tp`.

    Attributes:
        ep: the :class:`~shardfn.transforms.experts.ExpertParallelModel`.
        tp: the :class:`~shardfn.transforms._tp_model.TensorSplitModel` of the ep model seen
            as a functional model over this rank's ep leaves (its skeleton holds the MoE
            layers' all-to-alls).
    """

    ep: ExpertParallelModel
    tp: TensorSplitModel

    functional = property(lambda self: self.ep.inner)
    mesh = property(lambda self: self.tp.mesh)
    axis = property(lambda self: self.tp.axis)
    ep_axis = property(lambda self: self.ep.axis)
    names = property(lambda self: self.ep.names)
    experts = property(lambda self: self.ep.experts)
    styles = property(lambda self: self.tp.styles)

    @property
    def specs(self) -> dict[str, Layout | LeafLayout]:
        """``name -> layout``: ``P("ep")`` on dim 0 for the expert leaves, the tp layout
        (``Layout`` or ``FusedLayout``) of every other leaf."""
        ep, tp = self.ep.specs, self.tp.specs
        return {name: ep[name] if name in self.experts else tp[name] for name in self.names}

    # --- leaves: experts cut over ep, the others over tp; any subset of the names
    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """This rank's leaves of full leaves (any subset; no communication).

        Example:
            >>> leaves = model.shard(fm.init(0))   # == model.init(0)
        """
        return self.tp.shard(self.ep.shard(tree))

    def gather(self, leaves: Mapping[str, torch.Tensor]) -> Params:
        """Full leaves of every rank's leaves (params or gradients, any subset;
        differentiable), as ``sf.gather(leaves, model.specs, mesh)``.

        Example:
            >>> full = model.gather(grads)
        """
        return self.ep.gather(self.tp.gather(leaves))

    gather_params = gather

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's leaves of ``functional.init(seed)``, one submodule at a time."""
        out: Params = {}
        for path in self.ep.inner.module_paths:
            out.update(self.shard(self.ep.inner.init_subset(seed, [path], device=device)))
        return {name: out[name] for name in self.names}

    def params_from(self, module: nn.Module) -> Params:
        """This rank's leaves of a materialised (unsplit) module's values."""
        return self.shard(self.ep.inner.params_from(module))

    def check(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """Raise naming the leaf unless ``leaves`` has this rank's shapes."""
        self.tp.check(leaves)

    # --- the call
    def enter_ep(self, leaves: Mapping[str, torch.Tensor]) -> Params:
        """The leaves as the ep model's ``apply`` takes them: trainable non-expert ones
        through ``pvary`` over ep, each trainable one counting ``1/ep`` (the mean)."""
        size = self.ep.mesh.size(self.ep.axis)
        trainable = set(self.trainable_names) & set(leaves)
        if size == 1 or not trainable:
            return dict(leaves)
        varied = pvary({n: leaves[n] for n in trainable if n not in self.experts},
                       self.ep.axis, mesh=self.ep.mesh)
        return {name: counted_once(varied.get(name, leaf), size) if name in trainable else leaf
                for name, leaf in leaves.items()}

    def apply(self, leaves: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """Run the model on this rank's leaves and its ep index's tokens (the same on every
        tp rank of that index); pure, under ``torch.func`` and autograd. Gradients: of the
        mean over ep of each ep rank's loss (module docstring).

        Returns:
            What the module returns (replicated over tp unless the plan ends split); with
            ``mutable=True`` ``(output, new_buffers)``.

        Example:
            >>> out = model.apply(leaves, x_local)
        """
        self.tp.check(leaves)
        return self.tp.apply(self.enter_ep(leaves), *args, mutable=mutable, **kwargs)

    def apply_with_buffers(self, leaves: Mapping[str, torch.Tensor], *args: Any,
                           **kwargs: Any) -> tuple[Any, Params]:
        """``apply(leaves, *args, mutable=True, **kwargs)``."""
        return self.apply(leaves, *args, mutable=True, **kwargs)

    def split_trainable(self, leaves: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """``(trainable, rest)`` by name."""
        return self.tp.split_trainable(leaves)

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        """Inverse of :meth:`split_trainable`."""
        return self.tp.merge(trainable, rest)

    def train(self, mode: bool = True) -> TpEpModel:
        """The same model with its skeletons in training (or eval) mode."""
        return TpEpModel(self.ep.train(mode), self.tp.train(mode))

    def eval(self) -> TpEpModel:
        """Same as ``train(False)``."""
        return self.train(False)

    def __repr__(self) -> str:
        return f"TpEpModel({self.tp!r}, {self.ep!r})"


def over_expert_parallel_tp(split_fn: Callable, ep: ExpertParallelModel, mesh: Mesh, axis: str,
                            plan: Any) -> TpEpModel:
    """``tensor_split`` of an :class:`ExpertParallelModel` (called by ``tensor_split``).

    Args:
        split_fn: ``tensor_split``.
        ep: the expert-parallel model.
        mesh: its mesh (the same one), holding ``axis`` besides the ep axis.
        axis: the tensor-parallel axis.
        plan: the tensor-parallel plan; no entry on or inside an MoE layer.

    Returns:
        The :class:`TpEpModel`.

    Raises:
        TypeError: ``mesh`` is not an ``sf.Mesh``.
        ValueError: another mesh, ``axis`` equal to the ep axis or not on the mesh, a plan
            entry on an MoE layer (named) or a sequence-parallel style (named).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"tensor_split: mesh must be an sf.Mesh, got {type(mesh).__name__}")
    if mesh is not ep.mesh and (mesh.axis_names, mesh.shape, mesh.ranks) != (
            ep.mesh.axis_names, ep.mesh.shape, ep.mesh.ranks):
        shape = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        raise ValueError(f"tensor_split: the mesh {shape} is not the mesh the model was "
                         f"expert_parallel over; use one mesh")
    if axis == ep.axis:
        raise ValueError(f"tensor_split: axis {axis!r} is the expert-parallel axis of the "
                         f"model; tensor parallelism over an ep model needs its own axis, "
                         f"e.g. sf.Mesh({{'ep': 2, 'tp': 2}}) and tensor_split(ep, mesh, 'tp', "
                         f"plan) (ep reusing the tp ranks is not supported)")
    if axis not in mesh.axis_names:
        raise ValueError(f"tensor_split: axis {axis!r} is not an axis of the mesh "
                         f"{mesh.axis_names}")
    tp = split_fn(local_view(ep), mesh, axis, plan)  # a TensorSplitModel (plain input)
    layers = moe_paths(ep)
    for path, style in tp.styles.items():
        inside = [layer for layer in layers if _inside(path, layer)]
        if inside:
            raise ValueError(f"tensor_split over expert_parallel: the plan styles {path!r}, "
                             f"which is (inside) the MoE layer {inside[0]!r}; its router and "
                             f"experts are not split over {axis!r} (experts are split over "
                             f"{ep.axis!r}); style only the attention and dense layers")
        if isinstance(style, SequenceParallel) or getattr(style, "sequence_parallel", False):
            raise ValueError(f"tensor_split over expert_parallel: {path!r} has a "
                             f"sequence-parallel style ({type(style).__name__}); not supported "
                             f"with expert parallelism (the MoE layers would see sequence "
                             f"chunks): use the plan without sequence parallelism")
    return TpEpModel(ep, tp)
