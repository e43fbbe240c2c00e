"""Tensor parallelism: ``tensor_split`` splits chosen layers of a functional model over an axis.

``tensor_split(fmodel, mesh, "tp", plan)`` reads a plan ``{glob over module
paths: style}`` (styles in :mod:`shardfn.transforms._tp_styles`: ``"colwise"``,
``"rowwise"``, ``"vocab"``, ``"replicate"`` or style objects with options) and
returns a :class:`TensorSplitModel`:

* ``init(seed)``: this rank's shards, cut from ``fmodel.init(seed)``;
* ``apply(params, ...)``: pure, torch.func-compatible: the leaves swapped into a
  private copy of the skeleton, as ``functional_call`` does (where each goes is
  worked out once), whose matched modules are replaced by wrappers holding the
  same parameter names (the user's module is never changed); each
  wrapper computes its local slice and puts the collectives around it
  (Megatron ``f`` = ``sf.pvary`` into a colwise layer, ``g`` =
  ``sf.psum_invariant`` out of a rowwise layer or a vocab embedding);
* ``specs``: ``name -> sf.Layout`` (global shape and ``P``), so
  ``sf.gather(params, model.specs, mesh) == fmodel.init(seed)``, except for
  fused leaves (below).

Fused projections (``Colwise(fused=3)`` on a ``[q|k|v]`` linear): rank ``r``
holds ``q[r] | k[r] | v[r]``, which no plain ``Layout`` describes (it is a
strided split). Their ``specs`` entry is a :class:`FusedLayout`, which
``sf.gather``/``sf.shard`` do not accept (they raise); use
``model.gather_params(params)`` and ``model.shard_params_tree(full)``, which
handle every leaf.

Cost per step, per split MLP block (colwise then rowwise) on activations of
``B`` bytes over ``tp`` ranks: one psum (``2 B (tp-1)/tp`` sent) forward (the
rowwise output) and one backward (the colwise input's gradient).

Sequence parallel (Megatron-SP; ``Colwise/Rowwise/Vocab(sequence_parallel=True)``
and ``SequenceParallel()`` on the LayerNorms, position embedding and dropouts
between them, :mod:`shardfn.transforms._tp_sequence`): the activations between
the split regions are this rank's sequence chunk; the psums become an
all-gather into each colwise layer and a reduce-scatter out of each rowwise
layer (the reverse in backward), ``B (tp-1)/tp`` each.

Dropout RNG (:mod:`shardfn.transforms._tp_rng`): replicated regions draw from the
global generator (equal on every rank entered with the same RNG state);
``SplitRNG()`` / ``SequenceParallel()`` modules draw from a per-rank stream.

Example:
    >>> mlp = sf.functional(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)))
    >>> tp = sf.tensor_split(mlp, mesh, "tp", {"0": "colwise", "2": "rowwise"})
    >>> params = tp.init(0); y = tp.apply(params, x)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfn._functional_swap import call_module
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh, get_mesh
from shardfn.primitives import all_gather
from shardfn.spec import Layout, P, gather, local_shape, spec_axes
from shardfn.transforms._tp_plan import (
    check_sequence_parallel,
    check_tied,
    detect_fused,
    match_plan,
)
from shardfn.transforms._tp_rng import call_streams
from shardfn.transforms._tp_styles import (
    Colwise,
    Replicate,
    Rowwise,
    SequenceParallel,
    SplitRNG,
    Style,
    Vocab,
    fused_full,
    fused_local,
    leaf_specs,
    wrap,
)

__all__ = [
    "Colwise",
    "FusedLayout",
    "Replicate",
    "Rowwise",
    "SequenceParallel",
    "SplitRNG",
    "Style",
    "TensorSplitModel",
    "Vocab",
    "tensor_split",
]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """The layout of a fused colwise leaf: ``parts`` parts, each split on dim 0 over ``axis``.

    Not a :class:`~shardfn.Layout`: ``sf.gather``/``sf.shard`` refuse it; use
    ``TensorSplitModel.gather_params`` / ``shard_params_tree``.
    """

    axis: str
    parts: int
    shape: tuple[int, ...]

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """The mesh axes the leaf is split over (as ``FsdpTpLayout.sharded_axes``)."""
        return (self.axis,)

    def _refuse(self) -> TypeError:
        return TypeError(f"{self} describes a fused leaf (rank r holds block r of each of its "
                         f"{self.parts} parts), which sf.gather/sf.shard cannot express: use "
                         "TensorSplitModel.gather_params(params) / shard_params_tree(full)")

    def __len__(self) -> int:
        raise self._refuse()

    def __iter__(self):
        raise self._refuse()


@dataclasses.dataclass(frozen=True, eq=False)
class TensorSplitModel:
    """A functional model whose planned layers are split over ``axis``; see :func:`tensor_split`.

    Attributes:
        fmodel: the unsplit functional model.
        mesh, axis: where the split layers live.
        styles: ``module path -> style`` for every matched module.
        module: the private skeleton ``apply`` runs (split modules wrapped).
        specs: ``name -> Layout`` (or :class:`FusedLayout`) for every leaf.
        names: every leaf name, as ``fmodel.names``.
    """

    fmodel: FunctionalModel
    mesh: Mesh
    axis: str
    styles: Mapping[str, Style]
    module: nn.Module
    specs: Mapping[str, Layout | FusedLayout]

    @property
    def names(self) -> tuple[str, ...]:
        return self.fmodel.names

    @property
    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """``name -> shape`` of this rank's shard of each leaf."""
        tp = self.mesh.size(self.axis)
        out = {}
        for name, layout in self.specs.items():
            if isinstance(layout, FusedLayout):
                out[name] = (layout.shape[0] // tp, *layout.shape[1:])
            else:
                out[name] = local_shape(layout.shape, layout, self.mesh)
        return out

    # ---------------------------------------------------------------- init

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's shards of ``fmodel.init(seed, device)``, built one submodule at a time.

        Each submodule's leaves are made (``fmodel.init_subset``), cut to this
        rank's shard (a copy) and dropped, so the peak is the largest submodule,
        not the full model. Equal to ``shard_params_tree(fmodel.init(seed))``.

        Example:
            >>> params = tp.init(0)   # params["0.weight"].shape == (32 // tp_size, 8)
        """
        out: Params = {}
        for path in self.fmodel.module_paths:
            out.update(self.cut(self.fmodel.init_subset(seed, [path], device=device)))
        return {name: out[name] for name in self.names}

    def shard_params_tree(self, full: Mapping[str, torch.Tensor]) -> Params:
        """Cut this rank's shards out of a full tree (no communication; fused leaves too).

        Args:
            full: ``name -> full Tensor`` with every leaf of ``fmodel``.

        Returns:
            ``name -> local shard`` (split leaves are copies, not views of ``full``),
            in ``names`` order.
        """
        self.fmodel.check(full)
        return self.cut(full)

    def cut(self, full: Mapping[str, torch.Tensor]) -> Params:
        """This rank's shards of the leaves in ``full``, any subset of the names (no checks,
        no communication): split leaves are copies, replicated ones ``full``'s tensors."""
        tp, rank = self.mesh.size(self.axis), self.mesh.index(self.axis)
        out = {}
        for name, x in full.items():
            layout = self.specs[name]
            if isinstance(layout, FusedLayout):
                out[name] = fused_local(x, layout.parts, tp, rank).clone()
                continue
            if spec_axes(layout):
                for dim, part in enumerate(layout.spec):
                    if part is not None:
                        block = x.shape[dim] // tp
                        x = x.narrow(dim, rank * block, block)
                x = x.clone()
            out[name] = x
        return {name: out[name] for name in self.names if name in out}

    def gather_params(self, params: Mapping[str, torch.Tensor]) -> Params:
        """The full tree from every rank's shards (differentiable; works on gradients too).

        Example:
            >>> full = tp.gather_params(params)   # == fmodel.init(0)
        """
        self.check(params)
        return self.gather_leaves(params)

    def gather_leaves(self, local: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves from every rank's shards of the leaves in ``local``, any subset of
        the names (every rank must pass the same names); differentiable."""
        names = [n for n in self.names if n in local]
        plain = [n for n in names if not isinstance(self.specs[n], FusedLayout)]
        full = gather({n: local[n] for n in plain}, {n: self.specs[n] for n in plain}, self.mesh)
        tp = self.mesh.size(self.axis)
        for name in names:
            layout = self.specs[name]
            if isinstance(layout, FusedLayout):
                gathered = all_gather(local[name], self.axis, dim=0, mesh=self.mesh)
                full[name] = fused_full(gathered, layout.parts, tp)
        return {name: full[name] for name in names}

    # ---------------------------------------------------------------- apply

    def check(self, params: Mapping[str, torch.Tensor]) -> None:
        """Check names and local shapes of a tree of this rank's shards (names each bad leaf)."""
        self.fmodel.check(params, shapes=False)
        for name, shape in self.local_shapes.items():
            if tuple(params[name].shape) != tuple(shape):
                raise ValueError(f"tensor_split: leaf {name!r} has shape "
                                 f"{tuple(params[name].shape)}, but its local shard on axis "
                                 f"{self.axis!r} ({self.mesh.size(self.axis)} ranks) is {shape}")

    def apply(self, params: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False,
              **kwargs: Any) -> Any:
        """Run the model with this rank's shards; pure, under torch.func and autograd.

        Every rank must pass the same (replicated) inputs, except where a
        sequence-parallel plan starts on sequence chunks (then each rank passes
        its chunk); outputs of the model are replicated unless the plan ends on a
        colwise layer without ``gather_output`` (then they are this rank's slice)
        or in a sequence-parallel region (this rank's chunk).

        Random ops (dropout) follow :mod:`shardfn.transforms._tp_rng`: replicated
        regions use the global generator (enter with the same RNG state on every
        rank), ``SplitRNG`` / ``SequenceParallel`` modules a per-rank stream
        derived from it.

        With ``mutable=True`` returns ``(output, new_buffers)`` as
        ``FunctionalModel.apply`` does (buffers are replicated: each rank's statistics
        are those of the batch it saw, the whole batch in tensor parallelism).

        Example:
            >>> loss = tp.apply(params, x).square().mean()
        """
        if not isinstance(mutable, bool):
            raise TypeError(f"apply: mutable must be True or False, got {mutable!r}")
        self.check(params)
        call_params = dict(params)
        for name in self.fmodel.buffer_names:
            call_params[name] = call_params[name].clone()
        with call_streams(self.mesh.index(self.axis)):
            out = call_module(self.module, call_params, args, kwargs)
        if not mutable:
            return out
        return out, {name: call_params[name] for name in self.fmodel.buffer_names}

    def apply_with_buffers(self, params: Mapping[str, torch.Tensor], *args: Any,
                           **kwargs: Any) -> tuple[Any, Params]:
        """``apply(params, *args, mutable=True, **kwargs)``: ``(output, new_buffers)``."""
        return self.apply(params, *args, mutable=True, **kwargs)

    def train(self, mode: bool = True) -> TensorSplitModel:
        """A copy whose skeletons are in training (or eval) mode; ``self`` is unchanged.

        Example:
            >>> tp.eval().module.training
            False
        """
        skeleton = copy.deepcopy(self.module)  # the wrappers' meshes are shared, not copied
        skeleton.train(mode)
        return dataclasses.replace(self, module=skeleton, fmodel=self.fmodel.train(mode))

    def eval(self) -> TensorSplitModel:
        """Same as ``train(False)``."""
        return self.train(False)

    # ---------------------------------------------------------------- helpers

    def split_trainable(self, params: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """``(trainable, rest)`` by name, as ``FunctionalModel.split_trainable``."""
        return self.fmodel.split_trainable(params)

    def merge(self, trainable: Mapping[str, torch.Tensor],
              rest: Mapping[str, torch.Tensor]) -> Params:
        """Inverse of :meth:`split_trainable`, as ``FunctionalModel.merge``."""
        return self.fmodel.merge(trainable, rest)

    def __repr__(self) -> str:
        styles = ", ".join(f"{path}: {type(s).__name__}" for path, s in self.styles.items())
        return f"TensorSplitModel(axis={self.axis!r}, tp={self.mesh.size(self.axis)}, {{{styles}}})"


def tensor_split(fmodel: FunctionalModel, mesh: Mesh | None = None, axis: str = "tp",
                 plan: Mapping[str, object] | None = None) -> TensorSplitModel:
    """Split the layers named by ``plan`` over mesh axis ``axis`` (Megatron tensor parallelism).

    Args:
        fmodel: a :class:`~shardfn.FunctionalModel` (``sf.functional(module)``).
        mesh: the mesh (default: the current one); ``axis`` must be one of its axes.
        axis: the tensor-parallel axis.
        plan: ``{fnmatch glob over module paths: style}``; a style is ``"colwise"``,
            ``"rowwise"``, ``"vocab"``, ``"replicate"``, ``"sequence_parallel"``,
            ``"split_rng"`` or ``Colwise(gather_output=..., fused=..., n_heads=...,
            sequence_parallel=...)``, ``Rowwise(sequence_parallel=...)``,
            ``Vocab(sequence_parallel=...)``, ``Replicate()``, ``SequenceParallel()``
            (LayerNorm / RMSNorm / position embedding / dropout on sequence chunks),
            ``SplitRNG()`` (a parameter-free module on split activations: its random
            ops use this rank's stream; see :mod:`shardfn.transforms._tp_rng`).

    Returns:
        The :class:`TensorSplitModel`.

    Raises:
        ValueError: a pattern that matches no module (the paths are listed), a
            module matched twice, a style on a module it cannot split (named), a
            dimension not divisible by the axis size (module, dim and sizes), a
            split leaf that is tied to another name, an unknown axis; with sequence
            parallelism, a replicated trainable leaf whose module has no
            sequence-parallel (or explicit ``Replicate``) style. At apply, a sequence
            not divisible by the axis size (module, dim and sizes).
        TypeError: ``fmodel`` is not a FunctionalModel.

    Communication per call (activations of ``B`` bytes, ``tp`` ranks): each
    rowwise layer and vocab embedding does one psum (``2 B (tp-1)/tp``) in
    forward; each colwise layer's input does one psum in backward; a
    ``gather_output`` colwise layer one all-gather in forward. Sequence parallel:
    each of those psums becomes an all-gather (colwise input, ``B (tp-1)/tp``) or a
    reduce-scatter (rowwise / vocab output, ``B (tp-1)/tp``), and in backward the
    reverse, plus one psum per replicated leaf used on sequence chunks (its
    gradient). Memory: split leaves take ``1/tp`` of their bytes per rank.

    Example:
        >>> tp = sf.tensor_split(fmodel, mesh, "tp", {"blocks.*.mlp.fc1": "colwise",
        ...                                            "blocks.*.mlp.fc2": "rowwise"})
    """
    if not isinstance(fmodel, FunctionalModel):
        raise TypeError(f"tensor_split expects a FunctionalModel (sf.functional(module)), "
                        f"got {type(fmodel).__name__}")
    mesh = get_mesh(mesh)
    if axis not in mesh.axis_names:
        raise ValueError(f"tensor_split: axis {axis!r} is not an axis of the mesh "
                         f"{mesh.axis_names}")
    tp = mesh.size(axis)
    skeleton = copy.deepcopy(fmodel.module)
    paths = [p for p, _ in skeleton.named_modules(remove_duplicate=False)]
    styles = match_plan(plan or {}, paths)
    split: dict[str, tuple[P, str, Style]] = {}  # leaf name (aliases too) -> spec, module, style
    for path, style in styles.items():
        module = skeleton.get_submodule(path)
        style = styles[path] = detect_fused(style, path, skeleton)
        for leaf, spec in leaf_specs(module, path, style, axis, tp).items():
            if getattr(module, leaf, None) is not None:
                split[f"{path}.{leaf}"] = (spec, path, style)
        parent_path, _, child = path.rpartition(".")
        setattr(skeleton.get_submodule(parent_path), child,
                wrap(module, style, mesh, axis, path))
    for alias, owner_name in fmodel.tied.items():
        check_tied(alias, owner_name, split, axis)
    check_sequence_parallel(fmodel, styles, split)
    specs: dict[str, Layout | FusedLayout] = {}
    for name, shape in fmodel.param_shapes().items():
        spec, _, style = split.get(name, (P(), "", Replicate()))
        fused = isinstance(style, Colwise) and style.fused > 1
        specs[name] = (FusedLayout(axis, style.fused, tuple(shape.shape)) if fused
                       else Layout(spec, tuple(shape.shape)))
    specs = {name: specs[name] for name in fmodel.names}
    return TensorSplitModel(fmodel, mesh, axis, styles, skeleton, specs)
