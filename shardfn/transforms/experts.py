"""Expert parallelism: a model's experts split over a mesh axis, tokens sent to them and back.

``sf.expert_parallel(fm, mesh, axis="ep")`` takes a functional model containing
:class:`~shardfn.models.moe.MoE` layers and returns an :class:`ExpertParallelModel`. Each
rank holds the experts of its block of dim 0 (``E / ep`` of them: ``Layout(P(axis))`` in
``specs``) and every other leaf whole (replicated). Its ``apply`` runs the model with
each MoE layer's dispatch replaced by an all-to-all over the axis
(:class:`~shardfn.models.moe_dispatch.AllToAllExperts`): the router runs on this rank's
tokens, the kept rows travel to the ranks holding their experts (counts first, then
rows with variable splits) and come back to be combined.

The ranks of the axis are data-parallel ranks too (DeepSpeed-MoE's layout: each sees its
own tokens), and the gradient ``apply`` gives is the one of the *mean over the axis* of
every rank's loss, as ``shard_params`` does:

* an expert's gradient arrives summed over every rank's tokens (the all-to-all's backward),
  and each rank's loss counts ``1/ep``;
* a replicated leaf enters through ``pvary`` (backward psum over the axis), also ``1/ep``.

So on one process with the same tokens on every rank the gradients are the unsplit
model's, and ``sf.gather(grads, model.specs, mesh)`` gives the full tree. Composed with
data parallelism over another axis (a ``{"dp": 2, "ep": 2}`` mesh), average *every*
gradient over ``"dp"`` afterwards (``sf.data_parallel(mesh, "dp").reduce_grads``): the
expert leaves are then reduced over the ranks holding the same experts and the others over
all data ranks, DeepSpeed's two groups.

Cost per step and rank: expert memory ``1/ep`` of the experts; per MoE call the counts
(``8 E (ep-1)/ep`` bytes) and the rows this rank sends to, then receives from, the other
ranks, twice more in backward (:mod:`shardfn.models.moe_dispatch`); the replicated
gradients one psum over the axis.

Example:
    >>> ep = sf.expert_parallel(sf.functional(net), sf.Mesh({"ep": 2}), "ep")
    >>> params = ep.init(0)                  # experts [E/2, ...] on each rank
    >>> out, aux = ep.apply(params, x)       # x: this rank's tokens
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfn._functional_leaves import refuse_differentiated_state
from shardfn._functional_swap import call_module
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.models.moe import MoE
from shardfn.models.moe_dispatch import AllToAllExperts
from shardfn.primitives.collectives import pvary
from shardfn.spec import Layout, P
from shardfn.spec import gather as gather_tree
from shardfn.spec import shard as shard_tree
from shardfn.transforms._experts_hf import split_hf_experts

__all__ = ["ExpertParallelModel", "expert_parallel", "expert_leaves"]

Params = dict[str, torch.Tensor]
EXPERT_LEAVES = ("experts.gate_up_proj", "experts.down_proj")


def expert_leaves(module: nn.Module) -> dict[str, int]:
    """``leaf name -> number of experts`` of every expert leaf of the MoE layers in ``module``.

    Example:
        >>> expert_leaves(MoE(4, 8, num_experts=2))
        {'experts.gate_up_proj': 2, 'experts.down_proj': 2}
    """
    found = {}
    for path, sub in module.named_modules():
        if isinstance(sub, MoE):
            for leaf in EXPERT_LEAVES:
                found[f"{path}.{leaf}" if path else leaf] = sub.num_experts
    return found


def counted_once(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` itself, whose gradient is divided by ``n`` (each rank's loss counts ``1/n``)."""
    return x.detach() + (x - x.detach()) / n


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertParallelModel:
    """A functional model whose MoE experts are split over ``axis`` (see the module docstring).

    Attributes:
        inner: the unsplit functional model.
        mesh: the mesh; ``axis`` is the expert-parallel axis.
        axis: the axis name.
        module: the skeleton ``apply`` runs: a copy of ``inner.module`` whose MoE layers
            dispatch over the axis.
        experts: ``leaf name -> experts`` of the split leaves.
    """

    inner: FunctionalModel
    mesh: Mesh
    axis: str
    module: nn.Module
    experts: Mapping[str, int]

    # --- what this rank holds: every leaf; experts their block of dim 0
    functional = property(lambda self: self.inner)
    names = property(lambda self: self.inner.names)
    param_names = property(lambda self: self.inner.param_names)
    buffer_names = property(lambda self: self.inner.buffer_names)
    trainable_names = property(lambda self: self.inner.trainable_names)
    frozen_names = property(lambda self: self.inner.frozen_names)

    @property
    def specs(self) -> dict[str, Layout]:
        """``Layout(P(axis), shape)`` for the expert leaves, ``Layout(P(), shape)`` else."""
        shapes = {name: tuple(t.shape) for name, t in self.inner.abstract().items()}
        return {name: Layout(P(self.axis) if name in self.experts else P(), shapes[name])
                for name in self.names}

    # --- leaves: cut and joined by those layouts, any subset of the names
    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """This rank's leaves of full leaves (any subset of the names)."""
        specs = self.specs
        return shard_tree(dict(tree), {name: specs[name] for name in tree}, self.mesh)

    def gather(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """Full leaves of this rank's leaves (any subset; differentiable)."""
        specs = self.specs
        return gather_tree(dict(tree), {name: specs[name] for name in tree}, self.mesh)

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's leaves of ``inner.init(seed)``: its experts, every other leaf."""
        return self.shard(self.inner.init(seed, device))

    def params_from(self, module: nn.Module) -> Params:
        """This rank's leaves of a materialised module's values."""
        return self.shard(self.inner.params_from(module))

    def split_trainable(self, params: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """``(trainable, rest)`` by name."""
        return self.inner.split_trainable(params)

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        """Inverse of :meth:`split_trainable`."""
        return self.inner.merge(trainable, rest)

    def train(self, mode: bool = True) -> ExpertParallelModel:
        """A copy in training (or eval) mode; ``self`` is unchanged."""
        skeleton = copy.deepcopy(self.module)  # the dispatch (and its mesh) is shared
        skeleton.train(mode)
        return dataclasses.replace(self, inner=self.inner.train(mode), module=skeleton)

    def eval(self) -> ExpertParallelModel:
        """Same as ``train(False)``."""
        return self.train(False)

    # --- the call
    def check(self, params: Mapping[str, torch.Tensor]) -> None:
        """Names as the model's, shapes as this rank's leaves (a clear error names the leaf)."""
        self.inner.check(params, shapes=False)
        specs, ep = self.specs, self.mesh.size(self.axis)
        for name, layout in specs.items():
            want = list(layout.shape)
            if name in self.experts:
                want[0] //= ep
            if tuple(params[name].shape) != tuple(want):
                kind = f"this rank's {want[0]} of {layout.shape[0]} experts" \
                    if name in self.experts else "the full leaf"
                raise ValueError(f"expert_parallel.apply: leaf {name!r} has shape "
                                 f"{tuple(params[name].shape)}, expected {tuple(want)} ({kind}; "
                                 f"ep={ep} over axis {self.axis!r})")

    def apply(self, params: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """Run the model on this rank's tokens with this rank's experts; pure, under
        ``torch.func`` and autograd. Gradients: of the mean over the axis of each rank's
        loss (see the module docstring).

        Returns:
            What the module returns (a MoE layer: ``(output, MoEAux)`` for this rank's
            tokens); with ``mutable=True`` ``(output, new_buffers)``.

        Example:
            >>> out, aux = ep.apply(params, x_local)
        """
        if not isinstance(mutable, bool):
            raise TypeError(f"apply: mutable must be True or False, got {mutable!r}")
        self.check(params)
        refuse_differentiated_state(params, self.buffer_names, self.frozen_names,
                                    "expert_parallel.apply")
        ep = self.mesh.size(self.axis)
        call_params = dict(params)
        for name in self.trainable_names:
            leaf = call_params[name]
            if ep > 1 and name not in self.experts:
                leaf = pvary(leaf, self.axis, mesh=self.mesh)
            call_params[name] = counted_once(leaf, ep) if ep > 1 else leaf
        for name in self.buffer_names:
            call_params[name] = call_params[name].clone()
        out = call_module(self.module, call_params, args, kwargs)
        if not mutable:
            return out
        return out, {name: call_params[name] for name in self.buffer_names}

    def __repr__(self) -> str:
        return (f"ExpertParallelModel(axis={self.axis!r}, ep={self.mesh.size(self.axis)}, "
                f"expert leaves={len(self.experts)})")


def expert_parallel(fmodel: FunctionalModel, mesh: Mesh, axis: str = "ep") -> ExpertParallelModel:
    """Split the experts of every MoE layer of ``fmodel`` over ``axis`` (expert parallelism).

    Args:
        fmodel: a :class:`~shardfn.functional.FunctionalModel` holding
            :class:`~shardfn.models.moe.MoE` layers.
        mesh: the mesh; ``axis`` must be one of its axes.
        axis: the expert-parallel axis; every layer's ``num_experts`` must divide by its size.

    Returns:
        An :class:`ExpertParallelModel` (the model protocol: ``init``, ``apply``, ``specs``,
        ``shard``/``gather``...).

    Raises:
        TypeError: ``fmodel`` is not a FunctionalModel (an already split or sharded model).
        ValueError: no MoE layer, an unknown axis, or experts that do not divide by the
            axis size (named with the layer).

    Example:
        >>> ep = sf.expert_parallel(sf.functional(MoE(8, 16, num_experts=4)), mesh, "ep")

    Cost: see the module docstring (experts/ep of the expert memory per rank; the rows'
    all-to-alls, four per MoE call and step).
    """
    if not isinstance(fmodel, FunctionalModel):
        hint = ("; for tensor parallelism on the attention (TP x EP) the order is "
                "sf.tensor_split(sf.expert_parallel(fm, mesh, 'ep'), mesh, 'tp', plan)"
                if hasattr(fmodel, "styles") else "")  # a TensorSplitModel (or TP x EP)
        raise TypeError(f"expert_parallel takes a FunctionalModel (sf.functional(module)), got "
                        f"{type(fmodel).__name__}; apply expert_parallel first, then other "
                        f"transforms over other axes{hint}")
    if axis not in mesh.axis_names:
        raise ValueError(f"expert_parallel: axis {axis!r} is not an axis of the mesh "
                         f"{dict(zip(mesh.axis_names, mesh.shape, strict=True))}")
    ep = mesh.size(axis)
    skeleton = copy.deepcopy(fmodel.module)
    layers = [(path, sub) for path, sub in skeleton.named_modules() if isinstance(sub, MoE)]
    hf_leaves = split_hf_experts(skeleton, mesh, axis)  # Hugging Face MoE blocks (_experts_hf)
    if not layers and not hf_leaves:
        raise ValueError(f"expert_parallel: {type(fmodel.module).__name__} holds no "
                         f"shardfn.models.MoE layer or Hugging Face MoE block: nothing to "
                         f"split over {axis!r}")
    for path, layer in layers:
        if layer.num_experts % ep:
            raise ValueError(f"expert_parallel: MoE layer {path or '(root)'!r} has "
                             f"E={layer.num_experts} experts, not divisible by ep={ep} (the "
                             f"size of axis {axis!r}); choose an ep that divides E")
        layer.dispatch = AllToAllExperts(mesh, axis)
    return ExpertParallelModel(fmodel, mesh, axis, skeleton,
                               {**expert_leaves(skeleton), **hf_leaves})
