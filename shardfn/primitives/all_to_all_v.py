"""A differentiable all-to-all with variable split sizes (rows per rank), for expert dispatch.

``sf.all_to_all`` cuts a dim into equal blocks. Expert parallelism sends a different
number of token rows to each rank (as many as the router gave the experts that rank
holds), so this op takes the sizes: rank ``i`` sends rows ``in_splits[j]`` of its dim 0 to
rank ``j`` and receives ``out_splits[j]`` rows from rank ``j``, concatenated in axis-index
order. The sizes must agree across ranks (``out_splits`` of rank ``i`` at ``j`` is
``in_splits`` of rank ``j`` at ``i``): exchange the counts first (an ``sf.all_to_all`` of
the count vector), as :mod:`shardfn.models.moe_dispatch` does.

Its transpose is the same op with the two size lists swapped (the rows go back where they
came from), so the gradient follows JAX's rule for ``all_to_all``. The
``autograd.Function`` is written in the ``forward`` + ``setup_context`` style over the
functional ``all_to_all_single`` op (as every collective of
:mod:`shardfn.primitives._functions`), so it runs under ``torch.autograd``,
``torch.func.grad``/``vjp`` and ``vmap`` (the batch dim is moved behind the rows).

Bytes counted in :mod:`shardfn.primitives.stats` under ``"all_to_all_v"``: the rows this
rank sends to *other* ranks (its own block stays), ``sum_{j != i} in_splits[j] * row_bytes``.

Example (rank 0 of 2 keeps 1 row and sends 2; rank 1 sends 1 row and keeps 0):
    >>> with sf.Mesh({"ep": 2}):
    ...     y = all_to_all_v(x, "ep", in_splits=[1, 2], out_splits=[1, 1])   # on rank 0
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shardfn._torch_internals import c10d_functional as _ops
from shardfn.mesh import AxisName, Mesh
from shardfn.primitives import _comm
from shardfn.primitives._comm import Axis
from shardfn.primitives._functions import _Collective

__all__ = ["AllToAllV", "all_to_all_v"]


def _exchange(x: torch.Tensor, ax: Axis, in_splits: tuple[int, ...],
              out_splits: tuple[int, ...]) -> torch.Tensor:
    """The raw exchange of dim 0 (no autograd), counted in the comm stats."""
    if ax.size == 1:
        return x.clone()
    rows = x.contiguous()
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    sent = sum(n for j, n in enumerate(in_splits) if j != ax.index) * row_bytes
    return _comm._issue(ax, "all_to_all_v", sent, lambda: _ops.wait_tensor(
        _ops.all_to_all_single(rows, list(out_splits), list(in_splits), ax.group_name)))


class AllToAllV(_Collective):
    """Variable-split all_to_all of dim 0; backward: the same with the splits swapped."""

    @staticmethod
    def forward(x, ax: Axis, in_splits: tuple[int, ...], out_splits: tuple[int, ...]):
        return _exchange(x, ax, in_splits, out_splits)

    @staticmethod
    def backward(ctx, grad):
        ax, in_splits, out_splits = ctx.args
        return AllToAllV.apply(grad.contiguous(), ax, out_splits, in_splits), None, None, None

    @classmethod
    def vmap(cls, info, in_dims, x, ax, in_splits, out_splits):
        bdim = in_dims[0]
        if bdim is None:
            return cls.apply(x, ax, in_splits, out_splits), None
        return cls.apply(x.movedim(bdim, 1), ax, in_splits, out_splits), 1


def _splits(name: str, splits: Sequence[int], ax: Axis) -> tuple[int, ...]:
    values = tuple(int(s) for s in splits)
    if len(values) != ax.size or any(s < 0 for s in values):
        raise ValueError(f"all_to_all_v over axis {ax.key!r}: {name} must hold {ax.size} "
                         f"non-negative row counts (one per rank), got {list(values)}")
    return values


def all_to_all_v(x: torch.Tensor, axis: AxisName, in_splits: Sequence[int],
                 out_splits: Sequence[int], *, mesh: Mesh | None = None) -> torch.Tensor:
    """Send rows ``in_splits[j]`` of dim 0 to rank ``j``; receive ``out_splits[j]`` from rank ``j``.

    Differentiable (backward: the rows' gradients travel back, splits swapped) under
    autograd and ``torch.func``. Every rank of the axis must call it, with sizes that
    agree across ranks (exchange counts first).

    Args:
        x: a tensor of at least one dim whose dim 0 has ``sum(in_splits)`` rows.
        axis: a mesh axis name or a tuple of names.
        in_splits: rows sent to each rank of the axis, in axis-index order.
        out_splits: rows received from each rank, in axis-index order.
        mesh: overrides the current mesh.

    Returns:
        A tensor of ``sum(out_splits)`` rows (the blocks from rank 0, 1, ...), the other
        dims as ``x``'s.

    Raises:
        ValueError: ``x`` is 0-dim, a split list has the wrong length or a negative entry,
            or ``sum(in_splits)`` is not ``x.shape[0]`` (the message names the axis).

    Example:
        >>> rows = all_to_all_v(tokens_by_rank, "ep", send_counts, receive_counts)
    """
    ax = _comm.resolve(axis, mesh)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"all_to_all_v over axis {ax.key!r} needs a tensor of at least one "
                         f"dim, got {type(x).__name__} {getattr(x, 'shape', '')}")
    sends, receives = _splits("in_splits", in_splits, ax), _splits("out_splits", out_splits, ax)
    if sum(sends) != x.shape[0]:
        raise ValueError(f"all_to_all_v over axis {ax.key!r}: in_splits {list(sends)} sum to "
                         f"{sum(sends)}, but x has {x.shape[0]} rows in dim 0")
    if ax.size == 1:
        if receives != sends:
            raise ValueError(f"all_to_all_v over axis {ax.key!r} of one rank: out_splits "
                             f"{list(receives)} must equal in_splits {list(sends)}")
        return x
    return AllToAllV.apply(x, ax, sends, receives)
