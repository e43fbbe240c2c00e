"""How ``chain``, ``masked`` and ``multi_transform`` compose with a sharded optimizer.

A *sharded* optimizer (``shard_opt_state``'s ``ShardedOptimizer``) hands the
optimizer it wraps this rank's averaged 1-D piece of every leaf, and returns the
full updates. The optimizer layer cannot import it (it lives higher up), so it is
recognised by what it offers: ``inner`` (the wrapped :class:`GradientTransformation`),
``axes`` (the mesh axes it shards over), ``sharding`` (a comparable record of its
mesh, axes and options) and ``rewrap(inner)`` (the same sharding around another
optimizer).

Composing one is *folding it outward*: ``chain(clip, shard_opt_state(adamw))`` is
``shard_opt_state(chain(clip, adamw))``, so every transform of the composition sees
the averaged gradient's pieces (``clip_by_global_norm`` then psums its norm over the
axis and clips by the global norm, exactly as unsharded), its state is sharded with
the rest, and the result is again a sharded optimizer (its state saves under the
unsharded composition's names). Refused when built, naming the valid order:

* two sharded optimizers with different sharding in one composition (the updates of
  one step can be sharded one way only);
* a transform marked :func:`needs_full_leaves` (it reads leaf shapes or whole
  leaves) in a composition with a sharded optimizer, where it would see pieces.

Example:
    >>> outer = fold([("argument 0", clip), ("argument 1", sharded)], "chain")
    >>> outer.rewrap(chain(clip, sharded.inner))
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # base imports this module: types only, duck-typed at run time
    from shardfn.optim.base import GradientTransformation

__all__ = ["Sharded", "fold", "is_sharded", "marks_full_leaves", "needs_full_leaves",
           "unwrapped", "wants_full_leaves"]


@runtime_checkable
class Sharded(Protocol):
    """What the optimizer layer needs of a sharded optimizer (``ShardedOptimizer``)."""

    inner: GradientTransformation
    axes: tuple[str, ...]
    sharding: tuple

    def rewrap(self, inner: GradientTransformation) -> Any: ...


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a sharded optimizer this layer can fold (see module doc)."""
    return (_is_transform(getattr(t, "inner", None)) and callable(getattr(t, "rewrap", None))
            and bool(getattr(t, "axes", ())))


def _is_transform(t: Any) -> bool:
    """An ``(init, update)`` optimizer (a GradientTransformation), duck-typed."""
    return (isinstance(t, tuple) and callable(getattr(t, "init", None))
            and callable(getattr(t, "update", None)))


_FULL_LEAVES: weakref.WeakSet = weakref.WeakSet()  # update functions that need whole leaves


def needs_full_leaves(t: GradientTransformation) -> GradientTransformation:
    """Mark ``t`` as needing whole leaves: it reads leaf shapes or mixes elements of a leaf.

    Inside ``shard_opt_state`` every transform sees this rank's 1-D piece of each leaf;
    elementwise transforms, norms (``clip_by_global_norm``) and masks are exact there,
    but a transform that, say, factors a matrix by its rows and columns is not. A
    transform marked here is refused in a composition with a sharded optimizer
    (``chain``, ``masked``, ``multi_transform``, ``shard_opt_state``) when it is built.

    Args:
        t: the transform.

    Returns:
        ``t`` itself (marked).

    Example:
        >>> factored = sf.optim.needs_full_leaves(GradientTransformation(init, update))
        >>> sf.optim.chain(factored, sf.shard_opt_state(opt, mesh, "dp"))  # ValueError
    """
    if not _is_transform(t) or is_sharded(t):
        raise TypeError(f"needs_full_leaves expects a GradientTransformation, got "
                        f"{type(t).__name__}")
    _FULL_LEAVES.add(t.update)
    return t


def wants_full_leaves(t: Any) -> bool:
    """Whether ``t`` (or a transform inside it) is marked by :func:`needs_full_leaves`."""
    update = getattr(t, "update", None)
    try:
        return update in _FULL_LEAVES
    except TypeError:  # not weak-referenceable: never marked
        return False


def marks_full_leaves(t: GradientTransformation, parts: Sequence[Any]) -> GradientTransformation:
    """``t``, marked by :func:`needs_full_leaves` when any of ``parts`` is (a composite)."""
    if any(wants_full_leaves(p) for p in parts):
        _FULL_LEAVES.add(t.update)
    return t


def fold(labelled: Sequence[tuple[str, Any]], what: str) -> Sharded | None:
    """The sharded optimizer a composition folds into, after its checks; None if none.

    Args:
        labelled: ``(label for messages, transform)`` for every part of the composition.
        what: the composition's name (``"chain"``), for messages.

    Raises:
        ValueError: for two sharded parts with different sharding, or a part marked
            :func:`needs_full_leaves` next to a sharded one (the message names the
            valid order).
    """
    sharded = [(label, t) for label, t in labelled if is_sharded(t)]
    if not sharded:
        return None
    first_label, first = sharded[0]
    for label, t in sharded[1:]:
        if t.sharding != first.sharding:
            raise ValueError(
                f"{what}: {first_label} is shard_opt_state over {first.axes} and {label} is "
                f"shard_opt_state over {t.axes} with other options or mesh; one step's updates "
                f"can be sharded one way only. Shard once, around the whole composition: "
                f"shard_opt_state({what}(<plain optimizers>), mesh, axis)")
    axes = first.axes[0] if len(first.axes) == 1 else first.axes
    for label, t in labelled:
        if wants_full_leaves(t) or (is_sharded(t) and wants_full_leaves(t.inner)):
            raise ValueError(
                f"{what}: {label} needs whole leaves (marked by needs_full_leaves), but next "
                f"to shard_opt_state over {axes!r} it would see this rank's 1-D piece of each "
                f"leaf. Valid order: apply it to the full updates the sharded optimizer "
                f"returns (updates, state = sharded.update(grads, state, params); then "
                f"{label}.update(updates, ...)), or leave the optimizer unsharded")
    return first


def unwrapped(t: Any) -> GradientTransformation:
    """The plain optimizer inside ``t`` if it is sharded, else ``t``."""
    return t.inner if is_sharded(t) else t
