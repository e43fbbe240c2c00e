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
* **deep flattening.** Values that cross an ``autograd.Function`` (model outputs and
  arguments) use :func:`tree_flatten_deep`, which also enters dataclasses (HF's
  ``ModelOutput``), Mapping/Sequence subclasses and attribute objects, so that no
  tensor is captured as a constant; parameter trees use the plain functions.

Example:
    >>> from shardfn import pytree as pt
    >>> pt.tree_paths({"a": {"w": 1, "b": 2}})
    ['a.b', 'a.w']
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

NAMESPACE = "shardfn"

PyTree = Any

__all__ = [
    "NAMESPACE",
    "broadcast_prefix",
    "path_name",
    "Container",
    "DeepSpec",
    "tree_flatten",
    "tree_flatten_deep",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_leaves_deep",
    "tree_map",
    "tree_map_deep",
    "tree_map_with_path",
    "tree_paths",
    "tree_structure",
    "tree_unflatten",
    "tree_unflatten_deep",
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


# ------------------------------------------------------------------ deep flattening
# Values that cross an ``autograd.Function`` (a transform's outputs and arguments) must
# have every tensor taken out: a tensor kept inside a leaf would be a constant of the
# graph and get no gradient. ``tree_flatten_deep`` also enters the containers optree does
# not know: dataclasses (HF's ``ModelOutput`` too), Mapping/Sequence subclasses and plain
# objects holding tensors in their attributes; a container that holds no tensor stays a
# leaf (kept as it is), and one holding a tensor that cannot be rebuilt raises.

_ATOMS = (str, bytes, bytearray, memoryview, range, int, float, complex, bool, type(None),
          type, type(Ellipsis), slice, types.FunctionType, types.BuiltinFunctionType,
          types.MethodType, types.ModuleType, functools.partial, enum.Enum, torch.dtype,
          torch.device, torch.layout, torch.memory_format, torch.Generator,
          torch.nn.Module)  # a module is passed as it is (its parameters are not values)


class DeepSpec(NamedTuple):
    """The structure of a tree taken apart by :func:`tree_flatten_deep`.

    ``nodes`` has one entry per optree leaf of the top level: ``None`` (a leaf) or a
    :class:`Container` (an unknown container, taken apart in turn).
    """

    treedef: Any
    nodes: tuple[Container | None, ...]
    num_leaves: int

    def unflatten(self, leaves: Sequence) -> PyTree:
        """The tree again, with ``leaves`` (as many as :func:`tree_flatten_deep` gave)."""
        return tree_unflatten_deep(self, leaves)


class Container(NamedTuple):
    """An unknown container taken apart: ``rebuild(children)`` makes a new one of its type."""

    rebuild: Callable[[list], Any]
    spec: DeepSpec


def tree_flatten_deep(tree: PyTree) -> tuple[list, DeepSpec]:
    """Flatten ``tree`` like :func:`tree_flatten`, also entering containers optree does not know.

    Entered (when they hold a tensor): dataclasses (every field, HF's ``ModelOutput``
    with its key order and ``None`` fields), ``Mapping`` and ``Sequence`` subclasses,
    and objects whose tensors sit in their instance attributes (``__dict__``). A
    container holding no tensor stays one leaf, unchanged. Use it wherever values
    cross an ``autograd.Function``, so that no tensor is captured as a constant.

    Args:
        tree: any value.

    Returns:
        ``(leaves, spec)``; ``tree_unflatten_deep(spec, leaves)`` rebuilds the tree with
        every container of its own type.

    Raises:
        TypeError: a container holding a tensor that cannot be rebuilt (``__slots__``
            without ``__dict__``, a Mapping/Sequence whose constructor does not take
            its items, a reference cycle); the message names its type and how to
            register it (``optree.register_pytree_node(..., namespace="shardfn")``).

    Example:
        >>> leaves, spec = tree_flatten_deep(Out(y=torch.ones(2)))   # a dataclass
        >>> tree_unflatten_deep(spec, [leaves[0] * 2]).y
        tensor([2., 2.])
    """
    return _flatten_deep(tree, (), "<root>")


def tree_unflatten_deep(spec: DeepSpec, leaves: Sequence) -> PyTree:
    """Inverse of :func:`tree_flatten_deep`."""
    if len(leaves) != spec.num_leaves:
        raise ValueError(f"tree_unflatten_deep: {len(leaves)} leaves for a spec of "
                         f"{spec.num_leaves}")
    if not any(spec.nodes):
        return optree.tree_unflatten(spec.treedef, leaves)
    top, at = [], 0
    for node in spec.nodes:
        if node is None:
            top.append(leaves[at])
            at += 1
        else:
            n = node.spec.num_leaves
            top.append(node.rebuild(tree_unflatten_deep(node.spec, leaves[at:at + n])))
            at += n
    return optree.tree_unflatten(spec.treedef, top)


def tree_leaves_deep(tree: PyTree) -> list:
    """The leaves :func:`tree_flatten_deep` gives."""
    return tree_flatten_deep(tree)[0]


def tree_map_deep(fn: Callable[[Any], Any], tree: PyTree) -> PyTree:
    """Map ``fn`` over the leaves :func:`tree_flatten_deep` gives; same containers back.

    Example:
        >>> tree_map_deep(torch.Tensor.detach, model_output)   # still a ModelOutput
    """
    leaves, spec = tree_flatten_deep(tree)
    return tree_unflatten_deep(spec, [fn(x) for x in leaves])


def _flatten_deep(tree: PyTree, active: tuple[int, ...], where: str) -> tuple[list, DeepSpec]:
    leaves, treedef = optree.tree_flatten(tree, namespace=NAMESPACE)
    out: list = []
    nodes: list[Container | None] = []
    for leaf in leaves:
        node = _take_apart(leaf, active, where)
        if node is None:
            out.append(leaf)
        else:
            children, rebuild = node
            sub_leaves, sub_spec = _flatten_deep(children, (*active, id(leaf)),
                                                 f"{where} > {_type_name(leaf)}")
            if not any(_is_tensor(x) for x in sub_leaves):
                node = None  # no tensor inside: keep the container whole, as it was
                out.append(leaf)
            else:
                node = Container(rebuild, sub_spec)
                out.extend(sub_leaves)
        nodes.append(node)
    return out, DeepSpec(treedef, tuple(nodes), len(out))


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _type_name(x: Any) -> str:
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def _how_to_register(x: Any, why: str, where: str) -> TypeError:
    name, short = _type_name(x), type(x).__qualname__
    return TypeError(
        f"shardfn cannot take apart a {name} holding tensors (in {where}): {why}. Its tensors "
        f"would be captured as constants and get no gradient. Register the type in shardfn's "
        f"pytree namespace: optree.register_pytree_node({short}, flatten_func, "
        f"unflatten_func, namespace=\"shardfn\") (flatten_func(x) -> (children, metadata); "
        f"unflatten_func(metadata, children) -> {short}), or use a dataclass, NamedTuple, "
        f"dict, list or tuple instead")


def _slots(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(s for s in slots if s != "__dict__")


def _holds_tensor(x: Any) -> bool:
    """Whether ``x`` (a value optree does not enter) visibly holds a tensor: in its items,
    attributes or slots, or one level of known containers below them."""
    values: list = list(getattr(x, "__dict__", {}).values())
    if isinstance(x, Mapping):
        values += list(x.values())
    elif isinstance(x, Sequence):
        values += list(x)
    values += [getattr(x, s, None) for c in type(x).__mro__ for s in _slots(c)]
    return any(_is_tensor(leaf) for v in values
               for leaf in optree.tree_leaves(v, namespace=NAMESPACE))


def _take_apart(x: Any, active: tuple[int, ...], where: str) -> tuple[Any, Callable] | None:
    """``(children, rebuild)`` for a container optree does not know; None for a leaf."""
    if isinstance(x, _ATOMS) or _is_tensor(x):
        return None
    cls = type(x)
    if id(x) in active:
        if _holds_tensor(x):
            raise _how_to_register(x, "it contains itself (a reference cycle)", where)
        return None
    if not isinstance(x, dict | list | tuple) and isinstance(x, Mapping | Sequence):
        return _take_apart_by_constructor(x, where)
    attrs = dict(getattr(x, "__dict__", {}))
    if dataclasses.is_dataclass(x):
        attrs.update((f.name, getattr(x, f.name)) for f in dataclasses.fields(x))
    elif any(_slots(c) for c in cls.__mro__):
        if _holds_tensor(x):
            raise _how_to_register(x, "its tensors may sit in __slots__", where)
        return None
    keys = list(x.keys()) if isinstance(x, dict) else None
    # an item that is also an attribute (a ModelOutput's fields) is taken out once
    linked = [k in attrs and attrs[k] is x[k] for k in keys] if keys is not None else []
    items = ([x[k] for k, ln in zip(keys, linked, strict=True) if not ln] if keys is not None
             else list(x) if isinstance(x, list | tuple) else [])
    if not items and not attrs:
        return None
    if not isinstance(x, tuple) and not _can_make_blank(cls):
        if _holds_tensor(x):
            raise _how_to_register(x, f"{cls.__qualname__}.__new__({cls.__qualname__}) "
                                      "fails", where)
        return None
    rebuild = _Rebuild(cls, keys, linked, getattr(x, "default_factory", None))
    return (items, attrs), rebuild


class _Rebuild:
    """A new object of ``cls`` from ``(items, attrs)``, bypassing its ``__init__`` (as
    ``copy`` does): items set through the builtin base (dict/list/tuple), attributes
    with ``object.__setattr__`` (frozen dataclasses too)."""

    def __init__(self, cls: type, keys: list | None, linked: list[bool], default_factory: Any):
        self.cls, self.keys, self.linked, self.default_factory = cls, keys, linked, default_factory

    def __call__(self, children: tuple) -> Any:
        items, attrs = children
        cls = self.cls
        if issubclass(cls, tuple):
            new = tuple.__new__(cls, items)
        else:
            new = cls.__new__(cls)
            if isinstance(new, dict):
                base = next(b for b in cls.__mro__ if b.__module__ in ("builtins", "collections"))
                if isinstance(new, collections.defaultdict):
                    new.default_factory = self.default_factory
                values = iter(items)
                for key, linked in zip(self.keys, self.linked, strict=True):
                    base.__setitem__(new, key, attrs[key] if linked else next(values))
            elif isinstance(new, list):
                list.extend(new, items)
        for name, value in attrs.items():
            object.__setattr__(new, name, value)
        return new


_BLANK_OK: dict[type, bool] = {}


def _can_make_blank(cls: type) -> bool:
    """Whether ``cls.__new__(cls)`` works (checked once per type)."""
    if cls not in _BLANK_OK:
        try:
            cls.__new__(cls)
            _BLANK_OK[cls] = True
        except Exception:  # noqa: BLE001 (any failure means: cannot rebuild this way)
            _BLANK_OK[cls] = False
    return _BLANK_OK[cls]


def _take_apart_by_constructor(x: Any, where: str) -> tuple[Any, Callable] | None:
    """A Mapping/Sequence that is not a dict/list/tuple: rebuilt as ``type(x)(items)``."""
    cls = type(x)
    is_map = isinstance(x, Mapping)
    keys = list(x.keys()) if is_map else None
    values = [x[k] for k in keys] if is_map else list(x)
    try:
        probe = cls(dict(zip(keys, values, strict=True))) if is_map else cls(values)
        ok = list(probe.keys()) == keys if is_map else len(probe) == len(values)
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        if _holds_tensor(x):
            what = "a dict" if is_map else "a list"
            raise _how_to_register(x, f"{cls.__qualname__}({what} of its items) does not "
                                      "rebuild it", where)
        return None
    if is_map:
        return values, lambda new: cls(dict(zip(keys, new, strict=True)))
    return values, cls
