"""Gradient clipping by global norm (torch.nn.utils.clip_grad_norm_), sharding-aware.

The global norm is ``sqrt(sum over leaves of sum(g**2))`` (``ord=2``); ``ord=1``
is ``sum |g|`` and ``ord=inf`` is ``max |g|`` over every element of every leaf,
as ``clip_grad_norm_(norm_type=...)``. When the gradient tree is sharded, each
rank holds only part of some leaves; pass the spec tree (``P`` / ``Layout`` per
leaf, a prefix tree is fine; ``model.specs`` of any sharded model) and each
leaf's local sum of squares (of ``|g|`` for ord 1) is ``psum``-ed over the mesh
axes its spec names; for ord inf the local maxima are ``all_gather``-ed over
those axes and the largest taken. Layout objects that are not a ``P`` name their
axes themselves: ``sharded_axes`` (``FsdpTpLayout``: FSDP + TP, split over tp
and dp) or ``axis`` (``tensor_split``'s ``FusedLayout``). So on a 2-D mesh a
tp-split leaf sharded over dp is summed over both axes, a replicated-over-tp
leaf over dp only (each tp rank holds the same values: counted once), and a
leaf the spec calls replicated is not summed at all; zero padding adds nothing
(to any of the three norms: ``|0|`` is below every max). A spec leaf of
any other kind is refused, naming the leaf. Leaves are grouped by that axis
set, so there is one psum per distinct set (not per leaf) and replicated leaves
are counted once, not once per rank.

Wrappers that give an optimizer only this rank's part of every leaf (ZeRO's
``shard_opt_state``) run it inside :func:`sharded_over`, which adds their axis
to every leaf's set.

Communication: one scalar all-reduce (ord inf: a scalar all-gather) per distinct
non-empty axis set.

Gradients that are a shard over an axis their spec does not name are refused
(``ValueError`` naming the leaf, the axis and ``specs=model.specs``): without the
specs, each rank would clip by the norm of its own shard, a different, too small
norm on every rank. What a leaf is comes from :mod:`shardfn.primitives.reduced`:
``shard_params`` marks the gradient tensors it returns. The check sees those very
tensors (and views of them, and ``accumulate_grads``' mean of them); a tensor
computed from them (``g * 2``, an unscaled copy) carries no mark and is not checked.
Refusing, rather than adding the axis to the reduction, cannot be wrong: a mark
does not know every axis a leaf is split over (the tp split of FSDP x TP) and must
not decide which collectives a rank issues.

:func:`clip_grads` is the pure-function form for code coming from
``torch.nn.utils.clip_grad_norm_`` / FairScale's ``FSDP.clip_grad_norm_``: it
returns the clipped tree and the total norm before clipping.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from shardfn import pytree
from shardfn.optim._scoped import Scoped
from shardfn.optim._tree import (
    flatten_tensors,
    foreach_floating,
    frozen_zero,
    is_frozen,
    leaves_like,
    per_leaf,
)
from shardfn.optim.base import EmptyState, GradientTransformation, check_scalar
from shardfn.optim.donation import current_donation, writable_in_place
from shardfn.primitives.reduced import check_layouts

__all__ = ["clip_by_global_norm", "clip_grads", "current_sharded_over", "global_norm",
           "sharded_over"]

PyTree = Any
Ord = int | float | str

VALID_ORDS = "1, 2 or inf (float('inf') or \"inf\")"

_FIX = ("Pass the gradients' layouts, e.g. clip_by_global_norm(max_norm, specs=model.specs, "
        "mesh=mesh), clip_grads(grads, max_norm, model.specs, mesh) or global_norm(grads, "
        "model.specs, mesh): each leaf's part of the norm is then summed over the mesh axes "
        "its layout names.")


def _check_ord(ord: Any) -> float:
    """``ord`` as 1.0, 2.0 or math.inf; anything else raises ValueError naming the valid ones."""
    if isinstance(ord, str):
        if ord.strip().lower() == "inf":
            return math.inf
    elif isinstance(ord, (int, float)) and not isinstance(ord, bool):
        if ord in (1, 2) or ord == math.inf:
            return float(ord)
    raise ValueError(f"ord must be {VALID_ORDS}, got {ord!r}")

# (axes, mesh) set by sharded_over: axes every leaf seen by global_norm is sharded over
_SHARDED_OVER: Scoped[tuple[tuple[str, ...], Any]] = Scoped("shardfn_optim_sharded_over",
                                                            ((), None))


@contextlib.contextmanager
def sharded_over(axis: str | tuple[str, ...], mesh: Any = None) -> Iterator[None]:
    """Within this context, every leaf that :func:`global_norm` sees is a shard over ``axis``.

    For wrappers that hand an optimizer only this rank's part of each leaf
    (``shard_opt_state``, ZeRO): a ``clip_by_global_norm`` inside the wrapped
    optimizer then psums every leaf's sum of squares over ``axis`` too (on top of
    the axes its own ``specs`` name), so it clips by the norm of the full tree.
    Contexts nest; their axes add up.

    Args:
        axis: a mesh axis name or a tuple of names.
        mesh: the mesh of ``axis``; None leaves it to ``clip_by_global_norm``'s
            ``mesh`` argument or the current mesh.

    Example:
        >>> with sharded_over("dp", mesh):
        ...     local_updates, state = opt.update(local_grads, state, local_params)
    """
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    outer_axes, outer_mesh = _SHARDED_OVER.get()
    with _SHARDED_OVER.bound(
            (tuple(sorted(set(outer_axes) | set(axes))), mesh if mesh is not None else outer_mesh)):
        yield


def current_sharded_over() -> tuple[tuple[str, ...], Any]:
    """``(axes, mesh)`` of the enclosing :func:`sharded_over` contexts (``((), None)`` if none).

    Transforms whose answer must hold for the whole tree, not this rank's part of it
    (``skip_nonfinite``'s finite check), reduce over these axes.
    """
    return _SHARDED_OVER.get()


def global_norm(updates: PyTree, specs: PyTree = None, mesh: Any = None,
                ord: Ord = 2) -> torch.Tensor:
    """The ``ord``-norm of all leaves of ``updates`` together, summed over shards if sharded.

    Every element of the full (unsharded) tree counts once: a leaf sharded over
    some axes is reduced over them, a replicated leaf is not; zero padding of
    uneven shards changes none of the three norms.

    Args:
        updates: a tree of tensors (gradients), possibly local shards.
        specs: None (nothing sharded) or a tree of ``P`` / ``Layout`` / None (replicated),
            a prefix of ``updates``' structure.
        mesh: the mesh the specs refer to; None uses the mesh of an enclosing
            :func:`sharded_over`, else the current mesh (only needed when some
            leaf is sharded).
        ord: 2 (``sqrt(sum g**2)``, the default), 1 (``sum |g|``) or inf
            (``float('inf')`` or ``"inf"``: ``max |g|``), as torch's ``norm_type``.

    Returns:
        A scalar tensor (float32, or the widest floating dtype among the leaves),
        identical on every rank.

    Raises:
        ValueError: for another ``ord``, a spec leaf that names no axes, or a leaf that
            is a shard over a mesh axis its spec does not name (``shard_params``'
            gradients without ``specs=model.specs``), naming the leaf and the axis.

    Example:
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([-4.0])})
        tensor(5.)
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([-4.0])}, ord="inf")
        tensor(4.)
    """
    return _global_norm(updates, specs, mesh, _check_ord(ord), "global_norm")


def _global_norm(updates: PyTree, specs: PyTree, mesh: Any, ord: float,
                 what: str) -> torch.Tensor:
    """:func:`global_norm` (``ord`` checked), refusing as ``what`` a shard its spec misses."""
    leaves, _ = flatten_tensors(updates, "updates")
    context_axes, context_mesh = _SHARDED_OVER.get()
    mesh = mesh if mesh is not None else context_mesh

    def with_context(axes: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(set(axes) | set(context_axes)))

    axes_per_leaf = [with_context(a) for a in _axes_per_leaf(specs, updates)]
    # a shard read as the whole leaf gives each rank its own, too small norm: refused
    check_layouts(what, leaves, axes_per_leaf, lambda: pytree.tree_paths(updates), _FIX)
    # Every rank must issue the same collectives in the same order, whatever its local
    # leaves: take the axis sets from the spec tree too, and sort them.
    axis_sets = sorted({with_context(()), *axes_per_leaf,
                        *(with_context(a) for a in _spec_tree_axis_sets(specs))})
    if not leaves and axis_sets == [()]:
        return torch.zeros(())

    # per leaf: its local 2-norm, 1-norm or max |g|; non-floating leaves are frozen:
    # they count for nothing in the norm
    (norms,) = foreach_floating(lambda gs: (_local_norms(gs, ord),), [leaves], 1,
                                lambda i: (torch.zeros((), device=leaves[i].device),))
    dtype = torch.float32
    for n in norms:
        dtype = torch.promote_types(dtype, n.dtype)
    if leaves:
        device = leaves[0].device
    else:  # nothing local, but this rank still takes part in the collectives
        from shardfn.mesh import get_mesh

        device = get_mesh(mesh).device
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {axes: [] for axes in axis_sets}
    for axes, n in zip(axes_per_leaf, norms, strict=True):
        groups[axes].append(n.to(device=device, dtype=dtype))
    zero = torch.zeros((), dtype=dtype, device=device)
    total = zero
    for axes in axis_sets:
        group = groups[axes]
        axis = axes[0] if len(axes) == 1 else axes
        if ord == math.inf:
            # max |g| is >= 0, so an empty group (or empty local parts) contributes 0
            local_max = torch.stack(group).amax() if group else zero
            if axes:
                from shardfn.primitives import all_gather

                local_max = all_gather(local_max, axis, tiled=False, mesh=mesh).amax()
            total = torch.maximum(total, local_max)
            continue
        part = torch.stack(group) if group else zero
        part = (part.square() if ord == 2 else part).sum()  # sum of g**2, or of |g|
        if axes:
            from shardfn.primitives import psum

            part = psum(part, axis, mesh=mesh)
        total = total + part
    return total.sqrt() if ord == 2 else total


def _local_norms(leaves: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """Each leaf's own ``ord``-norm (one foreach kernel); an empty leaf's max |g| is 0."""
    if ord != math.inf:
        return list(torch._foreach_norm(leaves, ord))
    present = [g for g in leaves if g.numel()]
    maxima = iter(torch._foreach_norm(present, math.inf) if present else [])
    return [next(maxima) if g.numel() else g.new_zeros(()) for g in leaves]


def clip_by_global_norm(max_norm: float, specs: PyTree = None,
                        mesh: Any = None, ord: Ord = 2) -> GradientTransformation:
    """Scale updates by ``min(1, max_norm / (global_norm + 1e-6))`` (clip_grad_norm_).

    Args:
        max_norm: the largest global norm let through.
        specs: for sharded gradients, a (prefix) tree of ``P`` / ``Layout`` / None per
            leaf; see :func:`global_norm`.
        mesh: the mesh ``specs`` refer to; None uses the current mesh.
        ord: the norm clipped by: 2 (default), 1 or inf (``float('inf')`` / ``"inf"``),
            torch's ``norm_type``.

    Returns:
        A stateless :class:`GradientTransformation`; its ``update`` raises ``ValueError``
        for a gradient shard whose spec does not name its axis (see :func:`global_norm`).

    Example:
        >>> opt = chain(clip_by_global_norm(1.0, specs=model.specs), adamw(1e-3))
    """
    check_scalar(max_norm, "max_norm")
    max_norm = float(max_norm)
    ord = _check_ord(ord)

    def init(params):
        return EmptyState()

    def update(updates, state, params=None):
        clipped, _ = _clip(updates, params, max_norm, specs, mesh, ord, "clip_by_global_norm")
        return clipped, state

    return GradientTransformation(init, update)


def clip_grads(grads: PyTree, max_norm: float, specs: PyTree = None, mesh: Any = None,
               ord: Ord = 2) -> tuple[PyTree, torch.Tensor]:
    """Clip ``grads`` by their global norm and return that norm (``clip_grad_norm_``).

    The pure form of ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=ord)``
    and FairScale's ``FSDP.clip_grad_norm_``: the same scale
    ``min(1, max_norm / (norm + 1e-6))`` as :func:`clip_by_global_norm`, and the total
    norm before clipping comes back, identical on every rank. A collective when
    ``specs`` shard something: every rank must call it.

    Args:
        grads: a tree of gradients (local shards where ``specs`` shard them).
        max_norm: the largest global norm let through.
        specs: None (nothing sharded) or a (prefix) tree of ``P`` / ``Layout`` / None
            per leaf, e.g. ``model.specs``; see :func:`global_norm`.
        mesh: the mesh ``specs`` refer to; None uses the current mesh.
        ord: 2 (default), 1 or inf (``float('inf')`` / ``"inf"``).

    Returns:
        ``(clipped, total_norm)``: a new tree (``grads`` is not modified) and the scalar
        norm of the unclipped gradients.

    Raises:
        ValueError: as :func:`global_norm`; ``shard_params``' gradient shards need
            ``specs=model.specs``.

    Example:
        >>> grads, norm = sf.optim.clip_grads(grads, 1.0, model.specs, mesh)
        >>> log(grad_norm=float(norm))
    """
    check_scalar(max_norm, "max_norm")
    return _clip(grads, None, float(max_norm), specs, mesh, _check_ord(ord), "clip_grads")


def _clip(updates: PyTree, params: PyTree, max_norm: float, specs: PyTree, mesh: Any,
          ord: float, what: str) -> tuple[PyTree, torch.Tensor]:
    """The clipped tree and the norm before clipping (frozen leaves: zero, not in the norm)."""
    leaves, treedef = flatten_tensors(updates, "updates")
    param_leaves = None
    if params is not None:
        param_leaves = leaves_like(params, updates, treedef, leaves, what="updates",
                                   other_what="params")
    if any(is_frozen(u, None if param_leaves is None else param_leaves[i])
           for i, u in enumerate(leaves)):  # frozen leaves: zero updates, not in the norm
        leaves = [frozen_zero(u, param_leaves[i] if param_leaves else None)
                  if is_frozen(u, param_leaves[i] if param_leaves else None) else u
                  for i, u in enumerate(leaves)]
        updates = pytree.tree_unflatten(treedef, leaves)
    norm = _global_norm(updates, specs, mesh, ord, what)  # collective when sharded: every rank
    if not leaves:
        return updates, norm
    clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    in_place = current_donation().updates and writable_in_place(leaves)

    def clip(gs):
        if in_place:  # donated updates: scale them where they are
            torch._foreach_mul_(gs, clip_coef.to(gs[0].device))
            return (gs,)
        return (torch._foreach_mul(gs, clip_coef.to(gs[0].device)),)

    (clipped,) = foreach_floating(clip, [leaves], 1, lambda i: (leaves[i],))
    return pytree.tree_unflatten(treedef, clipped), norm


def _is_layout(x: Any) -> bool:
    """A spec leaf: a ``P``, a ``Layout``, or a layout object that names its axes itself:
    ``sharded_axes`` (the 2-D layouts of ``shard_params`` over ``tensor_split``) or one
    ``axis`` with a ``shape`` (``tensor_split``'s ``FusedLayout``)."""
    from shardfn.spec import Layout, P

    return (isinstance(x, (P, Layout)) or isinstance(getattr(x, "sharded_axes", None), tuple)
            or (isinstance(getattr(x, "axis", None), str) and hasattr(x, "shape")))


def _leaf_axes(spec: Any) -> tuple[str, ...]:
    from shardfn.spec import Layout, P, spec_axes

    if isinstance(spec, (P, Layout)):
        axes = spec_axes(spec)
    else:
        axes = getattr(spec, "sharded_axes", None) or (spec.axis,)
    return tuple(sorted(set(axes)))


def _spec_tree_axis_sets(specs: PyTree) -> set[tuple[str, ...]]:
    """The distinct sorted axis sets named anywhere in the spec tree."""
    if specs is None:
        return set()
    spec_leaves = pytree.tree_leaves(specs, is_leaf=_is_layout)
    return {_leaf_axes(s) for s in spec_leaves if _is_layout(s)}


def _axes_per_leaf(specs: PyTree, tree: PyTree) -> list[tuple[str, ...]]:
    """The sorted mesh axes each leaf of ``tree`` is sharded over (``()`` = replicated)."""
    n = len(pytree.tree_leaves(tree))
    if specs is None:
        return [()] * n
    spec_leaves = per_leaf(specs, tree, _is_layout)
    axes = []
    for i, spec in enumerate(spec_leaves):
        if spec is not None and not _is_layout(spec):
            name = pytree.tree_paths(tree)[i]
            raise ValueError(
                f"clip_by_global_norm: cannot tell over which mesh axes leaf {name!r} is split: "
                f"its spec is {spec!r}; expected a P, a Layout, None (replicated) or a layout "
                "object naming its axes (.sharded_axes as in FsdpTpModel.specs, or .axis as in "
                "FusedLayout)")
        axes.append(() if spec is None else _leaf_axes(spec))
    return axes
