"""Differentiable collectives over named mesh axes, mapped over pytrees.

Gradients follow JAX's transpose rules: the gradient of a per-rank output is
that of the *sum over ranks* of every rank's output. So

==================  ====================================  ==========================
collective          forward                               backward (transpose)
==================  ====================================  ==========================
psum                sum over the axis                     psum
pmean               mean over the axis                    pmean
all_gather          concatenate along ``dim``             psum_scatter
psum_scatter        sum, keep this rank's block           all_gather
all_to_all          split / exchange / concat             all_to_all, dims swapped
ppermute            send along ``perm``                   ppermute, inverse perm
broadcast           copy from ``src``                     psum to ``src``, 0 elsewhere
==================  ====================================  ==========================

For values known to be replicated over the axis (a loss after ``pmean``, the
input of a tensor-parallel region) the *invariant* forms avoid counting a
gradient once per rank (JAX's ``check_vma`` forms; Megatron's ``f``/``g`` pair):

* :func:`psum_invariant` / :func:`pmean_invariant` — forward psum/pmean,
  backward identity (Megatron ``g``). Use it when every rank goes on to compute
  the same loss from the result and the loss is counted once.
* :func:`pvary` — forward identity, backward psum (Megatron ``f``). Use it
  where a replicated value enters per-rank (varying) computation.

Every function works under ``torch.autograd``, ``torch.func.grad``,
``grad_and_value``, ``vjp`` and ``vmap``: each is an ``autograd.Function`` in
the ``forward`` + ``setup_context`` style calling the ``_c10d_functional`` ops.

Example (on each rank of a 2-rank world):
    >>> mesh = sf.Mesh({"dp": 2})
    >>> with mesh:
    ...     total = sf.psum(torch.ones(3), "dp")   # tensor([2., 2., 2.])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh, get_mesh
from shardfn.primitives import _comm
from shardfn.primitives._comm import Axis

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "broadcast",
    "pmean",
    "pmean_invariant",
    "ppermute",
    "psum",
    "psum_invariant",
    "psum_scatter",
    "pvary",
]


def _grad_in(grad: torch.Tensor) -> torch.Tensor:
    return grad.detach().contiguous()


def _batch_first(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


class _Psum(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, grad_psum: bool):
        return _comm.psum(x, ax)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.grad_psum = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        grad = _grad_in(grad)
        return (_comm.psum(grad, ctx.ax) if ctx.grad_psum else grad), None, None

    @staticmethod
    def vmap(info, in_dims, x, ax, grad_psum):
        return _Psum.apply(x, ax, grad_psum), in_dims[0]


class _Pvary(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _comm.psum(_grad_in(grad), ctx.ax), None

    @staticmethod
    def vmap(info, in_dims, x, ax):
        return _Pvary.apply(x, ax), in_dims[0]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, dim: int):
        return _comm.all_gather(x, ax, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.dim = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return _comm.psum_scatter(_grad_in(grad), ctx.ax, ctx.dim), None, None

    @staticmethod
    def vmap(info, in_dims, x, ax, dim):
        if in_dims[0] is None:
            return _AllGather.apply(x, ax, dim), None
        return _AllGather.apply(_batch_first(x, in_dims[0]), ax, dim + 1), 0


class _PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, dim: int):
        return _comm.psum_scatter(x, ax, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.dim = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return _comm.all_gather(_grad_in(grad), ctx.ax, ctx.dim), None, None

    @staticmethod
    def vmap(info, in_dims, x, ax, dim):
        if in_dims[0] is None:
            return _PsumScatter.apply(x, ax, dim), None
        return _PsumScatter.apply(_batch_first(x, in_dims[0]), ax, dim + 1), 0


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, split_dim: int, concat_dim: int):
        return _comm.all_to_all(x, ax, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.split_dim, ctx.concat_dim = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        grad = _comm.all_to_all(_grad_in(grad), ctx.ax, ctx.concat_dim, ctx.split_dim)
        return grad, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, ax, split_dim, concat_dim):
        if in_dims[0] is None:
            return _AllToAll.apply(x, ax, split_dim, concat_dim), None
        x = _batch_first(x, in_dims[0])
        return _AllToAll.apply(x, ax, split_dim + 1, concat_dim + 1), 0


class _Ppermute(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, perm: tuple[tuple[int, int], ...]):
        return _comm.ppermute(x, ax, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.perm = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        inverse = tuple((dst, src) for src, dst in ctx.perm)
        return _comm.ppermute(_grad_in(grad), ctx.ax, inverse), None, None

    @staticmethod
    def vmap(info, in_dims, x, ax, perm):
        return _Ppermute.apply(x, ax, perm), in_dims[0]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, src: int):
        return _comm.broadcast(x, ax, src)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.src = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        total = _comm.psum(_grad_in(grad), ctx.ax)
        return (total if ctx.ax.index == ctx.src else torch.zeros_like(total)), None, None

    @staticmethod
    def vmap(info, in_dims, x, ax, src):
        return _Broadcast.apply(x, ax, src), in_dims[0]


# ---- public API ------------------------------------------------------------------


def _map(fn, tree, name: str):
    def leaf(path: str, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: leaf {path!r} is a {type(x).__name__}, not a Tensor")
        return fn(x)

    return pytree.tree_map_with_path(leaf, tree)


def _dim(x: torch.Tensor, dim: int, name: str, ax: Axis) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(
            f"{name} over axis {ax.key!r}: dim {dim} is out of range for a tensor of shape "
            f"{tuple(x.shape)}"
        )
    return dim % x.dim()


def psum(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Sum every leaf over the ranks of ``axis``; backward is psum (varying rule).

    Args:
        tree: a tensor or pytree of tensors.
        axis: a mesh axis name or a tuple of names (their product).
        mesh: overrides the current mesh.

    Returns:
        The tree of sums, identical on every rank of the axis.

    Example:
        >>> with sf.Mesh({"dp": 2}):
        ...     sf.psum(torch.tensor(1.0), "dp")   # tensor(2.)
    """
    ax = _comm.resolve(axis, mesh)
    return _map(lambda x: _Psum.apply(x, ax, True) if ax.size > 1 else x, tree, "psum")


def pmean(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Mean of every leaf over ``axis``; backward is pmean (varying rule).

    Args:
        tree: a tensor or pytree of tensors.
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.

    Returns:
        The tree of means.

    Example:
        >>> grads = sf.pmean(grads, "dp")
    """
    ax = _comm.resolve(axis, mesh)
    return _map(lambda x: _Psum.apply(x, ax, True) / ax.size if ax.size > 1 else x, tree, "pmean")


def psum_invariant(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Sum over ``axis`` whose backward is the identity (Megatron ``g``).

    The result is replicated; use it where the downstream computation is the
    same on every rank and counted once, so the gradient is not multiplied by
    the axis size.

    Args:
        tree: a tensor or pytree of tensors.
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.

    Returns:
        The tree of sums.

    Example:
        >>> y = sf.psum_invariant(x @ w_row_shard, "tp")   # row-parallel linear
    """
    ax = _comm.resolve(axis, mesh)
    return _map(lambda x: _Psum.apply(x, ax, False) if ax.size > 1 else x, tree, "psum_invariant")


def pmean_invariant(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Mean over ``axis`` whose backward is the identity divided by the axis size.

    Args:
        tree: a tensor or pytree of tensors.
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.

    Returns:
        The tree of means.

    Example:
        >>> loss = sf.pmean_invariant(local_loss, "dp")
    """
    ax = _comm.resolve(axis, mesh)

    def leaf(x):
        return _Psum.apply(x, ax, False) / ax.size if ax.size > 1 else x

    return _map(leaf, tree, "pmean_invariant")


def pvary(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Identity forward, psum backward (Megatron ``f``): a replicated value entering per-rank work.

    Args:
        tree: a tensor or pytree of tensors, replicated over ``axis``.
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.

    Returns:
        The same values.

    Example:
        >>> h = sf.pvary(x, "tp") @ w_column_shard   # column-parallel linear
    """
    ax = _comm.resolve(axis, mesh)
    return _map(lambda x: _Pvary.apply(x, ax) if ax.size > 1 else x, tree, "pvary")


def all_gather(tree, axis: AxisName, *, dim: int = 0, tiled: bool = True,
               mesh: Mesh | None = None):
    """Gather every rank's leaf along ``dim`` (concatenated, or stacked if not ``tiled``).

    Backward is psum_scatter of the gradient.

    Args:
        tree: a tensor or pytree of tensors of equal shape on every rank.
        axis: a mesh axis name or a tuple of names.
        dim: the dimension to concatenate (or, untiled, where the new axis goes).
        tiled: concatenate (True) or stack along a new dimension (False).
        mesh: overrides the current mesh.

    Returns:
        The gathered tree; blocks are in axis-index order.

    Example:
        >>> full = sf.all_gather(local_rows, "dp", dim=0)
    """
    ax = _comm.resolve(axis, mesh)

    def leaf(x):
        if not tiled:
            x = x.unsqueeze(dim)
        d = _dim(x, dim, "all_gather", ax)
        return _AllGather.apply(x, ax, d) if ax.size > 1 else x

    return _map(leaf, tree, "all_gather")


def psum_scatter(tree, axis: AxisName, *, dim: int = 0, tiled: bool = True,
                 mesh: Mesh | None = None):
    """Sum over ``axis`` and keep this rank's block of ``dim``; backward is all_gather.

    Args:
        tree: a tensor or pytree of tensors; ``dim`` must divide by the axis size
            (or, untiled, equal it: the block is then squeezed).
        axis: a mesh axis name or a tuple of names.
        dim: the dimension to scatter.
        tiled: keep the block's dimension (True) or drop it (False).
        mesh: overrides the current mesh.

    Returns:
        This rank's block of the sum.

    Example:
        >>> grad_shard = sf.psum_scatter(full_grad, "dp", dim=0)
    """
    ax = _comm.resolve(axis, mesh)

    def leaf(x):
        d = _dim(x, dim, "psum_scatter", ax)
        if not tiled and x.shape[d] != ax.size:
            raise ValueError(
                f"psum_scatter(tiled=False) over axis {ax.key!r} needs dim {d} of size "
                f"{ax.size}, got shape {tuple(x.shape)}"
            )
        out = _PsumScatter.apply(x, ax, d) if ax.size > 1 else x
        return out if tiled else out.squeeze(d)

    return _map(leaf, tree, "psum_scatter")


def all_to_all(tree, axis: AxisName, split_dim: int, concat_dim: int, *,
               mesh: Mesh | None = None):
    """Split ``split_dim`` into axis-size blocks, send block j to rank j, concat on ``concat_dim``.

    Backward is all_to_all with the two dimensions swapped.

    Args:
        tree: a tensor or pytree of tensors.
        axis: a mesh axis name or a tuple of names.
        split_dim: dimension split into blocks (must divide by the axis size).
        concat_dim: dimension the received blocks are concatenated on.
        mesh: overrides the current mesh.

    Returns:
        The exchanged tree.

    Example:
        >>> heads_local = sf.all_to_all(seq_local, "sp", split_dim=2, concat_dim=1)
    """
    ax = _comm.resolve(axis, mesh)

    def leaf(x):
        s = _dim(x, split_dim, "all_to_all", ax)
        c = _dim(x, concat_dim, "all_to_all", ax)
        return _AllToAll.apply(x, ax, s, c) if ax.size > 1 else x

    return _map(leaf, tree, "all_to_all")


def ppermute(tree, axis: AxisName, perm: Sequence[tuple[int, int]], *,
             mesh: Mesh | None = None):
    """Send each leaf from axis index ``src`` to ``dst`` for each ``(src, dst)`` in ``perm``.

    Ranks that receive nothing get zeros (JAX semantics). Backward sends the
    gradient along the inverse permutation.

    Args:
        tree: a tensor or pytree of tensors.
        axis: a mesh axis name or a tuple of names.
        perm: pairs of axis indices; each source and each destination at most once.
        mesh: overrides the current mesh.

    Returns:
        The received tree.

    Example:
        >>> n = sf.axis_size("pp")
        >>> nxt = sf.ppermute(x, "pp", [(i, (i + 1) % n) for i in range(n)])
    """
    ax = _comm.resolve(axis, mesh)
    perm = tuple((int(s), int(d)) for s, d in perm)
    sources, dests = [s for s, _ in perm], [d for _, d in perm]
    for i in sources + dests:
        if not 0 <= i < ax.size:
            raise ValueError(f"ppermute over axis {ax.key!r} of size {ax.size}: index {i} in "
                             f"perm {list(perm)} is out of range")
    if len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise ValueError(f"ppermute perm {list(perm)} repeats a source or a destination")
    return _map(lambda x: _Ppermute.apply(x, ax, perm), tree, "ppermute")


def broadcast(tree, axis: AxisName, *, src: int = 0, mesh: Mesh | None = None):
    """Copy the leaves of axis index ``src`` to every rank of ``axis``.

    Backward sums the gradient into ``src`` (zeros on the other ranks).

    Args:
        tree: a tensor or pytree of tensors (same shapes on every rank).
        axis: a mesh axis name or a tuple of names.
        src: the axis index whose values are sent.
        mesh: overrides the current mesh.

    Returns:
        ``src``'s tree on every rank.

    Example:
        >>> params = sf.broadcast(params, "dp", src=0)
    """
    ax = _comm.resolve(axis, mesh)
    if not 0 <= src < ax.size:
        raise ValueError(f"broadcast over axis {ax.key!r} of size {ax.size}: src {src} is out "
                         "of range")
    return _map(lambda x: _Broadcast.apply(x, ax, src) if ax.size > 1 else x, tree, "broadcast")


def axis_index(axis: AxisName, *, mesh: Mesh | None = None) -> int:
    """This rank's index along ``axis`` (row-major over a tuple of axes).

    Example:
        >>> sf.axis_index("dp")   # 0 or 1 on a 2-rank "dp" mesh
    """
    return get_mesh(mesh).index(axis)


def axis_size(axis: AxisName, *, mesh: Mesh | None = None) -> int:
    """Number of ranks along ``axis``.

    Example:
        >>> sf.axis_size("dp")
    """
    return get_mesh(mesh).size(axis)
