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
``grad_and_value``, ``vjp``, ``vmap`` and their compositions (``vmap(grad)``,
``grad(vmap)``, ``jacrev``, double backward, ``jvp``/``jacfwd``/``hessian``):
each is an ``autograd.Function`` in the ``forward`` + ``setup_context`` style
calling the ``_c10d_functional`` ops, whose backward applies the transposed
Function (so under vmap the backward, too, is one collective on the batched
tensor). Leaves may be floating, complex, integer or bool (bools are summed as
int64 counts; a mean of integers is refused). Each public call validates every
leaf, then calls :func:`shardfn.primitives.consistency.check_call` once (axes
of more than one rank), then communicates. See docs/collectives.md.

Example (on each rank of a 2-rank world):
    >>> mesh = sf.Mesh({"dp": 2})
    >>> with mesh:
    ...     total = sf.psum(torch.ones(3), "dp")   # tensor([2., 2., 2.])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh, get_mesh
from shardfn.primitives import _comm, consistency
from shardfn.primitives._comm import Axis
from shardfn.primitives.reduce_scaling import divide_factors

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


# ---- autograd.Functions -------------------------------------------------------------
#
# Each backward is written with the Functions themselves (JAX's transpose rules as
# collectives), never with the raw ``_comm`` ops: under ``vmap(grad(f))`` the incoming
# gradient is a batched tensor, and a raw op on it would hit torch's per-example
# fallback (one collective per example, racing the other ranks' ones: wrong values).
# Through ``apply`` the vmap rule below runs ONE collective on the batched tensor, and
# the backward is itself differentiable (double backward, jacrev of a vjp). The
# collectives are linear, so each jvp (forward mode: torch.func.jvp, jacfwd, hessian)
# applies the same Function to the tangent.
# Every vmap rule moves the batch dim to the front and shifts the dims it is given.


def _batch_first(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


def _shift(bdim: int | None) -> int:
    """How far a dim moves when the batch dim goes in front (0 for an unbatched input)."""
    return 0 if bdim is None else 1


def _out_dim(bdim: int | None) -> int | None:
    return None if bdim is None else 0


class _Psum(torch.autograd.Function):
    """psum; backward psum (``grad_psum``, the varying rule) or pvary (the invariant rule)."""

    @staticmethod
    def forward(x, ax: Axis, grad_psum: bool):
        return _comm.psum(x, ax)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.grad_psum = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        grad = _Psum.apply(grad, ctx.ax, True) if ctx.grad_psum else _Pvary.apply(grad, ctx.ax)
        return grad, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _Psum.apply(tangent, ctx.ax, ctx.grad_psum)

    @staticmethod
    def vmap(info, in_dims, x, ax, grad_psum):
        return _Psum.apply(x, ax, grad_psum), in_dims[0]


class _Pvary(torch.autograd.Function):
    """Identity; backward psum whose own backward is the identity (transposes twice to pvary)."""

    @staticmethod
    def forward(x, ax: Axis):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _Psum.apply(grad, ctx.ax, False), None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _Pvary.apply(tangent, ctx.ax)

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
        return _PsumScatter.apply(grad, ctx.ax, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _AllGather.apply(tangent, ctx.ax, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, ax, dim):
        bdim = in_dims[0]
        return _AllGather.apply(_batch_first(x, bdim), ax, dim + _shift(bdim)), _out_dim(bdim)


class _PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, dim: int):
        return _comm.psum_scatter(x, ax, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.dim = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.ax, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _PsumScatter.apply(tangent, ctx.ax, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, ax, dim):
        bdim = in_dims[0]
        return _PsumScatter.apply(_batch_first(x, bdim), ax, dim + _shift(bdim)), _out_dim(bdim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, split_dim: int, concat_dim: int):
        return _comm.all_to_all(x, ax, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.split_dim, ctx.concat_dim = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.ax, ctx.concat_dim, ctx.split_dim), None, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _AllToAll.apply(tangent, ctx.ax, ctx.split_dim, ctx.concat_dim)

    @staticmethod
    def vmap(info, in_dims, x, ax, split_dim, concat_dim):
        bdim, k = in_dims[0], _shift(in_dims[0])
        out = _AllToAll.apply(_batch_first(x, bdim), ax, split_dim + k, concat_dim + k)
        return out, _out_dim(bdim)


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
        return _Ppermute.apply(grad, ctx.ax, inverse), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _Ppermute.apply(tangent, ctx.ax, ctx.perm)

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
        total = _Psum.apply(grad, ctx.ax, True)
        if ctx.ax.index == ctx.src:
            return total, None, None
        # zeros that stay in the graph (not zeros_like): a double backward must run the
        # psum's backward on every rank; where, not "* 0", so an inf stays out of it
        is_src = torch.zeros((), dtype=torch.bool, device=total.device)
        return torch.where(is_src, total, 0), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _Broadcast.apply(tangent, ctx.ax, ctx.src)

    @staticmethod
    def vmap(info, in_dims, x, ax, src):
        return _Broadcast.apply(x, ax, src), in_dims[0]


# ---- public API ------------------------------------------------------------------
#
# Each public collective validates every leaf first (a clear error before anything is
# sent), then runs the check-mode hook once for the whole call, then communicates.


def _run(op: str, ax: Axis, tree, prepare: Callable[[str, torch.Tensor], Callable[[], Any]],
         **static: Any):
    """Check-mode hook, validate each leaf with ``prepare(path, x)`` (it returns the leaf's
    work), run.

    The hook comes first: a leaf that is valid on one rank and not on another (its shape
    differs) then raises ConsistencyError on every rank at once, rather than a local
    error on one rank while the others wait for it at the next check.

    Raises:
        TypeError: naming the leaf, for a leaf that is not a tensor.
    """
    if ax.size > 1:
        consistency.check_call(op, ax, tree, **static)
    names, leaves, treedef = pytree.tree_flatten_with_path(tree)
    work = []
    for path, x in zip(names, leaves, strict=True):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: leaf {path!r} is a {type(x).__name__}, not a Tensor")
        work.append(prepare(path, x))
    return pytree.tree_unflatten(treedef, [run() for run in work])


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (numpy and 0-dim integer tensors too), else None.

    Bools are not integers here: ``dim=True`` is a mistake, not dim 1.
    """
    if isinstance(value, bool) or (
            isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _int_arg(op: str, ax: Axis, name: str, value: Any) -> int:
    """A static int argument (``dim``, ``src``, ...) as a Python int, or a TypeError naming it."""
    as_int = _as_int(value)
    if as_int is None:
        raise TypeError(f"{op} over axis {ax.key!r}: {name} must be an int, got {value!r}")
    return as_int


def _dim(op: str, ax: Axis, path: str, x: torch.Tensor, dim: int, ndim: int | None = None) -> int:
    """``dim`` normalised for a tensor of ``ndim`` dims (default ``x.dim()``), or a clear error."""
    ndim = x.dim() if ndim is None else ndim
    where = f"{op} over axis {ax.key!r}: leaf {path!r}"
    if ndim == 0:
        raise ValueError(f"{where} is a 0-dim tensor; {op} needs a tensor with a dim to split or "
                         "join (reshape it to shape (1,))")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{where}: dim {dim} is out of range for a tensor of shape "
                         f"{tuple(x.shape)} (valid: {-ndim}..{ndim - 1})")
    return dim % ndim


def _summable(x: torch.Tensor) -> torch.Tensor:
    """Bool leaves are summed as counts (int64, like ``torch.sum``); other dtypes as they are."""
    return x.to(torch.int64) if x.dtype == torch.bool else x


def _check_divisible(op: str, ax: Axis, path: str, x: torch.Tensor, dim: int) -> None:
    if x.shape[dim] % ax.size:
        raise ValueError(f"{op} over axis {ax.key!r}: leaf {path!r} needs dim {dim} (size "
                         f"{x.shape[dim]} of shape {tuple(x.shape)}) divisible by the axis size "
                         f"{ax.size}; pad it first (sf.shard pads for you)")


def _check_mean(op: str, ax: Axis, path: str, x: torch.Tensor) -> None:
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{op} over axis {ax.key!r}: leaf {path!r} has dtype {x.dtype}; the mean "
                        "of integers is not an integer. Cast it first (x.float()) or use psum "
                        "and divide as you mean to")


def psum(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Sum every leaf over the ranks of ``axis``; backward is psum (varying rule).

    Integer leaves are summed in their dtype; bool leaves are counted (int64, as
    ``torch.sum`` does).

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

    def prepare(path, x):
        x = _summable(x)
        return lambda: _Psum.apply(x, ax, True) if ax.size > 1 else x

    return _run("psum", ax, tree, prepare)


def _mean(x: torch.Tensor, ax: Axis, grad_psum: bool) -> torch.Tensor:
    """Sum over the axis divided by its size; in fp16/bf16 part of the division comes first
    (FSDP2's factors), so a mean that fits the dtype does not overflow in the sum."""
    pre, post = divide_factors(ax.size, x.dtype)
    if pre != 1:
        x = x / pre
    return _Psum.apply(x, ax, grad_psum) / post


def pmean(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Mean of every leaf over ``axis``; backward is pmean (varying rule).

    Args:
        tree: a tensor or pytree of floating or complex tensors (an integer or
            bool leaf raises TypeError: its mean is not an integer).
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.

    Returns:
        The tree of means.

    Example:
        >>> grads = sf.pmean(grads, "dp")
    """
    ax = _comm.resolve(axis, mesh)

    def prepare(path, x):
        _check_mean("pmean", ax, path, x)
        return lambda: _mean(x, ax, True) if ax.size > 1 else x

    return _run("pmean", ax, tree, prepare)


def psum_invariant(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Sum over ``axis`` whose backward is the identity (Megatron ``g``).

    The result is replicated; use it where the downstream computation is the
    same on every rank and counted once, so the gradient is not multiplied by
    the axis size. Dtypes as in :func:`psum`.

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

    def prepare(path, x):
        x = _summable(x)
        return lambda: _Psum.apply(x, ax, False) if ax.size > 1 else x

    return _run("psum_invariant", ax, tree, prepare)


def pmean_invariant(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Mean over ``axis`` whose backward is the identity divided by the axis size.

    Args:
        tree: a tensor or pytree of floating or complex tensors.
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.

    Returns:
        The tree of means.

    Example:
        >>> loss = sf.pmean_invariant(local_loss, "dp")
    """
    ax = _comm.resolve(axis, mesh)

    def prepare(path, x):
        _check_mean("pmean_invariant", ax, path, x)
        return lambda: _mean(x, ax, False) if ax.size > 1 else x

    return _run("pmean_invariant", ax, tree, prepare)


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
    return _run("pvary", ax, tree,
                lambda path, x: lambda: _Pvary.apply(x, ax) if ax.size > 1 else x)


def all_gather(tree, axis: AxisName, *, dim: int = 0, tiled: bool = True,
               mesh: Mesh | None = None):
    """Gather every rank's leaf along ``dim`` (concatenated, or stacked if not ``tiled``).

    Backward is psum_scatter of the gradient.

    Args:
        tree: a tensor or pytree of tensors of equal shape on every rank (a
            0-dim leaf only with ``tiled=False``: there is no dim to concatenate).
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
    dim = _int_arg("all_gather", ax, "dim", dim)

    def prepare(path, x):
        if tiled and x.dim() == 0:
            raise ValueError(f"all_gather over axis {ax.key!r}: leaf {path!r} is a 0-dim tensor "
                             "and tiled=True has no dim to concatenate; use tiled=False to stack")
        d = _dim("all_gather", ax, path, x, dim, x.dim() + (0 if tiled else 1))

        def run():
            y = x if tiled else x.unsqueeze(d)
            return _AllGather.apply(y, ax, d) if ax.size > 1 else y

        return run

    return _run("all_gather", ax, tree, prepare, dim=dim, tiled=tiled)


def psum_scatter(tree, axis: AxisName, *, dim: int = 0, tiled: bool = True,
                 mesh: Mesh | None = None):
    """Sum over ``axis`` and keep this rank's block of ``dim``; backward is all_gather.

    Args:
        tree: a tensor or pytree of tensors (at least 1-dim); ``dim`` must divide
            by the axis size (or, untiled, equal it: the block is then squeezed).
            Dtypes as in :func:`psum`.
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
    dim = _int_arg("psum_scatter", ax, "dim", dim)

    def prepare(path, x):
        d = _dim("psum_scatter", ax, path, x, dim)
        if not tiled and x.shape[d] != ax.size:
            raise ValueError(f"psum_scatter(tiled=False) over axis {ax.key!r}: leaf {path!r} "
                             f"needs dim {d} of size {ax.size}, got shape {tuple(x.shape)}")
        _check_divisible("psum_scatter", ax, path, x, d)
        x = _summable(x)

        def run():
            out = _PsumScatter.apply(x, ax, d) if ax.size > 1 else x
            return out if tiled else out.squeeze(d)

        return run

    return _run("psum_scatter", ax, tree, prepare, dim=dim, tiled=tiled)


def all_to_all(tree, axis: AxisName, split_dim: int, concat_dim: int, *,
               mesh: Mesh | None = None):
    """Split ``split_dim`` into axis-size blocks, send block j to rank j, concat on ``concat_dim``.

    Backward is all_to_all with the two dimensions swapped.

    Args:
        tree: a tensor or pytree of tensors (at least 1-dim).
        axis: a mesh axis name or a tuple of names.
        split_dim: dimension split into blocks (must divide by the axis size).
        concat_dim: dimension the received blocks are concatenated on (may equal
            ``split_dim``).
        mesh: overrides the current mesh.

    Returns:
        The exchanged tree.

    Example:
        >>> heads_local = sf.all_to_all(seq_local, "sp", split_dim=2, concat_dim=1)
    """
    ax = _comm.resolve(axis, mesh)
    split_dim = _int_arg("all_to_all", ax, "split_dim", split_dim)
    concat_dim = _int_arg("all_to_all", ax, "concat_dim", concat_dim)

    def prepare(path, x):
        s = _dim("all_to_all", ax, path, x, split_dim)
        c = _dim("all_to_all", ax, path, x, concat_dim)
        _check_divisible("all_to_all", ax, path, x, s)
        return lambda: _AllToAll.apply(x, ax, s, c) if ax.size > 1 else x

    return _run("all_to_all", ax, tree, prepare, split_dim=split_dim, concat_dim=concat_dim)


def _check_perm(ax: Axis, perm) -> tuple[tuple[int, int], ...]:
    """``perm`` as a tuple of int pairs, each source and destination in range and at most once."""
    if not isinstance(perm, Iterable) or isinstance(perm, (str, bytes, torch.Tensor)):
        raise TypeError(f"ppermute over axis {ax.key!r}: perm is a sequence of (src, dst) pairs, "
                        f"got {perm!r}")
    pairs = []
    for pair in perm:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or any(_as_int(i) is None for i in pair)):
            raise TypeError(f"ppermute over axis {ax.key!r}: perm entries are (src, dst) pairs "
                            f"of ints, got {pair!r} in {perm!r}")
        pairs.append((_as_int(pair[0]), _as_int(pair[1])))
    sources, dests = [s for s, _ in pairs], [d for _, d in pairs]
    for i in sources + dests:
        if not 0 <= i < ax.size:
            raise ValueError(f"ppermute over axis {ax.key!r} of size {ax.size}: index {i} in "
                             f"perm {pairs} is out of range")
    if len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise ValueError(f"ppermute perm {pairs} repeats a source or a destination")
    return tuple(pairs)


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
    pairs = _check_perm(ax, perm)
    return _run("ppermute", ax, tree, lambda path, x: lambda: _Ppermute.apply(x, ax, pairs),
                perm=pairs)


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
    src = _int_arg("broadcast", ax, "src", src)
    if not 0 <= src < ax.size:
        raise ValueError(f"broadcast over axis {ax.key!r} of size {ax.size}: src {src} is out "
                         f"of range (valid: 0..{ax.size - 1})")
    return _run("broadcast", ax, tree,
                lambda path, x: lambda: _Broadcast.apply(x, ax, src) if ax.size > 1 else x,
                src=src)


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
