"""Raw (non-differentiable) collectives on plain tensors over one mesh axis.

These call torch's functional collective ops (bound in
:mod:`shardfn._torch_internals`), which are the only ones that run correctly
inside the backward of an ``autograd.Function`` under ``torch.func.grad``
(docs/collectives.md, "Implementation"). Each call records its bytes in
:mod:`shardfn.primitives.stats` and marks itself as in flight for hang reports.

Complex tensors travel as their real view (``torch.view_as_real``: gloo's
all_to_all has no complex type), so every op works on them. The ops take the
shapes they are given: the public collectives validate arguments and run the
check-mode hooks before calling these; nothing here is hooked. In code that
``torch.compile`` traces they only call the ops (no counting, no in-flight
mark: see :mod:`shardfn.primitives._compiled`).

The ``*_start`` functions and :func:`wait` split psum, all_gather and psum_scatter
into the issue and the wait (the one-call ops are the two in a row), for code that
wants compute to run while a collective is in flight: in a compiled step inductor then
issues each collective as soon as its input exists and waits just before the result's
first use (docs/compile.md, "Overlap").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from shardfn._torch_internals import c10d_functional as _ops
from shardfn.mesh import AxisName, Mesh, get_mesh
from shardfn.primitives import _compiled, stats


class Axis(NamedTuple):
    """A resolved mesh axis (or product of axes) as seen from this rank."""

    names: tuple[str, ...]
    size: int
    index: int
    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]

    @property
    def key(self) -> str:
        """Counter key: the axis names joined with '+'."""
        return "+".join(self.names)

    @property
    def group_name(self) -> str:
        return self.group.group_name  # type: ignore[union-attr]

    def describe(self, op: str) -> str:
        return f"{op} over axis {self.key!r} (group ranks {list(self.ranks)})"


def resolve(axis: AxisName, mesh: Mesh | None = None) -> Axis:
    """Resolve ``axis`` against ``mesh`` (or the current mesh).

    Raises:
        ValueError: for an unknown axis or when there is no mesh.
    """
    if not isinstance(axis, (str, tuple, list)):
        raise TypeError(f"axis must be a mesh axis name or a tuple of names, got {axis!r}")
    mesh = get_mesh(mesh)
    names = mesh.axes(axis)
    return Axis(
        names,
        mesh.size(names),
        mesh.index(names),
        mesh.group(names),
        tuple(mesh.group_ranks(names)),
    )


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _issue(ax: Axis, op: str, nbytes: float, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``call()``, counted in the comm stats and marked in flight for hang reports; in code
    that ``torch.compile`` traces only ``call()`` (no Python counters in a graph: the stats
    miss it, said once by a warning)."""
    if not stats.counting():  # traced code
        _compiled.refuse_unsafe_overlap()
        return call()
    stats.record(ax.key, op, nbytes)
    with stats.collective_scope(ax.describe(op)):
        return call()


def _complex_as_real(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Run ``op`` on the real view of a complex ``x`` (one trailing dim of 2) and view back.

    The dims the ops take index from the front, so they mean the same on the view.
    """

    @functools.wraps(op)
    def wrapper(x: torch.Tensor, *args):
        if not x.is_complex():
            return op(x, *args)
        return torch.view_as_complex(op(torch.view_as_real(x), *args).contiguous())

    return wrapper


def psum(x: torch.Tensor, ax: Axis) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``ax`` (:func:`psum_start`, then :func:`wait`)."""
    return wait(psum_start(x, ax))


def all_gather(x: torch.Tensor, ax: Axis, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in axis-index order (row-major, as
    ``torch.cat`` gives; :func:`all_gather_start`, then :func:`wait`)."""
    return wait(all_gather_start(x, ax, dim))


def _check_scatter_dim(x: torch.Tensor, ax: Axis, dim: int) -> None:
    """Refuse a psum_scatter whose ``dim`` the axis does not divide."""
    if x.shape[dim] % ax.size:
        raise ValueError(
            f"psum_scatter over axis {ax.key!r} needs dim {dim} (size {x.shape[dim]}) "
            f"divisible by the axis size {ax.size}; pad it first (sf.shard pads for you)"
        )


def psum_scatter(x: torch.Tensor, ax: Axis, dim: int) -> torch.Tensor:
    """Sum ``x`` over the axis and keep this rank's block of ``dim``
    (:func:`psum_scatter_start`, then :func:`wait`)."""
    return wait(psum_scatter_start(x, ax, dim))


@_complex_as_real
def all_to_all(x: torch.Tensor, ax: Axis, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Send block j of ``split_dim`` to rank j; concatenate what arrives on ``concat_dim``."""
    if x.shape[split_dim] % ax.size:
        raise ValueError(
            f"all_to_all over axis {ax.key!r} needs split dim {split_dim} (size "
            f"{x.shape[split_dim]}) divisible by the axis size {ax.size}"
        )
    if ax.size == 1:
        return x.clone()
    moved = x.movedim(split_dim, 0).contiguous()
    block = moved.shape[0] // ax.size
    out = _issue(ax, "all_to_all", _nbytes(x) * (ax.size - 1) / ax.size,
                 lambda: _ops.wait_tensor(_ops.all_to_all_single(
                     moved, [block] * ax.size, [block] * ax.size, ax.group_name)))
    # unflatten, not split(block): a zero-size block must still give ax.size pieces
    pieces = [piece.movedim(0, split_dim) for piece in out.unflatten(0, (ax.size, block))]
    return torch.cat(pieces, dim=concat_dim)


@_complex_as_real
def ppermute(x: torch.Tensor, ax: Axis, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Send ``x`` from axis index ``src`` to ``dst`` for each pair; zeros where nothing arrives."""
    sends_to = [dst for src, dst in perm if src == ax.index]
    receives_from = [src for src, dst in perm if dst == ax.index]
    if ax.size == 1:
        return x.clone() if sends_to else torch.zeros_like(x)
    rows = x.reshape(1, -1).expand(len(sends_to), -1).contiguous()
    in_splits = [1 if j in sends_to else 0 for j in range(ax.size)]
    out_splits = [1 if j in receives_from else 0 for j in range(ax.size)]
    out = _issue(ax, "ppermute", _nbytes(x) * len(sends_to),
                 lambda: _ops.wait_tensor(_ops.all_to_all_single(rows, out_splits, in_splits,
                                                                 ax.group_name)))
    if not receives_from:
        return torch.zeros_like(x)
    return out.reshape(x.shape)


@_complex_as_real
def broadcast(x: torch.Tensor, ax: Axis, src: int) -> torch.Tensor:
    """Every rank gets the ``x`` of axis index ``src``."""
    if ax.size == 1:
        return x.clone()
    return _issue(ax, "broadcast", _nbytes(x) * (ax.size - 1) / ax.size,
                  lambda: _ops.wait_tensor(_ops.broadcast(x.contiguous(), src, ax.group_name)))


# ---- split collectives: issue now, wait where the result is used ------------------------


class Pending(NamedTuple):
    """A collective issued by a ``*_start`` function and not yet waited for.

    ``tensor`` is the functional op's output: the collective may still be writing it,
    so read it only through :func:`wait`. In code that ``torch.compile`` traces the
    issue and the wait are separate graph nodes, and inductor's scheduler places each
    where its inputs and users are: the issue as soon as the input exists, the wait
    just before the first use, with the compute in between running while the
    collective is in flight (see docs/compile.md, "Overlap").
    """

    tensor: torch.Tensor
    what: str          # the collective and its axis, for hang reports
    dim: int           # where the op's dim 0 goes back to after the wait
    was_complex: bool  # view the result back as complex
    done: bool         # nothing in flight (an axis of size 1): ``tensor`` is the result


def _start(x: torch.Tensor, ax: Axis, op: str, nbytes: float, dim: int,
           call: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
    was_complex = x.is_complex()
    real = torch.view_as_real(x) if was_complex else x
    moved = real.movedim(dim, 0).contiguous()
    return Pending(_issue(ax, op, nbytes, lambda: call(moved)), ax.describe(op), dim,
                   was_complex, False)


def psum_start(x: torch.Tensor, ax: Axis) -> Pending:
    """Issue :func:`psum` of ``x`` over ``ax``; :func:`wait` gives the sum.

    Args:
        x: this rank's tensor.
        ax: the resolved axis.

    Returns:
        A :class:`Pending`; ``wait(...)`` gives the sum over the axis.

    Example:
        >>> issued = [psum_start(flat, ax) for flat in buckets]   # all in flight
        >>> sums = [wait(p) for p in issued]
    """
    if ax.size == 1:
        return Pending(x.clone(), "", 0, False, True)
    return _start(x, ax, "psum", 2 * _nbytes(x) * (ax.size - 1) / ax.size, 0,
                  lambda t: _ops.all_reduce(t, "sum", ax.group_name))


def all_gather_start(x: torch.Tensor, ax: Axis, dim: int) -> Pending:
    """Issue :func:`all_gather` of ``x`` along ``dim``; :func:`wait` gives the result.

    Args:
        x: this rank's block.
        ax: the resolved axis.
        dim: the dim to concatenate the ranks' blocks on.

    Returns:
        A :class:`Pending`; ``wait(...)`` gives every rank's block along ``dim``.

    Example:
        >>> next_unit = all_gather_start(shard, ax, 0)   # before this unit's compute
    """
    if ax.size == 1:
        return Pending(x.clone(), "", 0, False, True)
    return _start(x, ax, "all_gather", _nbytes(x) * (ax.size - 1), dim,
                  lambda t: _ops.all_gather_into_tensor(t, ax.size, ax.group_name))


def psum_scatter_start(x: torch.Tensor, ax: Axis, dim: int) -> Pending:
    """Issue :func:`psum_scatter` of ``x`` on ``dim``; :func:`wait` gives this rank's block.

    Args:
        x: this rank's tensor (``dim`` divisible by the axis size).
        ax: the resolved axis.
        dim: the dim to scatter.

    Returns:
        A :class:`Pending`; ``wait(...)`` gives this rank's block of the sum.

    Raises:
        ValueError: when ``dim`` is not divisible by the axis size.

    Example:
        >>> grad_shard = wait(psum_scatter_start(full_grad, ax, 0))
    """
    _check_scatter_dim(x, ax, dim)
    if ax.size == 1:
        return Pending(x.clone(), "", 0, False, True)
    return _start(x, ax, "psum_scatter", _nbytes(x) * (ax.size - 1) / ax.size, dim,
                  lambda t: _ops.reduce_scatter_tensor(t, "sum", ax.size, ax.group_name))


def wait(pending: Pending) -> torch.Tensor:
    """Wait for an issued collective and return its result.

    In eager code the wait is marked in flight for hang reports; in traced code it is
    only the ``wait_tensor`` node, which inductor places before the result's first use.

    Args:
        pending: what a ``*_start`` function returned.

    Returns:
        The collective's result, as the one-call collective gives it.

    Example:
        >>> total = wait(psum_start(x, ax))
    """
    if pending.done:
        return pending.tensor
    if stats.counting():
        with stats.collective_scope(pending.what):
            out = _ops.wait_tensor(pending.tensor)
    else:
        out = _ops.wait_tensor(pending.tensor)
    if pending.dim:
        out = out.movedim(0, pending.dim).contiguous()
    return torch.view_as_complex(out.contiguous()) if pending.was_complex else out
