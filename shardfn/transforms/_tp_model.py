"""The record ``tensor_split`` returns: :class:`TensorSplitModel` (init, apply, gather, shard).

:func:`shardfn.tensor_split` builds it (:mod:`.tensor_split`); this module holds what
it does afterwards: ``init(seed)`` (this rank's shards, one submodule at a time),
a pure ``apply`` over the private skeleton (with the per-call RNG streams, the
shared colwise inputs and the check-mode comparisons), and the conversions between
full leaves and this rank's shards (``shard`` / ``gather``, through ``specs``).

Example:
    >>> tp = sf.tensor_split(fmodel, mesh, "tp", {"fc1": "colwise", "fc2": "rowwise"})
    >>> full = tp.gather(tp.init(0))   # == fmodel.init(0)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfn._functional_layout import FunctionalNames
from shardfn._functional_leaves import refuse_differentiated_state
from shardfn._functional_swap import call_module
from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.spec import Layout, LeafLayout, gather, local_shape, shard, spec_axes
from shardfn.transforms._tp_checks import (
    check_apply,
    check_init,
    checking,
    note_plan,
    value_hashes,
)
from shardfn.transforms._tp_rng import call_streams
from shardfn.transforms._tp_sequence import shared_inputs
from shardfn.transforms._tp_styles import Style

__all__ = ["TensorSplitModel"]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class TensorSplitModel(FunctionalNames):
    """A functional model whose planned layers are split over ``axis``; see :func:`tensor_split`.

    Attributes:
        fmodel: the unsplit functional model (also ``functional``, as every model kind
            names it; ``param_names`` ... ``frozen_names`` are its own).
        mesh, axis: where the split layers live.
        styles: ``module path -> style`` for every matched module.
        module: the private skeleton ``apply`` runs (split modules wrapped).
        specs: ``name -> Layout`` (or ``sf.FusedLayout``, dim 0 or 1) for every leaf.
        names: every leaf name, as ``fmodel.names``.
    """

    fmodel: FunctionalModel
    mesh: Mesh
    axis: str
    styles: Mapping[str, Style]
    module: nn.Module
    specs: Mapping[str, Layout | LeafLayout]

    @property
    def functional(self) -> FunctionalModel:
        """The unsplit functional model (``fmodel``)."""
        return self.fmodel

    @property
    def names(self) -> tuple[str, ...]:
        return self.fmodel.names

    @property
    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """``name -> shape`` of this rank's shard of each leaf."""
        out = {}
        for name, layout in self.specs.items():
            if isinstance(layout, LeafLayout):  # FusedLayout (dim 0: Linear, 1: Conv1D)
                out[name] = tuple(layout.local_shape(self.mesh))
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

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """Cut this rank's shards out of full leaves, any subset of them (no communication).

        Args:
            tree: ``name -> full Tensor`` for any of ``fmodel``'s leaves (its ``init``,
                a gradient tree, the trainable part); fused leaves too.

        Returns:
            ``name -> local shard`` (split leaves are copies, not views of ``tree``),
            in ``names`` order; :meth:`gather` is its inverse.

        Raises:
            TypeError / ValueError: a name that is not a leaf, or a leaf that is not full.

        Example:
            >>> params = tp.shard(fmodel.init(0))   # == tp.init(0)
        """
        self.fmodel.check_leaves(tree, "tensor_split.shard")
        check_init(self, value_hashes(tree) if checking(self) else {}, "tensor_split.shard")
        return self.cut(tree)

    shard_params_tree = shard  # its first name

    def params_from(self, module: nn.Module) -> Params:
        """This rank's shards of a module's values: ``shard(fmodel.params_from(module))``.

        Example:
            >>> params = tp.params_from(net)
        """
        return self.shard(self.fmodel.params_from(module))

    def cut(self, full: Mapping[str, torch.Tensor]) -> Params:
        """This rank's shards of the leaves in ``full``, any subset of the names (no checks,
        no communication): split leaves are copies, replicated ones ``full``'s tensors."""
        out = {}
        for name, x in full.items():
            layout = self.specs[name]
            if isinstance(layout, LeafLayout):
                x = layout.shard_leaf(x, self.mesh).clone()
            elif spec_axes(layout):  # uneven dims: zero-padded, as sf.shard pads
                x = shard(x, layout, self.mesh, replicated_over=()).clone()
            out[name] = x
        return {name: out[name] for name in self.names if name in out}

    def gather(self, params: Mapping[str, torch.Tensor]) -> Params:
        """The full tree from every rank's shards (differentiable), as ``sf.gather`` with ``specs``.

        Works on gradients too, and on any subset of the leaves (the trainable part of
        ``split_trainable``, a gradient tree without buffers); every rank must pass the
        same names.

        Raises:
            ValueError: a name that is not a leaf, or a leaf whose shape is not its
                local shard's.

        Example:
            >>> full = tp.gather(params)   # == fmodel.init(0)
        """
        self.check_leaves(params, "tensor_split.gather")
        return self.gather_leaves(params)

    gather_params = gather  # its first name

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
        with call_streams(self.mesh.index(self.axis)), note_plan(self), shared_inputs():
            if torch.compiler.is_compiling():  # call_module fills global caches: a first
                out = torch.func.functional_call(  # call in a trace would recompile later
                    self.module, call_params, args, kwargs, tie_weights=True, strict=True)
            else:
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
