"""``shard_opt_state``'s state conversions: the full inner state from every rank's part, and back.

``gather_state`` and ``shard_state`` must know which leaves of the wrapped
optimizer's state belong to which parameter (a moment, a momentum buffer) and
which are global (a step count). :func:`state_roles` finds out by running the
optimizer's ``init`` on shape-only *probe* parameters; :func:`reshard_state`
then all-gathers every per-parameter leaf into the parameter's shape, or cuts
this rank's 1-D piece out of it.

Example:
    >>> full = reshard_state(opt, state.inner, params, part, ax, gather=True)
    >>> mine = reshard_state(opt, full, params, part, ax, gather=False)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardfn import pytree
from shardfn.optim._tree import full_tree
from shardfn.optim.base import GradientTransformation
from shardfn.primitives import stats
from shardfn.primitives.flat import FlatPartition

__all__ = ["reshard_state", "state_roles"]

_PROBE = 1_000_000_007  # probe leaf i has 1-D shape (_PROBE + i,): no real state has it


def state_roles(opt: GradientTransformation, params, part: FlatPartition):
    """Which leaves of ``opt``'s state belong to which parameter leaf.

    ``opt.init`` runs on *probe* parameters: meta tensors (no memory) with the
    parameters' dtypes, leaf ``i`` of 1-D shape ``(_PROBE + i,)`` (1-D like the local
    pieces the sharded optimizer sees). A state leaf of that shape is leaf ``i``'s
    per-parameter state (a moment, a momentum buffer; under ``masked`` and
    ``multi_transform`` too, and for a bare tensor as params); a plain tensor not
    made from the probe (a step count) is global, the same on every rank.

    Returns:
        ``(treedef, roles, paths)``: the state's structure; per state leaf, the parameter
        leaf number or None (global); the leaves' dotted paths.

    Raises:
        ValueError: naming the state path of a leaf made from the parameters that is not
            an elementwise copy of one (it cannot be resharded), or when init cannot run
            on shape-only parameters.
    """
    leaves = pytree.tree_leaves(params)
    probe = pytree.tree_unflatten(part.treedef, [
        torch.empty(_PROBE + i, dtype=x.dtype, device="meta") for i, x in enumerate(leaves)])
    try:
        with full_tree(params):  # callable masks see the parameters, as in the real init
            probe_state = opt.init(probe)
    except Exception as err:  # noqa: BLE001 - any failure means: cannot tell, say so
        raise ValueError(
            "shard_opt_state: gather_state/shard_state run the wrapped optimizer's init on "
            "shape-only (meta) parameters to find which state leaves belong to which "
            f"parameter, and it failed: {type(err).__name__}: {err}") from err
    paths, state_leaves, treedef = _flatten_with_names(probe_state)
    roles: list[int | None] = []
    for path, x in zip(paths, state_leaves, strict=True):
        if not isinstance(x, torch.Tensor) or not x.is_meta:
            roles.append(None)  # global: a count, a flag, a Python value
            continue
        if x.dim() == 1 and _PROBE <= x.shape[0] < _PROBE + len(leaves):
            roles.append(x.shape[0] - _PROBE)
            continue
        raise ValueError(
            f"shard_opt_state: optimizer state leaf {path or '<root>'!r} (shape "
            f"{_shape_text(x.shape)} for the probe) is computed from the parameters but is "
            f"not an elementwise buffer of one parameter, so it cannot be resharded "
            f"between world sizes; gather_state/shard_state support states made of "
            f"per-parameter buffers (zeros_like(param)) and global values")
    return treedef, roles, paths


def _flatten_with_names(tree):
    """``(names, leaves, treedef)`` with NamedTuple fields by name ("1.mu.w", not "1.1.w")."""
    import optree

    accessors, leaves, treedef = optree.tree_flatten_with_accessor(
        tree, namespace=pytree.NAMESPACE)
    names = []
    for accessor in accessors:
        parts = [str(getattr(e, "field", None) or getattr(e, "entry", "")) for e in accessor]
        names.append(".".join(parts))
    return names, leaves, treedef


def _shape_text(shape) -> str:
    return str(tuple(f"P+{d - _PROBE}" if d >= _PROBE else d for d in shape))


def reshard_state(opt: GradientTransformation, state, params, part: FlatPartition, ax,
                   gather: bool):
    """The full inner state from this rank's (``gather``), or this rank's from the full.

    Per-parameter leaves (see :func:`state_roles`) are all-gathered into the
    parameter's shape, or cut into this rank's 1-D piece (a copy); global leaves are
    kept as they are.
    """
    treedef, roles, paths = state_roles(opt, params, part)
    state_leaves, got_def = pytree.tree_flatten(state)
    what = "sharded" if gather else "full"
    if got_def != treedef:
        raise ValueError(f"shard_opt_state: the {what} optimizer state does not have the "
                         f"structure of the wrapped optimizer's init ({got_def} vs {treedef})")
    for path, x, role in zip(paths, state_leaves, roles, strict=True):
        if role is None:
            continue
        want = (part.local_sizes[role],) if gather else part.shapes[role]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(want):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"shard_opt_state: {what} optimizer state leaf {path!r} (the state of "
                f"parameter {part.names[role]!r}) has shape {got}, expected {tuple(want)}"
                + (" (this rank's piece: was the state made for this partition?)" if gather
                   else " (the parameter's shape)"))
    out = list(state_leaves)
    items = [(k, role) for k, role in enumerate(roles) if role is not None]
    if gather:
        full = _gather_pieces(part, [(role, state_leaves[k]) for k, role in items], ax)
        for (k, _), x in zip(items, full, strict=True):
            out[k] = x
    else:
        pieces = part.pieces()
        for k, role in items:
            flat = state_leaves[k].detach().reshape(-1)
            out[k] = torch.cat([flat[a:b] for a, b in pieces[role]]) if pieces[role] \
                else flat[:0].clone()
    return pytree.tree_unflatten(treedef, out)


def _gather_pieces(part: FlatPartition, items: list[tuple[int, torch.Tensor]], ax
                   ) -> list[torch.Tensor]:
    """Full tensors (parameter shapes) from every rank's 1-D pieces of the given leaves.

    ``items``: ``(parameter leaf number, this rank's piece)``, the same list on every rank.
    One all-gather of the pieces' bytes per device (any dtypes together).
    """
    if ax.size == 1:
        return [x.reshape(part.shapes[i]).clone() for i, x in items]
    out: list[torch.Tensor | None] = [None] * len(items)
    by_device: dict[torch.device, list[int]] = {}
    for k, (_, x) in enumerate(items):
        by_device.setdefault(x.device, []).append(k)
    pieces = [part.pieces(j) for j in range(ax.size)]
    for device, ks in sorted(by_device.items(), key=lambda kv: str(kv[0])):
        sizes = [sum(items[k][1].element_size() * sum(b - a for a, b in pieces[j][items[k][0]])
                     for k in ks) for j in range(ax.size)]
        mine = [items[k][1].detach().contiguous().view(torch.uint8) for k in ks]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        if mine:
            joined = torch.cat(mine)
            buf[:joined.numel()].copy_(joined)
        everyone = [torch.empty_like(buf) for _ in range(ax.size)]
        with stats.collective_scope(ax.describe("all_gather (optimizer state)")):
            dist.all_gather(everyone, buf, group=ax.group)
        for k in ks:
            i, x = items[k]
            out[k] = torch.empty(math.prod(part.shapes[i]), dtype=x.dtype, device=device)
        for j in range(ax.size):
            at = 0
            for k in ks:
                i, x = items[k]
                full = out[k]
                for a, b in pieces[j][i]:
                    n = (b - a) * x.element_size()
                    full[a:b] = everyone[j][at:at + n].clone().view(x.dtype)  # aligned
                    at += n
    return [x.view(part.shapes[i]) for x, (i, _) in zip(out, items, strict=True)]
