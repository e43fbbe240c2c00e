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

ZeRO-1 versus ZeRO-2. In a pure step (``torch.func.grad`` returns the whole
local gradient tree) both run the same two collectives and a rank never holds
the full *reduced* gradient. With ``shard_grads=True`` (ZeRO-2, FairScale
ShardedDataParallel) the optimizer also offers ``overlap(params)`` for autograd
steps: hooks reduce-scatter each bucket as soon as backward has produced all
its gradients, while backward goes on, and free every ``.grad`` once its
buckets are sent, so a rank holds only its reduced gradient part plus the
buckets in flight; ``update(sync.grads(), state, params)`` then skips the
reduction. Without it (ZeRO-1, FairScale OSS) ``overlap`` is not offered.

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

    ZeRO-2 with autograd (``params`` are leaf tensors that require grad):

    >>> opt = sf.shard_opt_state(sf.optim.adamw(1e-3), mesh, "dp", shard_grads=True)
    >>> with opt.overlap(params) as sync:
    ...     loss_fn(params, local_batch).backward()
    >>> updates, state = opt.update(sync.grads(), state, params)
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
from shardfn.transforms.precision import Precision

__all__ = ["ReducedGrads", "ShardedOptState", "ShardedOptimizer", "shard_opt_state"]

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


class ReducedGrads(NamedTuple):
    """This rank's averaged gradient part, already reduce-scattered (``update`` skips the
    reduction when it gets one).

    Attributes:
        local: a tree with the parameters' structure of 1-D pieces this rank owns.
    """

    local: Any


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
        overlap: with ``shard_grads=True``, ``overlap(params)``: a context manager
            whose hooks reduce-scatter gradients during ``backward()`` (ZeRO-2);
            its ``grads()`` returns the :class:`ReducedGrads`. None otherwise.
    """

    init: Callable
    update: Callable
    gather_state: Callable
    shard_state: Callable
    reduce_grads: Callable
    partition: Callable
    overlap: Callable | None


def shard_opt_state(
    opt: GradientTransformation,
    mesh: Mesh,
    axis: AxisName = "dp",
    *,
    shard_grads: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    average: bool = True,
    precision: Precision | None = None,
) -> ShardedOptimizer:
    """Shard ``opt``'s state (and the gradient reduction) over ``axis`` (ZeRO-1/2).

    Args:
        opt: any pure optimizer from :mod:`shardfn.optim`.
        mesh: the mesh.
        axis: the data-parallel axis (or tuple of axes) to shard over.
        shard_grads: ZeRO-2: keep only the reduce-scattered gradient part (see module doc).
        bucket_bytes: bytes per reduce-scatter / all-gather bucket (over all ranks).
        average: divide the summed gradients by the axis size (data-parallel mean).
        precision: its ``reduce_dtype`` (if set) is the dtype gradients are
            reduce-scattered in; the optimizer gets them in the parameters' dtype.

    Returns:
        A :class:`ShardedOptimizer`; its ``init``/``update`` replace ``opt``'s.

    Example:
        >>> opt = sf.shard_opt_state(sf.optim.adam(1e-3), mesh, "dp", shard_grads=True)
    """
    ax = _comm.resolve(axis, mesh)
    reduce_dtype = precision.reduce_dtype if precision is not None else None

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
        flat = part.flatten(grads, reduce_dtype)
        return part.unflatten_local(finish(part.reduce_scatter(flat, ax), part.dtype))

    def finish(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        chunk = chunk / ax.size if average and ax.size > 1 else chunk
        return chunk.to(dtype)

    def update(grads, state: ShardedOptState, params):
        if params is None:
            raise ValueError("shard_opt_state's update needs params (to lay out the partition)")
        part = partition(params)
        _check_partition(state, record(part))
        if isinstance(grads, ReducedGrads):
            local_grads = grads.local
        else:
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

    def overlap(params) -> _Zero2Overlap:
        return _Zero2Overlap(params, partition(params), ax, finish, reduce_dtype)

    return ShardedOptimizer(init, update, gather_state, shard_state, reduce_grads, partition,
                            overlap if shard_grads else None)


class _Zero2Overlap:
    """Backward hooks that reduce-scatter flat buckets as their gradients arrive."""

    def __init__(self, params, part: FlatPartition, ax, finish: Callable,
                 reduce_dtype: torch.dtype | None):
        self.names, self.leaves, _ = pytree.tree_flatten_with_path(params)
        for name, leaf in zip(self.names, self.leaves, strict=True):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_leaf and leaf.requires_grad):
                raise ValueError(f"overlap: leaf {name!r} must be a leaf tensor that requires grad")
        self.part, self.ax, self.finish = part, ax, finish
        self.reduce_dtype = reduce_dtype or part.dtype
        ends = [o + leaf.numel() for o, leaf in zip(part.offsets, self.leaves, strict=True)]
        # buckets[b] = leaves overlapping bucket b; a leaf may span several buckets
        self.members = [[i for i, (o, e) in enumerate(zip(part.offsets, ends, strict=True))
                         if o < stop and e > start] for start, stop in part.buckets]
        self.buckets_of = {i: [b for b, m in enumerate(self.members) if i in m]
                           for i in range(len(self.leaves))}

    def __enter__(self) -> _Zero2Overlap:
        self.pending = [len(m) for m in self.members]
        self.unsent = {i: len(bs) for i, bs in self.buckets_of.items()}
        self.flat_grads: dict[int, torch.Tensor] = {}
        self.handles: dict[int, torch.Tensor] = {}
        self.hooks = [leaf.register_post_accumulate_grad_hook(self._hook_for(i))
                      for i, leaf in enumerate(self.leaves)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def _hook_for(self, i: int):
        def hook(param):
            self.flat_grads[i] = param.grad.reshape(-1)
            param.grad = None  # the full local gradient lives only until its buckets are sent
            for b in self.buckets_of[i]:
                self.pending[b] -= 1
                if self.pending[b] == 0:
                    self._launch(b)

        return hook

    def _launch(self, b: int) -> None:
        start, stop = self.part.buckets[b]
        pieces = []
        for i in self.members[b]:
            offset, numel = self.part.offsets[i], self.leaves[i].numel()
            lo, hi = max(start, offset) - offset, min(stop, offset + numel) - offset
            pieces.append(self.flat_grads[i][lo:hi].to(self.reduce_dtype))
            self.unsent[i] -= 1
            if self.unsent[i] == 0:
                del self.flat_grads[i]
        pad = self.part.size * self.part.block(b) - (stop - start)
        if pad:
            pieces.append(pieces[0].new_zeros(pad))
        self.handles[b] = self.part.reduce_scatter_bucket(torch.cat(pieces), self.ax)

    def grads(self) -> ReducedGrads:
        """Wait for every bucket; this rank's averaged gradient part."""
        missing = [self.names[i] for i, n in self.unsent.items() if n and i not in self.flat_grads]
        if missing:
            raise RuntimeError(f"overlap: no gradient arrived for {missing[:5]}; every leaf "
                               "passed to overlap() must take part in the loss")
        for b in range(len(self.part.buckets)):
            if b not in self.handles:
                self._launch(b)
        chunks = [self.part.wait(self.handles[b]) for b in range(len(self.part.buckets))]
        chunk = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        return ReducedGrads(self.part.unflatten_local(self.finish(chunk, self.part.dtype)))


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
