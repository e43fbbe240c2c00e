"""Hypothesis strategies for sharded-equals-unsharded property tests.

* :func:`meshes`: mesh shapes ``{axis: size}`` (1-D and 2-D) fitting 1..N ranks;
* :func:`shapes`: tensor shapes, uneven and size-1 dims included;
* :func:`partition_specs`: a ``P`` valid for a shape and a mesh;
* :func:`sharded_arrays`: ``(shape, spec)`` pairs for a mesh;
* :func:`pytrees`: small nested dicts of random tensors;
* :func:`models`: :class:`~shardfn.testing.tiny_models.TinyModel` factories (MLP or
  transformer-like, with tied weights, a buffer, a frozen layer).

Everything drawn is a plain, picklable value (dicts, tuples, ``P``, frozen
dataclasses), so it can be shipped to a local world. Needs hypothesis, a test
dependency (``pip install 'shardfn[test]'``); without it, importing this module
raises ``ModuleNotFoundError`` saying so.

Example:
    >>> @given(mesh=meshes(max_ranks=4), data=st.data())
    ... def test_roundtrip(mesh, data):
    ...     shape = data.draw(shapes())
    ...     spec = data.draw(partition_specs(shape, mesh))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

try:
    from hypothesis import strategies as st
except ModuleNotFoundError as missing:  # hypothesis is a test dependency, not a runtime one
    if missing.name is None or missing.name.split(".")[0] != "hypothesis":
        raise
    raise ModuleNotFoundError(
        "shardfn.testing.strategies needs hypothesis, which is not installed: install the "
        "test extra, pip install 'shardfn[test]' (or just pip install hypothesis)",
        name="hypothesis") from missing

from shardfn.spec import P
from shardfn.testing.tiny_models import TinyModel

__all__ = ["meshes", "models", "partition_specs", "pytrees", "shapes", "sharded_arrays"]

MeshShape = dict[str, int]


def meshes(max_ranks: int = 4, *, min_ranks: int = 1, axis_names: Sequence[str] = ("dp", "tp"),
           max_dims: int = 2) -> st.SearchStrategy[MeshShape]:
    """Mesh shapes over ``min_ranks..max_ranks`` ranks with 1 to ``max_dims`` axes.

    Args:
        max_ranks, min_ranks: bounds on the product of the sizes (the world size).
        axis_names: names for the axes, in mesh order (the first ``k`` for ``k`` axes).
        max_dims: 1 or 2 (at most ``len(axis_names)``).

    Returns:
        A strategy of ``{name: size}`` dicts; 2-D shapes may have size-1 axes.

    Example:
        >>> meshes(4).example()  # e.g. {"dp": 2, "tp": 2}
    """
    if not 1 <= min_ranks <= max_ranks:
        raise ValueError(f"meshes: need 1 <= min_ranks <= max_ranks, got {min_ranks}, "
                         f"{max_ranks}")
    dims = min(max_dims, len(axis_names))
    if dims < 1:
        raise ValueError("meshes: need at least one axis name and max_dims >= 1")
    shapes_ = [(n,) for n in range(min_ranks, max_ranks + 1)]
    if dims >= 2:
        shapes_ += [(a, b) for a in range(1, max_ranks + 1) for b in range(1, max_ranks + 1)
                    if min_ranks <= a * b <= max_ranks]
    return st.sampled_from(shapes_).map(
        lambda sizes: dict(zip(axis_names, sizes, strict=False)))


def shapes(*, min_dims: int = 1, max_dims: int = 3, min_side: int = 1,
           max_side: int = 7) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes; sides from ``min_side`` to ``max_side`` (size 1 and odd sizes included).

    Example:
        >>> shapes(max_dims=2).example()  # e.g. (5, 1)
    """
    return st.lists(st.integers(min_side, max_side), min_size=min_dims,
                    max_size=max_dims).map(tuple)


@st.composite
def partition_specs(draw, shape: Sequence[int], mesh: Mapping[str, int], *,
                    even: bool = False, allow_tuples: bool = True) -> P:
    """A partition spec valid for ``shape`` on ``mesh``: each axis used at most once.

    Args:
        shape: the tensor's global shape.
        mesh: ``{axis: size}``.
        even: only split dims that divide by their axes' size (no padding).
        allow_tuples: a dim may be split over a tuple of axes (their product).

    Returns:
        A ``P`` with one part per dim (axis name, tuple of names, or None).
    """
    free = list(mesh)
    parts = []
    for side in shape:
        options = [None, *free]
        if allow_tuples and len(free) >= 2:
            options.append(tuple(free[:2]))
        part = draw(st.sampled_from(options))
        names = () if part is None else (part,) if isinstance(part, str) else part
        if even and side % math.prod(mesh[a] for a in names):
            part, names = None, ()
        free = [a for a in free if a not in names]
        parts.append(part)
    return P(*parts)


@st.composite
def sharded_arrays(draw, mesh: Mapping[str, int], *, max_dims: int = 3, max_side: int = 7,
                   even: bool = False) -> tuple[tuple[int, ...], P]:
    """A ``(shape, spec)`` pair valid on ``mesh`` (uneven splits included unless ``even``)."""
    shape = draw(shapes(min_dims=0, max_dims=max_dims, max_side=max_side))
    return shape, draw(partition_specs(shape, mesh, even=even))


@st.composite
def pytrees(draw, *, max_leaves: int = 4, shape: st.SearchStrategy | None = None,
            dtypes: Sequence[torch.dtype] = (torch.float32,), nested: bool = True) -> dict:
    """A small dict (nested one level with ``nested``) of random tensors.

    Args:
        max_leaves: at most this many tensors (at least one).
        shape: the strategy of each leaf's shape (default: :func:`shapes` with 0..3 dims).
        dtypes: dtypes to draw from (floating ones get ``randn`` values, others ``randint``).
        nested: some leaves sit in a sub-dict.

    Returns:
        ``{name: Tensor}``, possibly with one ``{name: {name: Tensor}}`` level.
    """
    shape = shapes(min_dims=0, max_dims=3) if shape is None else shape
    count = draw(st.integers(1, max_leaves))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tree: dict = {}
    for i in range(count):
        leaf_shape, dtype = draw(shape), draw(st.sampled_from(list(dtypes)))
        if dtype.is_floating_point:
            value = torch.randn(leaf_shape, generator=gen).to(dtype)
        else:
            value = torch.randint(-5, 6, leaf_shape, generator=gen).to(dtype)
        if nested and draw(st.booleans()):
            tree.setdefault("sub", {})[f"x{i}"] = value
        else:
            tree[f"x{i}"] = value
    return tree


@st.composite
def models(draw, *, kinds: Sequence[str] = ("mlp", "transformer"), max_layers: int = 2,
           d_models: Sequence[int] = (8, 12, 16), options: bool = True) -> TinyModel:
    """A :class:`~shardfn.testing.tiny_models.TinyModel` (call it to build the module).

    Args:
        kinds: which families to draw from.
        max_layers: at most this many blocks.
        d_models: model widths to draw from (transformers use 2 heads).
        options: draw ``tied`` / ``buffer`` / ``frozen`` too (else all off).

    Example:
        >>> module = models(kinds=("mlp",)).example()()
    """
    flags = (dict(tied=draw(st.booleans()), buffer=draw(st.booleans()),
                  frozen=draw(st.booleans())) if options else {})
    return TinyModel(kind=draw(st.sampled_from(list(kinds))),
                     d_model=draw(st.sampled_from(list(d_models))),
                     hidden=draw(st.integers(3, 17)), n_layers=draw(st.integers(1, max_layers)),
                     vocab=draw(st.integers(5, 13)), n_heads=2, seq=draw(st.integers(2, 8)),
                     **flags)
