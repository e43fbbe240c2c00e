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
  ``sf.gather(params, model.specs, mesh) == fmodel.init(seed)``.

Fused projections (``Colwise(fused=3)`` on a ``[q|k|v]`` linear): rank ``r``
holds ``q[r] | k[r] | v[r]``, which no plain ``Layout`` describes (it is a
strided split). Their ``specs`` entry is an ``sf.FusedLayout``, which
``sf.gather``/``sf.shard`` handle like any layout (as do
``model.gather_params(params)`` and ``model.shard_params_tree(full)``).

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

from shardfn._functional_leaves import refuse_differentiated_state
from shardfn._functional_swap import call_module
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh, get_mesh
from shardfn.spec import FusedLayout, Layout, P, gather, local_shape, shard, spec_axes
from shardfn.transforms._tp_checks import (
    check_apply,
    check_init,
    checking,
    note_plan,
    value_hashes,
)
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
    leaf_specs,
    wrap,
)
from shardfn.transforms.precision import split_precision, with_precision

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
        hashes: dict[str, str] = {}  # check mode: the full leaves, compared over the axis
        for path in self.fmodel.module_paths:
            full = self.fmodel.init_subset(seed, [path], device=device)
            if checking(self):
                hashes.update(value_hashes(full))
            out.update(self.cut(full))
        check_init(self, hashes, "tensor_split.init")
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
        check_init(self, value_hashes(full) if checking(self) else {},
                   "tensor_split.shard_params_tree")
        return self.cut(full)

    def cut(self, full: Mapping[str, torch.Tensor]) -> Params:
        """This rank's shards of the leaves in ``full``, any subset of the names (no checks,
        no communication): split leaves are copies, replicated ones ``full``'s tensors."""
        out = {}
        for name, x in full.items():
            layout = self.specs[name]
            if isinstance(layout, FusedLayout):
                x = layout.shard_leaf(x, self.mesh).clone()
            elif spec_axes(layout):  # even splits (tensor_split refuses uneven ones)
                x = shard(x, layout, self.mesh, replicated_over=()).clone()
            out[name] = x
        return {name: out[name] for name in self.names if name in out}

    def gather_params(self, params: Mapping[str, torch.Tensor]) -> Params:
        """The full tree from every rank's shards (differentiable).

        Works on gradients too, and on any subset of the leaves (the trainable part of
        ``split_trainable``, a gradient tree without buffers); every rank must pass the
        same names.

        Raises:
            ValueError: a name that is not a leaf, or a leaf whose shape is not its
                local shard's.

        Example:
            >>> full = tp.gather_params(params)   # == fmodel.init(0)
        """
        self.check_leaves(params, "gather_params")
        return self.gather_leaves(params)

    def check_leaves(self, tree: Mapping[str, torch.Tensor], what: str = "tensor_split") -> None:
        """Check that ``tree`` holds leaves of the model (any subset) with local shard shapes."""
        if not isinstance(tree, Mapping):
            raise TypeError(f"{what}: expected a dict name -> local shard, got "
                            f"{type(tree).__name__}")
        unknown = [name for name in tree if name not in self.specs]
        if unknown:
            raise ValueError(f"{what}: not leaves of the model: {unknown}; its leaves are "
                             f"{list(self.names)}")
        shapes = self.local_shapes
        for name, x in tree.items():
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{what}: leaf {name!r} is a {type(x).__name__}, not a Tensor")
            if tuple(x.shape) != tuple(shapes[name]):
                raise ValueError(f"{what}: leaf {name!r} has shape {tuple(x.shape)}, but its "
                                 f"local shard on axis {self.axis!r} "
                                 f"({self.mesh.size(self.axis)} ranks) is {shapes[name]}")

    def gather_leaves(self, local: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves from every rank's shards of the leaves in ``local``, any subset of
        the names (every rank must pass the same names); differentiable."""
        names = [n for n in self.names if n in local]
        return gather({n: local[n] for n in names}, {n: self.specs[n] for n in names}, self.mesh)

    # ---------------------------------------------------------------- apply

    def check(self, params: Mapping[str, torch.Tensor]) -> None:
        """Check names and local shapes of a tree of this rank's shards (names each bad leaf)."""
        self.fmodel.check(params, shapes=False)
        self.check_leaves(params)

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
        refuse_differentiated_state(params, self.fmodel.buffer_names, self.fmodel.frozen_names,
                                    "tensor_split.apply")
        check_apply(self, args, kwargs)  # check mode: same plan and inputs on every tp rank
        call_params = dict(params)
        for name in self.fmodel.buffer_names:
            call_params[name] = call_params[name].clone()
        with call_streams(self.mesh.index(self.axis)), note_plan(self):
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
        fmodel: a :class:`~shardfn.FunctionalModel` (``sf.functional(module)``), or
            ``sf.with_precision(fm, p)``: then ``with_precision(tensor_split(fm, ...), p)``.
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
    fmodel, policy = split_precision(fmodel)  # docs/composing.md
    if policy is not None:  # tensor_split(with_precision(fm, p)) == with_precision(split(fm), p)
        return with_precision(tensor_split(fmodel, mesh, axis, plan), policy)
    if not isinstance(fmodel, FunctionalModel):
        hint = ""
        if isinstance(fmodel, TensorSplitModel):
            hint = f"; it is split over {fmodel.axis!r} already: one tensor_split, one plan"
        elif hasattr(fmodel, "specs"):  # a sharded model: the valid order is the other one
            hint = ("; split first, then shard: shard_params(tensor_split(fm, mesh, 'tp', "
                    "plan), mesh, 'dp')")
        raise TypeError(f"tensor_split expects a FunctionalModel (sf.functional(module)), "
                        f"got {type(fmodel).__name__}{hint}")
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"tensor_split: plan must be a dict {{glob over module paths: style}}, "
                        f"e.g. {{'mlp.fc1': 'colwise', 'mlp.fc2': 'rowwise'}}; got a "
                        f"{type(plan).__name__}: {plan!r:.200}" + (
                            " (a list of (glob, style) pairs: pass dict(pairs))"
                            if isinstance(plan, list | tuple) else ""))
    bad_keys = [key for key in (plan or {}) if not isinstance(key, str)]
    if bad_keys:
        raise TypeError(f"tensor_split: plan keys must be globs over module paths (str), got "
                        f"{bad_keys!r:.200}")
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
