"""`shard_opt_state`: ZeRO-1 / ZeRO-2 (FairScale OSS + ShardedDataParallel) as a wrapper.

``shard_opt_state(opt, mesh, axis="dp")`` turns any :class:`GradientTransformation`
into one whose state covers only this rank's part of the parameters:

1. ``update`` takes each rank's *local* gradient (the gradient of the loss on
   its own micro-batch, not yet averaged), lays it out flat and
   **reduce-scatters** it over ``axis`` in buckets, so each rank receives the
   averaged gradient of just the part it owns (see :mod:`shardfn.primitives.flat`:
   buckets are split evenly, so ranks are balanced to within padding, even
   when one tensor is larger than all others together).
2. The wrapped optimizer updates that part. Its masks, labels and per-group
   hyper-parameters see a tree of the usual structure whose leaves are the
   1-D pieces this rank owns; ``clip_by_global_norm`` inside it is told that
   every leaf is sharded over ``axis`` and computes the exact global norm.
3. The updates are **all-gathered**, so every rank returns the full updates
   for ``apply_updates``, exactly as the unsharded optimizer would.

ZeRO-1 versus ZeRO-2: with ``shard_grads=True`` the returned state also holds
no gradient and the reduce-scattered gradient part is the only reduced
gradient a rank ever holds; without it (ZeRO-1, FairScale OSS) the same
collectives run, but ``reduce_grads`` (for logging or custom steps) returns the
full averaged gradient tree via an extra all-gather. In a pure step both hold
the local gradient tree only transiently.

Memory per rank: optimizer state ``K * T / N`` for an optimizer with ``K``
state tensors per parameter (Adam: ``K = 2``), plus padding.
Communication per step: reduce-scatter + all-gather = ``2 Psi (N-1)/N`` bytes
(``Psi`` = parameter bytes), the same as one all-reduce.

Example:
    >>> opt = sf.shard_opt_state(sf.optim.adamw(1e-3), mesh, axis="dp")
    >>> state = opt.init(params)
    >>> grads = torch.func.grad(loss)(params, local_batch)   # no pmean needed
    >>> updates, state = opt.update(grads, state, params)
    >>> params = sf.optim.apply_updates(params, updates)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh
from shardfn.optim.base import GradientTransformation
from shardfn.optim.clipping import sharded_over
from shardfn.primitives import _comm
from shardfn.primitives.flat import FlatPartition

__all__ = ["ShardedOptState", "ShardedOptimizer", "shard_opt_state"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


class ShardedOptState(NamedTuple):
    """State of a sharded optimizer.

    Attributes:
        inner: the wrapped optimizer's state over this rank's part of the parameters.
        partition: int64 ``[axis size, axis index, total elements, tree fingerprint]``:
            which partition ``inner`` belongs to (checked on every update).
    """

    inner: Any
    partition: torch.Tensor


class ShardedOptimizer(NamedTuple):
    """A :class:`GradientTransformation` with ZeRO partitioning, plus state conversions.

    Attributes:
        init: ``init(params) -> ShardedOptState``.
        update: ``update(local_grads, state, params) -> (full updates, state)``.
        gather_state: ``gather_state(state, params)`` -> the full, unsharded inner state
            (identical on every rank), e.g. to inspect or save it.
        shard_state: ``shard_state(full_inner_state, params)`` -> this rank's
            ``ShardedOptState``, e.g. to load a state saved at another world size.
        reduce_grads: ``reduce_grads(local_grads, params)`` -> this rank's averaged
            gradient part (a tree of 1-D pieces).
        partition: ``partition(params) -> FlatPartition``.
    """

    init: Callable
    update: Callable
    gather_state: Callable
    shard_state: Callable
    reduce_grads: Callable
    partition: Callable


def shard_opt_state(
    opt: GradientTransformation,
    mesh: Mesh,
    axis: AxisName = "dp",
    *,
    shard_grads: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    average: bool = True,
) -> ShardedOptimizer:
    """Shard ``opt``'s state (and the gradient reduction) over ``axis`` (ZeRO-1/2).

    Args:
        opt: any pure optimizer from :mod:`shardfn.optim`.
        mesh: the mesh.
        axis: the data-parallel axis (or tuple of axes) to shard over.
        shard_grads: ZeRO-2: keep only the reduce-scattered gradient part (see module doc).
        bucket_bytes: bytes per reduce-scatter / all-gather bucket (over all ranks).
        average: divide the summed gradients by the axis size (data-parallel mean).

    Returns:
        A :class:`ShardedOptimizer`; its ``init``/``update`` replace ``opt``'s.

    Example:
        >>> opt = sf.shard_opt_state(sf.optim.adam(1e-3), mesh, "dp", shard_grads=True)
    """
    ax = _comm.resolve(axis, mesh)

    def partition(params) -> FlatPartition:
        leaves = pytree.tree_leaves(params)
        itemsize = leaves[0].element_size() if leaves else 4
        return FlatPartition.of(params, ax.size, ax.index, max(1, bucket_bytes // itemsize))

    def record(part: FlatPartition) -> torch.Tensor:
        return torch.tensor([ax.size, ax.index, part.total, _fingerprint(part)], dtype=torch.int64)

    def init(params) -> ShardedOptState:
        part = partition(params)
        _check_same_tree_on_all_ranks(part, ax)
        return ShardedOptState(opt.init(part.local(params)), record(part))

    def reduce_grads(grads, params):
        part = partition(params)
        pytree.tree_map(lambda g, p: None, grads, params)  # structure check, names leaves
        chunk = part.reduce_scatter(part.flatten(grads), ax)
        if average and ax.size > 1:
            chunk = chunk / ax.size
        return part.unflatten_local(chunk)

    def update(grads, state: ShardedOptState, params):
        if params is None:
            raise ValueError("shard_opt_state's update needs params (to lay out the partition)")
        part = partition(params)
        _check_partition(state, record(part))
        local_grads = reduce_grads(grads, params)
        with sharded_over(axis, mesh):
            local_updates, inner = opt.update(local_grads, state.inner, part.local(params))
        full = part.unflatten(part.all_gather(part.flatten_local(local_updates), ax))
        updates = pytree.tree_map(lambda u, p: u.to(p.dtype), full, params)
        return updates, ShardedOptState(inner, state.partition)

    def gather_state(state: ShardedOptState, params):
        part = partition(params)
        _check_partition(state, record(part))
        return _map_state(state.inner, params, part,
                          lambda local: part.unflatten(part.all_gather(
                              part.flatten_local(local), ax)))

    def shard_state(full_inner, params) -> ShardedOptState:
        part = partition(params)
        return ShardedOptState(_map_state(full_inner, params, part, part.local), record(part))

    del shard_grads  # same collectives in a pure step; see the module docstring
    return ShardedOptimizer(init, update, gather_state, shard_state, reduce_grads, partition)


def _map_state(state, params, part: FlatPartition, fn):
    """Apply ``fn`` to every sub-tree of ``state`` shaped like the parameter tree."""
    param_def = pytree.tree_structure(params)

    def is_param_like(x):
        try:
            return pytree.tree_structure(x) == param_def and not isinstance(x, torch.Tensor)
        except Exception:  # noqa: BLE001 - optree raises various errors on odd nodes
            return False

    return pytree.tree_map(
        lambda x: fn(x) if is_param_like(x) else x, state, is_leaf=is_param_like
    )


def _fingerprint(part: FlatPartition) -> int:
    text = repr((part.names, part.shapes, str(part.dtype)))
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


def _check_partition(state, expected: torch.Tensor) -> None:
    if not isinstance(state, ShardedOptState):
        raise TypeError(f"expected a ShardedOptState from this optimizer's init, got "
                        f"{type(state).__name__}")
    got = state.partition.tolist()
    want = expected.tolist()
    if got != want:
        raise ValueError(
            f"optimizer state belongs to another partitioning: it was made for axis size "
            f"{got[0]}, index {got[1]}, {got[2]} elements (tree fingerprint {got[3]}), this "
            f"rank has axis size {want[0]}, index {want[1]}, {want[2]} elements (fingerprint "
            f"{want[3]}). Use gather_state/shard_state to move a state between partitionings."
        )


def _check_same_tree_on_all_ranks(part: FlatPartition, ax) -> None:
    if ax.size == 1:
        return
    mine = torch.tensor([_fingerprint(part)], dtype=torch.int64)
    everyone = _comm.all_gather(mine, ax, 0).tolist()
    if len(set(everyone)) == 1:
        return
    trees = [None] * ax.size
    dist.all_gather_object(trees, list(zip(part.names, part.shapes, strict=True)), group=ax.group)
    first = dict(trees[0])
    for index, tree in enumerate(trees):
        tree = dict(tree)
        diff = sorted(set(tree.items()) ^ set(first.items()))
        if diff:
            name = diff[0][0]
            raise ValueError(
                f"the parameter tree differs between ranks of axis {ax.key!r}: leaf {name!r} "
                f"is {first.get(name, 'missing')} on index 0 but {tree.get(name, 'missing')} "
                f"on index {index} (global rank {ax.ranks[index]})"
            )
