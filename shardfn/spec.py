"""Partition specs, layouts, and sharding / gathering of pytrees.

``P("dp", None)`` says: split dim 0 over mesh axis ``"dp"``, keep dim 1 whole.
A part may be an axis name, a tuple of names (split over their product, major to
minor in mesh order) or None; dims past the end of the spec are replicated and
``P()`` is fully replicated.

**Uneven dims are padded, never refused.** A dim of size ``d`` split over ``n``
ranks gets blocks of ``ceil(d / n)`` rows; the last blocks are zero-padded so
that every rank holds a local shard of the same shape (collectives need equal
shapes). :func:`gather` cuts the padding off again, which needs the global
shape: give it :class:`Layout` spec leaves (as ``model.specs`` of sharded models
are, and as :func:`layout_of` builds). A bare ``P`` on a dim sharded over more
than one rank cannot tell ``d`` from the padded ``n * ceil(d / n)``, so
:func:`gather` refuses it (naming the leaf) unless ``padded=True`` asks for the
padded size; it never guesses.

A spec tree may be a prefix of the value tree (JAX's rule); a ``None`` in it
means replicated. A ``None`` in the *value* tree is an empty subtree (as in
JAX): it comes back as ``None`` whatever spec covers it, except a ``Layout``,
which describes a tensor and so refuses it. Every other value leaf must be a
tensor.

Example:
    >>> mesh = Mesh({"dp": 1})
    >>> x = torch.arange(6.0).reshape(3, 2)
    >>> local = shard(x, P("dp"), mesh)
    >>> torch.equal(gather(local, layout_of(x, P("dp")), mesh), x)
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import optree
import torch

from shardfn import pytree
from shardfn.mesh import Mesh, get_mesh
from shardfn.primitives import _comm, consistency
from shardfn.primitives.collectives import all_gather as _all_gather

__all__ = ["FusedLayout", "Layout", "LeafLayout", "P", "gather", "layout_of", "local_shape",
           "shard", "spec_axes"]

Part = str | tuple[str, ...] | None


class P:
    """A partition spec: one entry per tensor dim (axis name, tuple of names, or None).

    Example:
        >>> P("dp", None)
        P('dp', None)
    """

    __slots__ = ("parts",)

    def __init__(self, *parts: Part):
        clean: list[Part] = []
        for part in parts:
            if isinstance(part, list):
                part = tuple(part)
            if isinstance(part, tuple):
                if not all(isinstance(a, str) for a in part):
                    raise TypeError(f"P: a tuple part must hold axis names, got {part!r}")
                part = part[0] if len(part) == 1 else (part or None)
            elif part is not None and not isinstance(part, str):
                raise TypeError(f"P: each part is an axis name, a tuple of names or None, got "
                                f"{part!r}")
            clean.append(part)
        object.__setattr__(self, "parts", tuple(clean))

    def __setattr__(self, name, value):
        raise AttributeError("P is immutable")

    def __iter__(self) -> Iterator[Part]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, i):
        return self.parts[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, P) and _trim(self.parts) == _trim(other.parts)

    def __hash__(self) -> int:
        return hash(_trim(self.parts))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(p) for p in self.parts) + ")"

    def __reduce__(self):
        return (P, self.parts)


def _trim(parts: tuple) -> tuple:
    parts = list(parts)
    while parts and parts[-1] is None:
        parts.pop()
    return tuple(parts)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A partition spec together with the global (unpadded) shape it applies to.

    Attributes:
        spec: the partition spec.
        shape: the global shape of the full tensor.
    """

    spec: P
    shape: tuple[int, ...]


class LeafLayout:
    """Base of layouts no single ``P`` expresses (a fused split, a split of a split).

    A subclass (a frozen dataclass with a ``shape``: the global shape) says how to
    cut this rank's shard out of the full tensor and how to rebuild the full tensor
    from every rank's shards; :func:`shard` and :func:`gather` call these, so
    ``sf.gather(tree, model.specs, mesh)`` works for every model kind.
    """

    shape: tuple[int, ...]

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        """The shape of one rank's shard."""
        raise NotImplementedError

    def shard_leaf(self, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """This rank's shard of the full tensor ``x`` (no communication)."""
        raise NotImplementedError

    def gather_leaf(self, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """The full tensor from every rank's shard ``x`` (collective, differentiable)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FusedLayout(LeafLayout):
    """A fused colwise leaf: ``parts`` parts (``[q|k|v]``) on dim ``dim`` (0: ``Linear`` weight or
    bias; 1: ``Conv1D`` weight), each split over ``axis``; rank ``r`` holds ``q[r] | k[r] | v[r]``.

    Example:
        >>> FusedLayout("tp", 3, (32, 96), dim=1).local_shape(Mesh({"tp": 2}))
        (32, 48)
    """

    axis: str
    parts: int
    shape: tuple[int, ...]
    dim: int = 0

    def __post_init__(self) -> None:
        if type(self.dim) is not int or not 0 <= self.dim < len(self.shape):
            raise ValueError(f"{self}: dim {self.dim!r} is not a dim of shape {self.shape}")

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """The mesh axes the leaf is split over (as ``FsdpTpLayout.sharded_axes``)."""
        return (self.axis,)

    def _blocks(self, mesh: Mesh) -> tuple[int, int]:
        """``(axis size, one part's block on dim)``; refuses an uneven split naming the sizes."""
        n, size = mesh.size(self.axis), self.shape[self.dim]
        if type(self.parts) is not int or self.parts < 1 or size % (self.parts * n):
            raise ValueError(f"{self}: dim {self.dim} ({size}) must be divisible by parts x size "
                             f"of axis {self.axis!r} = {self.parts} x {n} = {self.parts * n}")
        return n, size // (self.parts * n)

    def local_shape(self, mesh: Mesh) -> tuple[int, ...]:
        block = self._blocks(mesh)[1]
        return tuple(self.parts * block if d == self.dim else s for d, s in enumerate(self.shape))

    def shard_leaf(self, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        split = x.unflatten(self.dim, (self.parts, *self._blocks(mesh)))  # part-major
        return split.select(self.dim + 1, mesh.index(self.axis)).flatten(self.dim, self.dim + 1)

    def gather_leaf(self, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        n, block = self._blocks(mesh)
        gathered = _all_gather(x, self.axis, dim=self.dim, mesh=mesh)  # rank-major
        split = gathered.unflatten(self.dim, (n, self.parts, block))
        return split.transpose(self.dim, self.dim + 1).reshape(self.shape)


def _is_spec_leaf(x: Any) -> bool:
    return isinstance(x, (P, Layout, LeafLayout))


def spec_axes(spec: P | Layout | None) -> tuple[str, ...]:
    """All mesh axes a spec shards over, in the order they appear.

    Example:
        >>> spec_axes(P(("dp", "tp"), None, "sp"))
        ('dp', 'tp', 'sp')
    """
    if spec is None:
        return ()
    if isinstance(spec, LeafLayout):
        return tuple(spec.sharded_axes)
    if isinstance(spec, Layout):
        spec = spec.spec
    names: list[str] = []
    for part in spec:
        names.extend((part,) if isinstance(part, str) else (part or ()))
    return tuple(names)


def _check(name: str, x: torch.Tensor, spec: P, mesh: Mesh) -> None:
    if len(spec) > x.dim():
        raise ValueError(f"leaf {name!r}: spec {spec} has {len(spec)} entries but the tensor has "
                         f"rank {x.dim()} (shape {tuple(x.shape)})")
    seen: set[str] = set()
    for axis in spec_axes(spec):
        if axis not in mesh.axis_names:
            raise ValueError(f"leaf {name!r}: spec {spec} names axis {axis!r}, which the mesh "
                             f"does not have (axes: {mesh.axis_names})")
        if axis in seen:
            raise ValueError(f"leaf {name!r}: spec {spec} uses axis {axis!r} twice")
        seen.add(axis)


def _flatten_specs(specs, tree) -> tuple[list[str], list, list, Any]:
    """Names, leaves (``None`` included, as a leaf) and one spec per leaf, and the treedef."""
    paths, leaves, treedef = optree.tree_flatten_with_path(
        tree, none_is_leaf=True, namespace=pytree.NAMESPACE)
    spec_leaves = pytree.broadcast_prefix(specs, tree, _is_spec_leaf)
    return [pytree.path_name(p) for p in paths], leaves, spec_leaves, treedef


def _check_leaf(op: str, name: str, x: Any, spec_leaf) -> bool:
    """Whether ``x`` is a tensor to work on (False: a None to pass through), or a clear error."""
    if x is None:
        if isinstance(spec_leaf, (Layout, LeafLayout)):
            raise TypeError(f"{op}: leaf {name!r} is None but its spec {spec_leaf} describes a "
                            f"tensor of shape {spec_leaf.shape}")
        return False
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: leaf {name!r} is a {type(x).__name__}, not a Tensor (None is "
                        "allowed: an empty subtree)")
    return True


def _as_spec(spec) -> P:
    if spec is None:
        return P()
    return spec.spec if isinstance(spec, Layout) else spec


def local_shape(shape: tuple[int, ...], spec: P | Layout | LeafLayout,
                mesh: Mesh) -> tuple[int, ...]:
    """Shape of one rank's (padded) local shard of a tensor of global ``shape``.

    Raises:
        ValueError: a spec that splits a dim ``shape`` does not have.

    Example:
        >>> local_shape((5, 3), P("dp"), Mesh({"dp": 1}))
        (5, 3)
    """
    if isinstance(spec, LeafLayout):
        return spec.local_shape(mesh)
    spec = _as_spec(spec)
    if len(_trim(tuple(spec))) > len(shape):
        raise ValueError(f"local_shape: spec {spec} splits dims beyond the {len(shape)} of shape "
                         f"{tuple(shape)}; give at most one entry per dim")
    out = list(shape)
    for dim, part in enumerate(spec):
        if part is not None:
            out[dim] = math.ceil(shape[dim] / mesh.size(part))
    return tuple(out)


def _shard_leaf(x: torch.Tensor, spec: P, mesh: Mesh) -> torch.Tensor:
    for dim, part in enumerate(spec):
        if part is None:
            continue
        n, i = mesh.size(part), mesh.index(part)
        block = math.ceil(x.shape[dim] / n)
        start = min(i * block, x.shape[dim])
        piece = x.narrow(dim, start, min(block, x.shape[dim] - start))
        if piece.shape[dim] < block:
            pad_shape = list(piece.shape)
            pad_shape[dim] = block - piece.shape[dim]
            piece = torch.cat([piece, piece.new_zeros(pad_shape)], dim=dim)
        x = piece
    return x


def shard(tree, specs, mesh: Mesh | None = None, *, replicated_over=None):
    """This rank's local shards of the full ``tree`` (zero-padded to equal shapes).

    Differentiable (it is slicing and padding). No communication: every rank
    must hold the full tree (check mode verifies that it does).

    Args:
        tree: a pytree of full tensors (``None`` leaves pass through).
        specs: a tree of ``P``/``Layout``/``LeafLayout`` (``FusedLayout``, ``FsdpTpLayout``;
            or None = replicated), a prefix of ``tree``.
        mesh: the mesh (default: the current mesh).
        replicated_over: the mesh axes (a name or tuple) over which ``tree`` is the
            same (what check mode verifies); default every axis. A shard of a shard
            (``shard_params`` over ``tensor_split``'s TP shards) is replicated over
            the axis it is sharded on only; ``()``: no check.

    Returns:
        A tree of local shards with ``tree``'s structure.

    Raises:
        ValueError: naming the leaf for a spec longer than its tensor's rank, an
            unknown or repeated axis, a ``Layout`` whose shape is not the
            tensor's, or a spec tree that does not fit ``tree``.
        TypeError: naming the leaf for a leaf that is not a tensor.

    Example:
        >>> local = sf.shard(params, {"w": sf.P("dp", None), "b": sf.P()}, mesh)
    """
    mesh = get_mesh(mesh)
    names, leaves, spec_leaves, treedef = _flatten_specs(specs, tree)
    for name, x, spec_leaf in zip(names, leaves, spec_leaves, strict=True):
        if not _check_leaf("shard", name, x, spec_leaf):
            continue
        if isinstance(spec_leaf, LeafLayout):
            _check_leaf_layout(name, spec_leaf, mesh)
        else:
            _check(name, x, _as_spec(spec_leaf), mesh)
        if isinstance(spec_leaf, (Layout, LeafLayout)) and \
                tuple(x.shape) != tuple(spec_leaf.shape):
            raise ValueError(f"shard: leaf {name!r} has shape {tuple(x.shape)} but its layout "
                             f"{spec_leaf} is for global shape {tuple(spec_leaf.shape)}")
    axes = mesh.axis_names if replicated_over is None else replicated_over
    if axes != () and (everything := _comm.resolve(axes, mesh)).size > 1:
        consistency.check_replicated("sf.shard input", everything, tree)
    out = [x if x is None else s.shard_leaf(x, mesh) if isinstance(s, LeafLayout)
           else _shard_leaf(x, _as_spec(s), mesh) for x, s in zip(leaves, spec_leaves, strict=True)]
    return pytree.tree_unflatten(treedef, out)


def _check_leaf_layout(name: str, layout: LeafLayout, mesh: Mesh) -> None:
    for axis in layout.sharded_axes:
        if axis not in mesh.axis_names:
            raise ValueError(f"leaf {name!r}: layout {layout} names axis {axis!r}, which the "
                             f"mesh does not have (axes: {mesh.axis_names})")


def _check_gather(name: str, x: torch.Tensor, spec_leaf, mesh: Mesh, padded: bool) -> None:
    if isinstance(spec_leaf, LeafLayout):
        _check_leaf_layout(name, spec_leaf, mesh)
    else:
        _check(name, x, _as_spec(spec_leaf), mesh)
    if isinstance(spec_leaf, (Layout, LeafLayout)):
        expected = local_shape(spec_leaf.shape, spec_leaf, mesh)
        if tuple(x.shape) != expected:
            raise ValueError(f"leaf {name!r}: local shard has shape {tuple(x.shape)} but "
                             f"layout {spec_leaf} of global shape {spec_leaf.shape} on mesh "
                             f"{dict(zip(mesh.axis_names, mesh.shape, strict=True))} "
                             f"gives {expected}")
        return
    spec = _as_spec(spec_leaf)
    for dim, part in enumerate(spec):
        n, local = (1, 0) if part is None else (mesh.size(part), x.shape[dim])
        if n > 1 and local > 0 and not padded:
            raise ValueError(
                f"gather: leaf {name!r} is sharded on dim {dim} over {part!r} ({n} ranks) with "
                f"a bare {spec}, which cannot tell its global size: an uneven split is padded, "
                f"so {n} shards of {local} hold from {n * (local - 1) + 1} to {n * local} real "
                "rows. Pass Layouts (sf.layout_of(full_tree, specs), or model.specs) for the "
                f"exact tensor, or padded=True for the padded size {n * local}")


def gather(tree, specs, mesh: Mesh | None = None, *, padded: bool = False):
    """Rebuild full tensors from local shards (all-gather along every sharded dim).

    Differentiable (the all-gathers transpose to reduce-scatters).

    Args:
        tree: a pytree of local shards, as :func:`shard` returns (``None`` leaves
            pass through).
        specs: a tree of ``Layout`` (exact: padding is removed), ``LeafLayout``
            (``FusedLayout``, ``FsdpTpLayout``: as ``model.specs`` hold) or, for dims
            not sharded over more than one rank, ``P``; a prefix of ``tree``.
        mesh: the mesh (default: the current mesh).
        padded: allow a bare ``P`` on a sharded dim, giving the padded size
            ``axis size * local size`` (exact only for even splits).

    Returns:
        The tree of full tensors (identical on every rank).

    Raises:
        ValueError: naming the leaf, for a bare ``P`` on a dim sharded over more
            than one rank (without ``padded=True``), a local shard whose shape the
            layout does not give, or a bad spec.
        TypeError: naming the leaf, for a leaf that is not a tensor.

    Example:
        >>> full = sf.gather(local, sf.layout_of(params, specs), mesh)
    """
    from shardfn.primitives.collectives import all_gather

    mesh = get_mesh(mesh)
    names, leaves, spec_leaves, treedef = _flatten_specs(specs, tree)
    for name, x, spec_leaf in zip(names, leaves, spec_leaves, strict=True):
        if _check_leaf("gather", name, x, spec_leaf):
            _check_gather(name, x, spec_leaf, mesh, padded)
    out = []
    for x, spec_leaf in zip(leaves, spec_leaves, strict=True):
        if x is not None and isinstance(spec_leaf, LeafLayout):
            out.append(spec_leaf.gather_leaf(x, mesh))
            continue
        for dim, part in enumerate(_as_spec(spec_leaf) if x is not None else ()):
            if part is None:
                continue
            x = all_gather(x, part, dim=dim, mesh=mesh)
            if isinstance(spec_leaf, Layout):
                x = x.narrow(dim, 0, spec_leaf.shape[dim])
        out.append(x)
    return pytree.tree_unflatten(treedef, out)


def layout_of(tree, specs):
    """Pair every leaf's spec with the leaf's global shape (a tree of :class:`Layout`).

    Args:
        tree: a pytree of full tensors (or anything with ``.shape``, e.g. meta
            tensors); ``None`` leaves stay ``None``.
        specs: a tree of ``P`` (or None), a prefix of ``tree``.

    Returns:
        A tree of ``Layout`` with ``tree``'s structure.

    Example:
        >>> sf.layout_of({"w": torch.zeros(5, 3)}, sf.P("dp"))
        {'w': Layout(spec=P('dp'), shape=(5, 3))}
    """
    names, leaves, spec_leaves, treedef = _flatten_specs(specs, tree)
    out = []
    for name, x, spec in zip(names, leaves, spec_leaves, strict=True):
        if x is not None and not hasattr(x, "shape"):
            raise TypeError(f"layout_of: leaf {name!r} is a {type(x).__name__}, which has no "
                            ".shape (give tensors or meta tensors)")
        out.append(None if x is None else Layout(_as_spec(spec), tuple(x.shape)))
    return pytree.tree_unflatten(treedef, out)
