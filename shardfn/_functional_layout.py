"""A :class:`~shardfn.functional.FunctionalModel`'s leaves as a tree: shapes, layouts, shard/gather.

The unsharded model is the trivial case of the model protocol (:mod:`shardfn.model`):
no mesh, every leaf whole (``Layout(P(), shape)``), so ``shard`` and ``gather`` are the
identity on any subset of the leaves (after checking their names and shapes). These
members live here, apart from ``init``/``apply`` (:mod:`shardfn.functional`), as
:class:`LeafTree`, a base class of ``FunctionalModel`` that reads only its leaves
(``_plan.leaves``), ``names``, ``tied`` and ``check``.

:func:`check_leaves` is the check every model kind makes of a tree holding *some*
of its leaves (a gradient tree, the trainable part) before sharding or gathering it,
and :class:`FunctionalNames` gives a model whose every rank holds (a shard of) every
leaf the name tuples of its ``functional``.

Example:
    >>> fm = sf.functional(torch.nn.Linear(3, 2))
    >>> fm.specs["weight"]
    Layout(spec=P(), shape=(2, 3))
    >>> fm.gather(fm.shard({"bias": torch.zeros(2)}))
    {'bias': tensor([0., 0.])}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfn._functional_leaves import describe_unknown
from shardfn.spec import Layout, P

__all__ = ["FunctionalNames", "LeafTree", "ShapeDtype", "check_leaves"]

Params = dict[str, torch.Tensor]


class ShapeDtype(NamedTuple):
    """Shape and dtype of one leaf, known without materialising it."""

    shape: torch.Size
    dtype: torch.dtype


def check_leaves(tree: Any, shapes: Mapping[str, tuple[int, ...]], what: str, *,
                 tied: Mapping[str, str] | None = None, kind: str = "full") -> None:
    """Check that ``tree`` holds some leaves of a model (any subset), each of its shape.

    Args:
        tree: what was given, expected a ``name -> Tensor`` mapping.
        shapes: ``leaf name -> expected shape`` for every leaf of the model.
        what: the operation, for the messages (``"shard_params.shard"``).
        tied: alias -> leaf name, so an alias is named with the leaf to pass instead.
        kind: which shape ``shapes`` holds, for the messages (``"full"``, ``"local shard"``).

    Raises:
        TypeError: ``tree`` is not a mapping, or holds a non-tensor (named).
        ValueError: names that are not leaves (all listed, with close names), or a leaf
            whose shape is not ``shapes[name]`` (both shapes given).

    Example:
        >>> check_leaves({"bias": torch.zeros(2)}, {"weight": (2, 3), "bias": (2,)}, "shard")
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"{what}: expected a dict name -> Tensor holding any of the model's "
                        f"leaves, got {type(tree).__name__}")
    unknown = [name for name in tree if name not in shapes]
    if unknown:
        described = [describe_unknown(name, tied or {}, list(shapes)) for name in unknown]
        raise ValueError(f"{what}: not leaves of the model: {', '.join(described)}; its leaves "
                         f"are {list(shapes)}")
    for name, x in tree.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: leaf {name!r} is a {type(x).__name__}, not a Tensor")
        if tuple(x.shape) != tuple(shapes[name]):
            raise ValueError(f"{what}: leaf {name!r} has shape {tuple(x.shape)}, but its {kind} "
                             f"shape is {tuple(shapes[name])}")


class LeafTree:
    """The tree members of :class:`~shardfn.functional.FunctionalModel` (its base class).

    Reads ``self._plan.leaves``, ``self.names``, ``self.tied`` and ``self.check``.
    """

    @property
    def functional(self) -> Any:
        """The unsharded model this model computes: itself."""
        return self

    @property
    def mesh(self) -> None:
        """None: the leaves are laid out over no mesh."""
        return None

    @property
    def specs(self) -> dict[str, Layout]:
        """``name -> Layout(P(), shape)``: every leaf whole (replicated), in ``names`` order.

        Example:
            >>> sf.functional(torch.nn.Linear(3, 2)).specs["bias"]
            Layout(spec=P(), shape=(2,))
        """
        return {name: Layout(P(), tuple(leaf.shape)) for name, leaf in self._plan.leaves.items()}

    def param_shapes(self) -> dict[str, ShapeDtype]:
        """``name -> ShapeDtype(shape, dtype)`` for every leaf, without materialising anything.

        Example:
            >>> functional(torch.nn.Linear(3, 2)).param_shapes()["weight"]
            ShapeDtype(shape=torch.Size([2, 3]), dtype=torch.float32)
        """
        leaves = self._plan.leaves
        return {name: ShapeDtype(leaf.shape, leaf.dtype) for name, leaf in leaves.items()}

    def abstract(self) -> Params:
        """``name -> meta Tensor``: the tree of ``init``'s result with shapes/dtypes but no data.

        Example:
            >>> functional(torch.nn.Linear(3, 2)).abstract()["bias"]
            tensor(..., device='meta', size=(2,))
        """
        return {
            name: torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
            for name, leaf in self._plan.leaves.items()
        }

    def check_leaves(self, tree: Mapping[str, torch.Tensor], what: str = "check_leaves") -> None:
        """Check that ``tree`` holds some of the leaves (any subset), each of its full shape.

        Args:
            tree: ``name -> Tensor``.
            what: the operation, for the messages.

        Raises:
            TypeError / ValueError: as :func:`check_leaves` (the leaf named).

        Example:
            >>> fm.check_leaves({"bias": torch.zeros(2)})
        """
        shapes = {name: tuple(leaf.shape) for name, leaf in self._plan.leaves.items()}
        check_leaves(tree, shapes, what, tied=self.tied)

    def shard(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """This model's leaves of full leaves: the same tensors (nothing is split), any subset.

        Args:
            tree: ``name -> full Tensor`` for any of the leaves (params, gradients, the
                trainable part).

        Returns:
            A new dict of the same tensors, in ``names`` order.

        Raises:
            TypeError / ValueError: a name that is not a leaf, or a wrong shape (named).

        Example:
            >>> fm.shard(fm.init(0)).keys() == fm.init(0).keys()
            True
        """
        self.check_leaves(tree, "FunctionalModel.shard")
        return {name: tree[name] for name in self.names if name in tree}

    def gather(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves of this model's leaves: the same tensors (they are whole), any subset.

        Args:
            tree: ``name -> Tensor`` for any of the leaves.

        Returns:
            A new dict of the same tensors (differentiable: the identity), in ``names`` order.

        Raises:
            TypeError / ValueError: a name that is not a leaf, or a wrong shape (named).

        Example:
            >>> trainable, _ = fm.split_trainable(fm.init(0))
            >>> fm.gather(trainable).keys() == trainable.keys()
            True
        """
        self.check_leaves(tree, "FunctionalModel.gather")
        return {name: tree[name] for name in self.names if name in tree}

    def params_from(self, module: nn.Module) -> Params:
        """The current values of a materialised module of the same structure, as a params dict.

        Args:
            module: a module with the same leaf names (typically the original one).

        Returns:
            ``name -> Tensor`` (detached, sharing storage with ``module``).

        Raises:
            ValueError / TypeError: the module lacks a leaf or has one of another shape.

        Example:
            >>> linear = torch.nn.Linear(3, 2)
            >>> functional(linear).params_from(linear)["weight"] is not None
            True
        """
        found = dict(module.named_parameters(remove_duplicate=False))
        found.update(module.named_buffers(remove_duplicate=False))
        params = {name: found[name].detach() for name in self.names if name in found}
        self.check(params)
        return params


class FunctionalNames:
    """``param_names``, ``buffer_names``, ``trainable_names``, ``frozen_names``: those of
    ``self.functional``, for a model kind whose every rank holds (a shard of) every leaf
    (``shard_params``, ``tensor_split``, FSDP x TP; a base class)."""

    @property
    def param_names(self) -> tuple[str, ...]:
        """The parameters, as ``functional.param_names``."""
        return self.functional.param_names

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """The buffers, as ``functional.buffer_names``."""
        return self.functional.buffer_names

    @property
    def trainable_names(self) -> tuple[str, ...]:
        """The trainable parameters, as ``functional.trainable_names``."""
        return self.functional.trainable_names

    @property
    def frozen_names(self) -> tuple[str, ...]:
        """The frozen parameters, as ``functional.frozen_names``."""
        return self.functional.frozen_names
