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

Both declare values replicated (JAX: invariant) over the axis: ``pvary``'s input,
``psum_invariant``/``pmean_invariant``'s output and the gradient reaching that output.
In check mode each is verified equal on every rank (up to rounding), which catches
per-rank inputs and a forgotten ``pvary`` after a ``psum_invariant``; ``psum``/``pmean``
outputs are equal in value too but varying in their gradient rule, and are not checked
(:mod:`shardfn.primitives.declared`, docs/check_mode.md).

Every function works under ``torch.autograd``, ``torch.func.grad``,
``grad_and_value``, ``vjp``, ``vmap`` and their compositions (``vmap(grad)``,
``grad(vmap)``, ``jacrev``, double backward, ``jvp``/``jacfwd``/``hessian``):
each is an ``autograd.Function`` in the ``forward`` + ``setup_context`` style
calling the functional collective ops (:mod:`shardfn.primitives._functions`),
whose backward applies the transposed Function (so under vmap the backward,
too, is one collective on the batched tensor); under ``torch.compile`` they trace
into the graph (a twin of each Function without ``jvp``, which dynamo refuses).
Leaves may be floating, complex,
integer or bool (bools are summed as int64 counts; a mean of integers is
refused). Each public call validates every leaf
(:mod:`shardfn.primitives._collective_args`), then calls
:func:`shardfn.primitives.consistency.check_call` once (axes of more than one
rank), then communicates. See docs/collectives.md.

Example (on each rank of a 2-rank world):
    >>> mesh = sf.Mesh({"dp": 2})
    >>> with mesh:
    ...     total = sf.psum(torch.ones(3), "dp")   # tensor([2., 2., 2.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardfn import pytree
from shardfn.mesh import AxisName, Mesh, get_mesh
from shardfn.primitives import _comm, consistency
from shardfn.primitives._collective_args import (
    check_divisible,
    check_mean,
    check_perm,
    dim_arg,
    int_arg,
    summable,
)
from shardfn.primitives._comm import Axis
from shardfn.primitives._compiled import tracing
from shardfn.primitives._functions import (
    traceable,
)
from shardfn.primitives.declared import output_hint, pvary_hint
from shardfn.primitives.reduce_scaling import divide_factors

__all__ = ["all_gather", "all_to_all", "axis_index", "axis_size", "broadcast", "pmean",
           "pmean_invariant", "ppermute", "psum", "psum_invariant", "psum_scatter", "pvary"]


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
        if tracing():  # dynamo drops a Function's backward applied straight to a torch.func input
            x = x.view_as(x)
        work.append(prepare(path, x))
    return pytree.tree_unflatten(treedef, [run() for run in work])


def _declared_output(op: str, ax: Axis, out):
    """``out``, after check mode verified it is the same on every rank (it is declared so)."""
    if consistency.enabled() and ax.size > 1:
        consistency.check_replicated(f"{op} output", ax, out, output_hint(op, ax), rounding=True)
    return out


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
        x = summable(x)
        return lambda: traceable("Psum").apply(x, ax, True, "psum") if ax.size > 1 else x

    return _run("psum", ax, tree, prepare)


def _mean(x: torch.Tensor, ax: Axis, grad_psum: bool, op: str) -> torch.Tensor:
    """Sum over the axis divided by its size; in fp16/bf16 part of the division comes first
    (FSDP2's factors), so a mean that fits the dtype does not overflow in the sum."""
    pre, post = divide_factors(ax.size, x.dtype)
    if pre != 1:
        x = x / pre
    return traceable("Psum").apply(x, ax, grad_psum, op) / post


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
    return _mean_over("pmean", tree, axis, mesh, grad_psum=True)


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

    Raises:
        ConsistencyError: in check mode, when the sums differ across the axis, or in
            backward when the gradient reaching them does (the result fed per-rank
            computation: a forgotten ``pvary``, or a loss that differs per rank).

    Example:
        >>> y = sf.psum_invariant(x @ w_row_shard, "tp")   # row-parallel linear
    """
    ax = _comm.resolve(axis, mesh)

    def prepare(path, x):
        x = summable(x)
        return lambda: traceable("Psum").apply(x, ax, False, "psum_invariant") if ax.size > 1 else x

    return _declared_output("psum_invariant", ax, _run("psum_invariant", ax, tree, prepare))


def pmean_invariant(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Mean over ``axis`` whose backward is the identity divided by the axis size.

    The loss every rank then computes is counted once: its gradient reaches each rank's
    local value divided by the axis size, not summed. Arguments and dtypes as in
    :func:`pmean`; check mode verifies the result and its gradient as for
    :func:`psum_invariant`.

    Example:
        >>> loss = sf.pmean_invariant(local_loss, "dp")
    """
    return _mean_over("pmean_invariant", tree, axis, mesh, grad_psum=False)


def _mean_over(op: str, tree, axis: AxisName, mesh: Mesh | None, grad_psum: bool):
    """pmean (``grad_psum``: the varying rule) or pmean_invariant of every leaf."""
    ax = _comm.resolve(axis, mesh)

    def prepare(path, x):
        check_mean(op, ax, path, x)
        return lambda: _mean(x, ax, grad_psum, op) if ax.size > 1 else x

    out = _run(op, ax, tree, prepare)
    return out if grad_psum else _declared_output(op, ax, out)


def pvary(tree, axis: AxisName, *, mesh: Mesh | None = None):
    """Identity forward, psum backward (Megatron ``f``): a replicated value entering per-rank work.

    Args:
        tree: a tensor or pytree of tensors, replicated over ``axis``.
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.

    Returns:
        The same values.

    Raises:
        ConsistencyError: in check mode, on every rank, when ``tree`` differs across the
            axis beyond rounding (it is already varying: drop pvary, or pass the same
            value on every rank).

    Example:
        >>> h = sf.pvary(x, "tp") @ w_column_shard   # column-parallel linear
    """
    ax = _comm.resolve(axis, mesh)
    out = _run("pvary", ax, tree,
               lambda path, x: lambda: traceable("Pvary").apply(x, ax) if ax.size > 1 else x)
    if consistency.enabled() and ax.size > 1:
        consistency.check_replicated("pvary input", ax, tree, pvary_hint(ax), rounding=True)
    return out


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
    dim = int_arg("all_gather", ax, "dim", dim)

    def prepare(path, x):
        if tiled and x.dim() == 0:
            raise ValueError(f"all_gather over axis {ax.key!r}: leaf {path!r} is a 0-dim tensor "
                             "and tiled=True has no dim to concatenate; use tiled=False to stack")
        d = dim_arg("all_gather", ax, path, x, dim, x.dim() + (0 if tiled else 1))

        def run():
            y = x if tiled else x.unsqueeze(d)
            return traceable("AllGather").apply(y, ax, d) if ax.size > 1 else y

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
    dim = int_arg("psum_scatter", ax, "dim", dim)

    def prepare(path, x):
        d = dim_arg("psum_scatter", ax, path, x, dim)
        if not tiled and x.shape[d] != ax.size:
            raise ValueError(f"psum_scatter(tiled=False) over axis {ax.key!r}: leaf {path!r} "
                             f"needs dim {d} of size {ax.size}, got shape {tuple(x.shape)}")
        check_divisible("psum_scatter", ax, path, x, d)
        x = summable(x)

        def run():
            out = traceable("PsumScatter").apply(x, ax, d) if ax.size > 1 else x
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
    split_dim = int_arg("all_to_all", ax, "split_dim", split_dim)
    concat_dim = int_arg("all_to_all", ax, "concat_dim", concat_dim)

    def prepare(path, x):
        s = dim_arg("all_to_all", ax, path, x, split_dim)
        c = dim_arg("all_to_all", ax, path, x, concat_dim)
        check_divisible("all_to_all", ax, path, x, s)
        return lambda: traceable("AllToAll").apply(x, ax, s, c) if ax.size > 1 else x

    return _run("all_to_all", ax, tree, prepare, split_dim=split_dim, concat_dim=concat_dim)


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
    pairs = check_perm(ax, perm)
    return _run("ppermute", ax, tree,
                lambda path, x: lambda: traceable("Ppermute").apply(x, ax, pairs), perm=pairs)


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
    src = int_arg("broadcast", ax, "src", src)
    if not 0 <= src < ax.size:
        raise ValueError(f"broadcast over axis {ax.key!r} of size {ax.size}: src {src} is out "
                         f"of range (valid: 0..{ax.size - 1})")
    return _run("broadcast", ax, tree, lambda path, x: lambda: traceable("Broadcast").apply(
        x, ax, src) if ax.size > 1 else x, src=src)


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
