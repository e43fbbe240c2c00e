"""Partition specs, layouts, and sharding / gathering of pytrees.

``P("dp", None)`` says: split dim 0 over mesh axis ``"dp"``, keep dim 1 whole.
A part may be an axis name, a tuple of names (split over their product, major to
minor in mesh order) or None; dims past the end of the spec are replicated and
``P()`` is fully replicated.

**Uneven dims are padded, never refused.** A dim of size ``d`` split over ``n``
ranks gets blocks of ``ceil(d / n)`` rows; the last blocks are zero-padded so
that every rank holds a local shard of the same shape (collectives need equal
shapes). :func:`gather` cuts the padding off again — exactly when it knows the
global shape, i.e. when the spec leaf is a :class:`Layout` (as
``model.specs`` of sharded models are, and as :func:`layout_of` builds). With a
bare ``P`` the gathered dim is ``n * ceil(d / n)``, which is exact for even
splits.

A spec tree may be a prefix of the value tree (JAX's rule); a ``None`` in it
means replicated.

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

import torch

from shardfn import pytree
from shardfn.mesh import Mesh, get_mesh

__all__ = ["Layout", "P", "gather", "layout_of", "local_shape", "shard", "spec_axes"]

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


def _is_spec_leaf(x: Any) -> bool:
    return isinstance(x, (P, Layout))


def spec_axes(spec: P | Layout | None) -> tuple[str, ...]:
    """All mesh axes a spec shards over, in the order they appear.

    Example:
        >>> spec_axes(P(("dp", "tp"), None, "sp"))
        ('dp', 'tp', 'sp')
    """
    if spec is None:
        return ()
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
    names, leaves, treedef = pytree.tree_flatten_with_path(tree)
    spec_leaves = pytree.broadcast_prefix(specs, tree, _is_spec_leaf)
    return names, leaves, spec_leaves, treedef


def _as_spec(spec) -> P:
    if spec is None:
        return P()
    return spec.spec if isinstance(spec, Layout) else spec


def local_shape(shape: tuple[int, ...], spec: P | Layout, mesh: Mesh) -> tuple[int, ...]:
    """Shape of one rank's (padded) local shard of a tensor of global ``shape``.

    Example:
        >>> local_shape((5, 3), P("dp"), Mesh({"dp": 1}))
        (5, 3)
    """
    spec = _as_spec(spec)
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


def shard(tree, specs, mesh: Mesh | None = None):
    """This rank's local shards of the full ``tree`` (zero-padded to equal shapes).

    Differentiable (it is slicing and padding). No communication: every rank
    must hold the full tree.

    Args:
        tree: a pytree of full tensors.
        specs: a tree of ``P``/``Layout`` (or None = replicated), a prefix of ``tree``.
        mesh: the mesh (default: the current mesh).

    Returns:
        A tree of local shards with ``tree``'s structure.

    Raises:
        ValueError: naming the leaf for a spec longer than its tensor's rank, an
            unknown or repeated axis, or a spec tree that does not fit ``tree``.

    Example:
        >>> local = sf.shard(params, {"w": sf.P("dp", None), "b": sf.P()}, mesh)
    """
    mesh = get_mesh(mesh)
    names, leaves, spec_leaves, treedef = _flatten_specs(specs, tree)
    out = []
    for name, x, spec in zip(names, leaves, spec_leaves, strict=True):
        spec = _as_spec(spec)
        _check(name, x, spec, mesh)
        out.append(_shard_leaf(x, spec, mesh))
    return pytree.tree_unflatten(treedef, out)


def gather(tree, specs, mesh: Mesh | None = None):
    """Rebuild full tensors from local shards (all-gather along every sharded dim).

    Differentiable (the all-gathers transpose to reduce-scatters).

    Args:
        tree: a pytree of local shards, as :func:`shard` returns.
        specs: a tree of ``Layout`` (exact: padding is removed) or ``P`` (the
            gathered dim is ``axis size * local size``), a prefix of ``tree``.
        mesh: the mesh (default: the current mesh).

    Returns:
        The tree of full tensors (identical on every rank).

    Example:
        >>> full = sf.gather(local, sf.layout_of(params, specs), mesh)
    """
    from shardfn.primitives.collectives import all_gather

    mesh = get_mesh(mesh)
    names, leaves, spec_leaves, treedef = _flatten_specs(specs, tree)
    out = []
    for name, x, spec_leaf in zip(names, leaves, spec_leaves, strict=True):
        spec = _as_spec(spec_leaf)
        _check(name, x, spec, mesh)
        if isinstance(spec_leaf, Layout):
            expected = local_shape(spec_leaf.shape, spec, mesh)
            if tuple(x.shape) != expected:
                raise ValueError(f"leaf {name!r}: local shard has shape {tuple(x.shape)} but "
                                 f"layout {spec} of global shape {spec_leaf.shape} on mesh "
                                 f"{dict(zip(mesh.axis_names, mesh.shape, strict=True))} "
                                 f"gives {expected}")
        for dim, part in enumerate(spec):
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
        tree: a pytree of full tensors (or anything with ``.shape``, e.g. meta tensors).
        specs: a tree of ``P`` (or None), a prefix of ``tree``.

    Returns:
        A tree of ``Layout`` with ``tree``'s structure.

    Example:
        >>> sf.layout_of({"w": torch.zeros(5, 3)}, sf.P("dp"))
        {'w': Layout(spec=P('dp'), shape=(5, 3))}
    """
    names, leaves, spec_leaves, treedef = _flatten_specs(specs, tree)
    out = [Layout(_as_spec(s), tuple(x.shape)) for x, s in zip(leaves, spec_leaves, strict=True)]
    return pytree.tree_unflatten(treedef, out)
