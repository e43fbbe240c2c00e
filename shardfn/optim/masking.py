"""Apply transforms to parts of the tree: ``masked`` and ``multi_transform`` (optax's).

Over a ``shard_opt_state`` optimizer both shard the whole composition (see
``shardfn.optim._compose``); callable masks and labels see the full parameters.

Both work by hiding leaves: a leaf that a transform should not see is replaced
by ``None``, which shardfn's pytrees treat as an empty subtree. The inner
transform therefore inits and updates only its own leaves, and its state holds
buffers only for them (``None`` elsewhere).

Example:
    >>> labels = lambda params: tree_map(lambda p: "decay" if p.ndim >= 2 else "no_decay", params)
    >>> opt = multi_transform({"decay": adamw(1e-3, weight_decay=0.1),
    ...                        "no_decay": adam(1e-3)}, labels)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from shardfn import pytree
from shardfn.optim._compose import fold, is_sharded, marks_full_leaves
from shardfn.optim._tree import (
    bool_per_leaf,
    flatten_tensors,
    frozen_zero,
    full_view,
    is_frozen,
    leaves_like,
    per_leaf,
    select,
)
from shardfn.optim.base import GradientTransformation

__all__ = ["MaskedState", "MultiTransformState", "masked", "multi_transform"]

PyTree = Any


class MaskedState(NamedTuple):
    """State of :func:`masked`."""

    inner_state: Any  # the inner transform's state over the selected leaves


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`."""

    inner_states: dict  # label -> that transform's state over the leaves with that label


def masked(inner: GradientTransformation, mask: PyTree | Callable[[PyTree], PyTree]
           ) -> GradientTransformation:
    """Apply ``inner`` to the leaves selected by ``mask``; pass the others through unchanged.

    Args:
        inner: the transform for the selected leaves.
        mask: a tree (or prefix tree) of bools like params, or ``mask(params) -> bool tree``
            (called with ``params`` when ``update`` gets them, else with the updates).

    Returns:
        A transform with state :class:`MaskedState`; for a ``shard_opt_state`` ``inner``,
        ``shard_opt_state(masked(inner.inner, mask))`` (a ShardedOptimizer: the leaves
        passed through are the dp-averaged gradients, as unsharded).

    Example:
        >>> only_matrices = lambda params: tree_map(lambda p: p.ndim >= 2, params)
        >>> opt = chain(masked(scale(0.5), only_matrices), sgd(0.1))
    """
    _check_transform(inner, "masked: inner")
    sharded = fold([("inner", inner)], "masked")
    if sharded is not None:  # masked(shard_opt_state(t)) is shard_opt_state(masked(t))
        return sharded.rewrap(masked(sharded.inner, mask))

    def init(params):
        flags = bool_per_leaf(mask, params, "masked")
        return MaskedState(inner.init(select(params, flags)))

    def update(updates, state, params=None):
        leaves, treedef = flatten_tensors(updates, "updates")
        param_leaves = [None] * len(leaves)
        if params is not None:
            param_leaves = leaves_like(params, updates, treedef, leaves, what="updates",
                                       other_what="params")
        flags = bool_per_leaf(mask, params if params is not None else updates, "masked")
        inner_params = None if params is None else select(params, flags)
        inner_updates, inner_state = inner.update(select(updates, flags), state.inner_state,
                                                  inner_params)
        new_leaves = iter(pytree.tree_leaves(inner_updates))
        # unselected leaves pass through, but non-floating ones are frozen: zero updates
        merged = [next(new_leaves) if f else frozen_zero(leaf, p) if is_frozen(leaf, p) else leaf
                  for leaf, f, p in zip(leaves, flags, param_leaves, strict=True)]
        return pytree.tree_unflatten(treedef, merged), MaskedState(inner_state)

    return marks_full_leaves(GradientTransformation(init, update), [inner])


def multi_transform(
    transforms: Mapping[str, GradientTransformation],
    labels: PyTree | Callable[[PyTree], PyTree],
) -> GradientTransformation:
    """Apply a different transform to each group of leaves, chosen by a label per leaf.

    Use it for per-group hyper-parameters (no weight decay on norms, a smaller
    learning rate for embeddings, frozen layers with :func:`set_to_zero`).

    Args:
        transforms: label -> transform.
        labels: a tree (or prefix tree) of string labels like params, or
            ``labels(params) -> label tree`` (called with ``params`` when ``update``
            gets them, else with the updates). Every label must be a key of
            ``transforms``.

    Returns:
        A transform with state :class:`MultiTransformState` (one inner state per label);
        when some ``transforms`` are ``shard_opt_state`` ones (all sharded the same way),
        the whole multi_transform is sharded that way: a ShardedOptimizer.

    Example:
        >>> opt = multi_transform({"body": adamw(1e-3), "head": adamw(1e-2)},
        ...                       {"body": "body", "head": "head"})
    """
    transforms = dict(transforms)
    for label, t in transforms.items():
        _check_transform(t, f"multi_transform: transforms[{label!r}]")
    sharded = fold([(f"transforms[{label!r}]", t) for label, t in transforms.items()],
                   "multi_transform")
    if sharded is not None:  # every group sharded the same way: shard the whole
        return sharded.rewrap(multi_transform(
            {label: t.inner if is_sharded(t) else t for label, t in transforms.items()}, labels))

    def label_per_leaf(tree):
        tree_labels = labels(full_view(tree)) if callable(labels) else labels
        leaf_labels = per_leaf(tree_labels, tree, lambda x: isinstance(x, str))
        for i, label in enumerate(leaf_labels):
            if label not in transforms:
                name = pytree.tree_paths(tree)[i]
                raise ValueError(f"multi_transform: leaf {name!r} has label {label!r}, which has "
                                 f"no transform (labels: {sorted(transforms)})")
        return leaf_labels

    def init(params):
        leaf_labels = label_per_leaf(params)
        return MultiTransformState({
            label: t.init(select(params, [x == label for x in leaf_labels]))
            for label, t in transforms.items()
        })

    def update(updates, state, params=None):
        leaves, treedef = flatten_tensors(updates, "updates")
        if params is not None:
            leaves_like(params, updates, treedef, leaves, what="updates", other_what="params")
        leaf_labels = label_per_leaf(params if params is not None else updates)
        missing = set(transforms) - set(state.inner_states)
        if missing:
            raise ValueError(
                f"multi_transform: the state has no entry for labels {sorted(missing)}")
        merged = list(leaves)
        new_states = {}
        for label, t in transforms.items():
            flags = [x == label for x in leaf_labels]
            inner_params = None if params is None else select(params, flags)
            group_updates, new_states[label] = t.update(
                select(updates, flags), state.inner_states[label], inner_params)
            new_leaves = iter(pytree.tree_leaves(group_updates))
            for i, f in enumerate(flags):
                if f:
                    merged[i] = next(new_leaves)
        return pytree.tree_unflatten(treedef, merged), MultiTransformState(new_states)

    return marks_full_leaves(GradientTransformation(init, update), list(transforms.values()))


def _check_transform(t: Any, what: str) -> None:
    if not isinstance(t, GradientTransformation) and not is_sharded(t):
        raise TypeError(f"{what} is a {type(t).__name__}, expected a GradientTransformation "
                        "(or a ShardedOptimizer)")
