"""Leaf-list helpers shared by the optimizers: checked flattening and foreach grouping.

Every optimizer works on the flat list of leaves of the update tree, so that one
``torch._foreach_add_``-style call covers all leaves of a (device, dtype) group. These
helpers do the two boring parts: flatten a tree while checking that it matches
another one (naming the leaf at fault), and split leaf lists into (device, dtype)
groups and put the results back in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shardfn import pytree
from shardfn.optim._scoped import Scoped

PyTree = Any


def flatten_tensors(tree: PyTree, what: str) -> tuple[list[torch.Tensor], Any]:
    """``(leaves, treedef)`` of ``tree``, checking that every leaf is a tensor.

    Raises:
        TypeError: naming the first leaf that is not a ``torch.Tensor``.
    """
    leaves, treedef = pytree.tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            name = pytree.tree_paths(tree)[i]
            raise TypeError(
                f"{what} leaf {name!r} is a {type(leaf).__name__}, expected a torch.Tensor"
            )
    return leaves, treedef


def leaves_like(
    other: PyTree, tree: PyTree, treedef: Any, leaves: Sequence[torch.Tensor], *, what: str,
    other_what: str,
) -> list[torch.Tensor]:
    """The leaves of ``other``, checked to have ``tree``'s structure and leaf shapes.

    Args:
        other: the tree to flatten (params, or a state tree such as Adam's ``mu``).
        tree: the reference tree (usually the updates), flattened as ``leaves``/``treedef``.
        treedef: ``tree``'s treedef.
        leaves: ``tree``'s leaves.
        what: how to call ``tree`` in errors ("updates").
        other_what: how to call ``other`` in errors ("params").

    Returns:
        ``other``'s leaves, in the same order as ``leaves``.

    Raises:
        ValueError: naming the missing/unexpected leaves, or the leaf whose shape differs.
        TypeError: naming a leaf of ``other`` that is not a tensor.
    """
    other_leaves, other_def = pytree.tree_flatten(other)
    if other_def != treedef:
        names = pytree.tree_paths(tree)
        other_names = pytree.tree_paths(other)
        missing = [n for n in names if n not in set(other_names)]
        extra = [n for n in other_names if n not in set(names)]
        if missing or extra:
            detail = f"leaves {missing[:5]} are missing from {other_what}"
            if extra:
                detail += f", {other_what} has leaves {extra[:5]} that {what} lacks"
        else:
            detail = f"same leaf names but different containers ({treedef} vs {other_def})"
        raise ValueError(f"{what} tree does not match the {other_what} tree: {detail}")
    for i, (a, b) in enumerate(zip(leaves, other_leaves, strict=True)):
        if not isinstance(b, torch.Tensor):
            name = pytree.tree_paths(tree)[i]
            raise TypeError(f"{other_what} leaf {name!r} is a {type(b).__name__}, "
                            f"expected a torch.Tensor")
        if a.shape != b.shape:
            name = pytree.tree_paths(tree)[i]
            raise ValueError(f"leaf {name!r}: {what} has shape {tuple(a.shape)} but {other_what} "
                             f"has shape {tuple(b.shape)}")
    return other_leaves


def foreach_groups(
    fn: Callable[..., tuple[list, ...]], columns: Sequence[Sequence | None], num_outputs: int
) -> tuple[list, ...]:
    """Run ``fn`` once per (device, dtype) group of leaves and reassemble its outputs.

    ``torch._foreach_add_``-style kernels take their fast path only when all tensors of a
    list share device and dtype, so a mixed-precision tree is split into groups.

    Args:
        fn: ``fn(*sub_columns) -> tuple of num_outputs lists`` (each as long as a column).
        columns: equally long lists, one entry per leaf; a column may be None (passed
            through as None) or hold non-tensors (e.g. mask bools, ignored for grouping).
        num_outputs: how many lists ``fn`` returns.

    Returns:
        ``num_outputs`` lists, one entry per leaf in the original order.
    """
    present = [c for c in columns if c is not None]
    n = len(present[0]) if present else 0
    if n == 0:
        return tuple([] for _ in range(num_outputs))
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        key = tuple(
            (c[i].device, c[i].dtype) for c in present if isinstance(c[i], torch.Tensor)
        )
        groups.setdefault(key, []).append(i)
    if len(groups) == 1:
        return tuple(list(out) for out in fn(*columns))
    results: list[list] = [[None] * n for _ in range(num_outputs)]
    for index in groups.values():
        sub = [None if c is None else [c[i] for i in index] for c in columns]
        for result, out in zip(results, fn(*sub), strict=True):
            for j, i in enumerate(index):
                result[i] = out[j]
    return tuple(results)


_HOLE = object()


def per_leaf(prefix: PyTree, tree: PyTree, is_prefix_leaf: Callable[[Any], bool]) -> list:
    """Expand a prefix tree to one entry per leaf of ``tree`` (JAX's prefix rule).

    Unlike :func:`shardfn.pytree.broadcast_prefix`, ``None`` subtrees of ``tree``
    (masked-out or frozen leaves) get no entry, so the result lines up with
    ``tree_leaves(tree)``.
    """
    filled = pytree.tree_map(lambda x: _HOLE if x is None else x, tree, is_leaf=lambda x: x is None)
    entries = pytree.broadcast_prefix(prefix, filled, is_prefix_leaf)
    return [e for e, x in zip(entries, pytree.tree_leaves(filled), strict=True) if x is not _HOLE]


# the full parameter tree whose pieces the optimizer sees (set by shard_opt_state)
_FULL_TREE: Scoped[Any] = Scoped("shardfn_optim_full_tree", None)


@contextlib.contextmanager
def full_tree(params: PyTree) -> Iterator[None]:
    """Within this context the trees optimizers see are pieces of ``params`` (ZeRO).

    Callable masks and labels (``masked``, ``multi_transform``, Adam's weight-decay
    ``mask``) are then called with the full parameters (see :func:`full_view`), so a
    mask that reads shapes (``p.ndim >= 2``) selects what it selects unsharded.
    """
    with _FULL_TREE.bound(params):
        yield


def full_view(tree: PyTree) -> PyTree:
    """``tree``'s counterpart in the enclosing :func:`full_tree` (the same leaves hidden
    by None), or ``tree`` itself outside one or when the structures differ."""
    full = _FULL_TREE.get()
    if full is None:
        return tree
    leaves, treedef = pytree.tree_flatten(tree, is_leaf=_is_none)
    full_leaves, full_def = pytree.tree_flatten(full, is_leaf=_is_none)
    if treedef != full_def:
        return tree
    return pytree.tree_unflatten(
        treedef, [None if x is None else f for x, f in zip(leaves, full_leaves, strict=True)])


def _is_none(x: Any) -> bool:
    return x is None


def bool_per_leaf(mask: PyTree, tree: PyTree, what: str) -> list[bool]:
    """Expand a bool mask (a prefix tree, or a callable of ``tree``) to one bool per leaf.

    A callable is called with :func:`full_view` of ``tree`` (the full parameters when
    ``tree`` holds their ZeRO pieces).

    Raises:
        ValueError: if the mask is not a prefix of ``tree`` or a mask leaf is not a bool.
    """
    if callable(mask):
        mask = mask(full_view(tree))
    flags = per_leaf(mask, tree, lambda x: isinstance(x, bool))
    for i, flag in enumerate(flags):
        if not isinstance(flag, bool):
            name = pytree.tree_paths(tree)[i]
            raise ValueError(
                f"{what}: the mask entry for leaf {name!r} is {flag!r}; mask leaves must be "
                f"Python bools (True selects the leaf)"
            )
    return flags


def select(tree: PyTree, flags: Sequence[bool]) -> PyTree:
    """``tree`` with every leaf whose flag is False replaced by None (an empty subtree)."""
    leaves, treedef = pytree.tree_flatten(tree)
    kept = [x if f else None for x, f in zip(leaves, flags, strict=True)]
    return pytree.tree_unflatten(treedef, kept)


def is_frozen(grad: Any, param: Any = None) -> bool:
    """Whether a leaf is frozen: its update or its parameter is not floating point.

    Integer and bool leaves (BatchNorm's ``num_batches_tracked``, step counters,
    masks kept in the params tree) never take optimizer steps: every optimizer
    and gradient transform gives them a zero update of the parameter's dtype
    and does no state math on them.
    """
    if isinstance(grad, torch.Tensor) and not (grad.is_floating_point() or grad.is_complex()):
        return True
    return isinstance(param, torch.Tensor) and not (param.is_floating_point()
                                                    or param.is_complex())


def frozen_zero(grad: torch.Tensor, param: torch.Tensor | None = None) -> torch.Tensor:
    """The zero update of a frozen leaf, in the parameter's dtype (the update's without one)."""
    like = param if isinstance(param, torch.Tensor) else grad
    return torch.zeros(grad.shape, dtype=like.dtype, device=grad.device)


def foreach_floating(
    fn: Callable[..., tuple[list, ...]], columns: Sequence[Sequence | None], num_outputs: int,
    frozen: Callable[[int], tuple], params: Sequence | None = None,
) -> tuple[list, ...]:
    """:func:`foreach_groups` over the floating leaves only; frozen leaves get ``frozen(i)``.

    Args:
        fn: as for :func:`foreach_groups`.
        columns: as for :func:`foreach_groups`; ``columns[0]`` are the updates.
        num_outputs: how many lists ``fn`` returns.
        frozen: ``frozen(i) -> tuple of num_outputs values`` for a frozen leaf ``i``
            (see :func:`is_frozen`), e.g. its zero update and its unchanged state.
        params: the parameter leaves (or None), also consulted by :func:`is_frozen`.

    Returns:
        ``num_outputs`` lists, one entry per leaf in the original order. When no leaf
        is frozen this is exactly ``foreach_groups(fn, columns, num_outputs)``.
    """
    updates = columns[0]
    flags = [is_frozen(u, None if params is None else params[i]) for i, u in enumerate(updates)]
    if not any(flags):
        return foreach_groups(fn, columns, num_outputs)
    live = [i for i, f in enumerate(flags) if not f]
    sub = [None if c is None else [c[i] for i in live] for c in columns]
    outs = foreach_groups(fn, sub, num_outputs) if live else tuple([] for _ in range(num_outputs))
    results: list[list] = [[None] * len(updates) for _ in range(num_outputs)]
    for j, i in enumerate(live):
        for result, out in zip(results, outs, strict=True):
            result[i] = out[j]
    for i, f in enumerate(flags):
        if f:
            for result, value in zip(results, frozen(i), strict=True):
                result[i] = value
    return tuple(results)
