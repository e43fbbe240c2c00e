"""Pytree helpers over optree, in shardfn's own registry namespace.

Choices (the same as JAX's, stated once here):

* **dict order.** Flattening visits dict keys in sorted order, so two dicts with
  the same keys flatten to the same leaf order whatever their insertion order;
  unflattening restores the insertion order of the tree the spec came from.
* **None.** ``None`` is an empty subtree, not a leaf: ``{"w": x, "b": None}`` has
  one leaf. In a *spec* tree a ``None`` written where the value tree has a
  tensor or subtree means "replicated" (see :func:`broadcast_prefix`).
* **paths.** A leaf is named by its path joined with dots (``"blocks.0.w"``);
  error messages use these names.

Example:
    >>> from shardfn import pytree as pt
    >>> pt.tree_paths({"a": {"w": 1, "b": 2}})
    ['a.b', 'a.w']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

NAMESPACE = "shardfn"

PyTree = Any

__all__ = [
    "NAMESPACE",
    "broadcast_prefix",
    "path_name",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_map_with_path",
    "tree_paths",
    "tree_structure",
    "tree_unflatten",
]


def tree_flatten(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None):
    """Flatten ``tree`` into ``(leaves, treespec)`` in the shardfn namespace."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_unflatten(treespec, leaves) -> PyTree:
    """Inverse of :func:`tree_flatten`."""
    return optree.tree_unflatten(treespec, leaves)


def tree_leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list:
    """The leaves of ``tree`` in flattening order."""
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_structure(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None):
    """The treespec of ``tree``."""
    return optree.tree_structure(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_map(fn: Callable, tree: PyTree, *rest: PyTree, is_leaf=None) -> PyTree:
    """Map ``fn`` over the leaves of ``tree`` (and matching leaves of ``rest``).

    Raises:
        ValueError: if a tree in ``rest`` does not have ``tree``'s structure; the
            message names the first differing path.
    """
    if rest:
        _check_same_structure(tree, rest, is_leaf)
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_map_with_path(fn: Callable, tree: PyTree, *rest: PyTree, is_leaf=None) -> PyTree:
    """Like :func:`tree_map` but ``fn(name, leaf, *others)`` gets the dotted leaf name."""
    if rest:
        _check_same_structure(tree, rest, is_leaf)
    return optree.tree_map_with_path(
        lambda path, *xs: fn(path_name(path), *xs),
        tree,
        *rest,
        is_leaf=is_leaf,
        namespace=NAMESPACE,
    )


def tree_flatten_with_path(tree: PyTree, is_leaf=None):
    """``(names, leaves, treespec)`` with dotted leaf names."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    return [path_name(p) for p in paths], leaves, spec


def tree_paths(tree: PyTree, is_leaf=None) -> list[str]:
    """Dotted names of the leaves of ``tree`` in flattening order."""
    return [path_name(p) for p in optree.tree_paths(tree, is_leaf=is_leaf, namespace=NAMESPACE)]


def path_name(path: tuple) -> str:
    """Join an optree path tuple into a dotted name (``()`` becomes ``"<root>"``)."""
    return ".".join(str(p) for p in path) if path else "<root>"


def broadcast_prefix(prefix: PyTree, tree: PyTree, is_prefix_leaf: Callable[[Any], bool]) -> list:
    """Expand a prefix tree to one entry per leaf of ``tree`` (JAX's prefix rule).

    Each leaf of ``prefix`` (as decided by ``is_prefix_leaf``; ``None`` is always a
    prefix leaf here) applies to every leaf of the matching subtree of ``tree``.

    Args:
        prefix: a tree whose structure is a prefix of ``tree``'s.
        tree: the full tree.
        is_prefix_leaf: predicate marking the leaves of ``prefix``.

    Returns:
        A list with one prefix leaf per leaf of ``tree``, in ``tree``'s order.

    Raises:
        ValueError: naming the path where ``prefix`` is not a prefix of ``tree``.

    Example:
        >>> broadcast_prefix({"a": 1}, {"a": {"x": 0, "y": 0}}, lambda v: isinstance(v, int))
        [1, 1]
    """

    def is_leaf(x):
        return x is None or is_prefix_leaf(x)

    try:
        return optree.broadcast_prefix(
            prefix, tree, is_leaf=is_leaf, none_is_leaf=True, namespace=NAMESPACE
        )
    except ValueError as err:
        raise ValueError(
            f"spec tree is not a prefix of the value tree: {err}. Value leaves: "
            f"{tree_paths(tree)[:20]}"
        ) from None


def _check_same_structure(tree: PyTree, rest: tuple, is_leaf) -> None:
    spec = tree_structure(tree, is_leaf=is_leaf)
    for i, other in enumerate(rest):
        other_spec = tree_structure(other, is_leaf=is_leaf)
        if other_spec != spec:
            names = set(tree_paths(tree, is_leaf=is_leaf))
            other_names = set(tree_paths(other, is_leaf=is_leaf))
            missing = sorted(names - other_names)[:5]
            extra = sorted(other_names - names)[:5]
            raise ValueError(
                f"tree {i + 1} does not match the first tree's structure: "
                f"missing leaves {missing}, unexpected leaves {extra} "
                f"(first: {spec}, other: {other_spec})"
            )
