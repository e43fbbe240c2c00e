"""`data_parallel`: gradient averaging over a data-parallel axis (the DDP baseline).

Two ways to use it, the same collectives either way:

* **Pure step** (``torch.func``): ``grads = dp.reduce_grads(grads)`` averages a
  gradient tree over ``axis``. Leaves are packed into flat buckets of
  ``bucket_bytes`` (so a model of many small tensors costs few all-reduces) and
  all buckets are issued before any is waited on.
* **Autograd step**: ``with dp.overlap(params) as sync: loss.backward()`` hooks
  every parameter; as soon as all gradients of a bucket have been accumulated,
  that bucket's all-reduce starts while backward goes on (DDP's overlap).
  ``sync.grads()`` waits and returns the averaged gradient tree; the ``.grad``
  fields are left as autograd wrote them. Buckets are formed in reverse tree
  order, the order in which backward usually produces gradients.

Communication per step: one all-reduce of the gradients, ``2 Psi (N-1)/N`` bytes
per rank. Memory: one flat copy of the gradients per in-flight bucket.

Example:
    >>> dp = sf.data_parallel(mesh, "dp")
    >>> grads = dp.reduce_grads(torch.func.grad(loss)(params, local_batch))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh
from shardfn.primitives import _comm
from shardfn.primitives.flat import FlatPartition, all_reduce_async
from shardfn.transforms.precision import Precision

__all__ = ["DataParallel", "data_parallel"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
_ops = torch.ops._c10d_functional


class DataParallel(NamedTuple):
    """Gradient averaging over a mesh axis.

    Attributes:
        reduce_grads: ``reduce_grads(grads) -> averaged grads`` (pure).
        overlap: ``overlap(params)`` context manager for autograd steps.
    """

    reduce_grads: Callable
    overlap: Callable


def data_parallel(mesh: Mesh, axis: AxisName = "dp", *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  average: bool = True, precision: Precision | None = None) -> DataParallel:
    """Average gradients over ``axis`` in flat buckets (DDP semantics).

    Args:
        mesh: the mesh.
        axis: the data-parallel axis (or tuple of axes).
        bucket_bytes: bytes per all-reduce bucket.
        average: divide the sum by the axis size (mean over ranks).
        precision: its ``reduce_dtype`` (if set) is the dtype gradients are
            all-reduced in; results come back in each gradient's own dtype.

    Returns:
        A :class:`DataParallel`.

    Example:
        >>> dp = sf.data_parallel(mesh, "dp", bucket_bytes=2**20)
    """
    ax = _comm.resolve(axis, mesh)
    reduce_dtype = precision.reduce_dtype if precision is not None else None

    def plan(tree) -> FlatPartition:
        leaves = pytree.tree_leaves(tree)
        itemsize = leaves[0].element_size() if leaves else 4
        return FlatPartition.of(tree, 1, 0, max(1, bucket_bytes // itemsize))

    def reduce_grads(grads):
        if ax.size == 1:
            return grads
        part = plan(grads)
        flat = part.all_reduce(part.flatten(grads, reduce_dtype), ax)
        if average:
            flat = flat / ax.size
        return pytree.tree_map(lambda r, g: r.to(g.dtype), part.unflatten(flat), grads)

    def overlap(params) -> _Overlap:
        return _Overlap(params, ax, bucket_bytes, average, reduce_dtype)

    return DataParallel(reduce_grads, overlap)


class _Overlap:
    """Hooks that all-reduce gradient buckets as backward produces them."""

    def __init__(self, params, ax, bucket_bytes: int, average: bool,
                 reduce_dtype: torch.dtype | None):
        self.names, self.leaves, self.treedef = pytree.tree_flatten_with_path(params)
        for name, leaf in zip(self.names, self.leaves, strict=True):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_leaf and leaf.requires_grad):
                raise ValueError(f"overlap: leaf {name!r} must be a leaf tensor that requires grad")
        self.ax, self.average, self.reduce_dtype = ax, average, reduce_dtype
        self.buckets: list[list[int]] = []
        size = 0
        for i in reversed(range(len(self.leaves))):
            nbytes = self.leaves[i].numel() * self.leaves[i].element_size()
            if not self.buckets or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.handles: dict[int, torch.Tensor] = {}
        self.pending: list[int] = []
        self.hooks: list = []

    def __enter__(self) -> _Overlap:
        self.pending = [len(members) for members in self.buckets]
        self.handles = {}
        self.hooks = [leaf.register_post_accumulate_grad_hook(self._hook_for(i))
                      for i, leaf in enumerate(self.leaves)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def _hook_for(self, i: int):
        def hook(_param):
            b = self.bucket_of[i]
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self._launch(b)

        return hook

    def _launch(self, b: int) -> None:
        dtype = self.reduce_dtype or self.leaves[self.buckets[b][0]].grad.dtype
        grads = [self.leaves[i].grad.reshape(-1).to(dtype) for i in self.buckets[b]]
        flat = torch.cat(grads) if len(grads) > 1 else grads[0].clone()
        self.handles[b] = all_reduce_async(flat, self.ax) if self.ax.size > 1 else flat

    def grads(self):
        """Wait for every bucket and return the averaged gradient tree (new tensors)."""
        out: list[torch.Tensor | None] = [None] * len(self.leaves)
        for b, members in enumerate(self.buckets):
            if b not in self.handles:
                missing = [self.names[i] for i in members if self.leaves[i].grad is None]
                if missing:
                    raise RuntimeError(f"overlap: no gradient arrived for {missing[:5]}; every "
                                       "leaf passed to overlap() must take part in the loss")
                self._launch(b)
            flat = self.handles[b]
            flat = _ops.wait_tensor(flat) if self.ax.size > 1 else flat
            if self.average and self.ax.size > 1:
                flat = flat / self.ax.size
            at = 0
            for i in members:
                leaf = self.leaves[i]
                out[i] = flat[at:at + leaf.numel()].view(leaf.shape).to(leaf.dtype)
                at += leaf.numel()
        return pytree.tree_unflatten(self.treedef, out)
