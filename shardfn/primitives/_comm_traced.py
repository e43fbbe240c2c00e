"""Flat reduce-scatter and all-gather for code that ``torch.compile`` traces, fast on gloo.

The ZeRO paths traced by ``torch.compile`` (``shard_opt_state``'s buckets,
``shard_params``' compiled leaves) move 1-D tensors with one collective each. On
gloo, torch's ``reduce_scatter_tensor`` is an all-reduce of the whole tensor
(twice the bytes of a reduce-scatter, plus a clone and a copy of the result), and
its ``all_gather_into_tensor`` was slower than an all-to-all of the same bytes in
our 2-rank measurements (docs/benchmarks.md, "Compiled ZeRO steps"). So on a gloo
group these run as one ``all_to_all_single`` each: the reduce-scatter sends block
``j`` to rank ``j`` and sums what arrives in axis order (on 2 ranks the very sum
of the eager piece exchange, ``a + b == b + a`` in IEEE arithmetic); the
all-gather sends this rank's block to every rank. On other backends (NCCL) they
are the plain functional collectives of :mod:`._comm`.

The backend is read once per group at trace time (``assume_constant_result``):
nothing of it is in the graph. Like :mod:`._comm`'s ops they count in
``sf.comm_stats()`` in eager code (the same op names and bytes) and not in traced
code (warned once).

``*_flat_start`` and :func:`wait_flat` split each into the issue and the wait, so a
step can put every issue before the first wait (what lets inductor overlap them with
compute, docs/compile.md "Overlap").

Example:
    >>> mine = psum_scatter_flat(flat, ax)      # flat.numel() == ax.size * k: k summed values
    >>> full = all_gather_flat(mine, ax)        # ax.size * k values, rank order
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from shardfn._torch_internals import c10d_functional as _ops
from shardfn._torch_internals import constant_result, process_groups
from shardfn.primitives import _comm
from shardfn.primitives._comm import Axis

__all__ = ["FlatPending", "all_gather_flat", "all_gather_flat_start", "psum_scatter_flat",
           "psum_scatter_flat_start", "wait_flat"]


@constant_result
def _pairwise(group_name: str, device_type: str) -> bool:
    """Whether the group moves ``device_type`` tensors with gloo (then all-to-all is faster)."""
    group = next(g for g in process_groups() if g.group_name == group_name)
    backend = str(dist.get_backend(group))
    if ":" not in backend:  # one backend for every device
        return backend == "gloo"
    per_device = dict(part.split(":", 1) for part in backend.split(","))
    return per_device.get(device_type) == "gloo"


def _blocks(x: torch.Tensor, ax: Axis) -> list[int]:
    if x.dim() != 1 or x.numel() % ax.size:
        raise ValueError(f"{ax.describe('flat collective')}: needs a 1-D tensor whose size is "
                         f"a multiple of {ax.size}, got shape {tuple(x.shape)}")
    return [x.numel() // ax.size] * ax.size


class FlatPending(NamedTuple):
    """A flat collective issued by a ``*_flat_start`` function; :func:`wait_flat` finishes it.

    Attributes:
        pending: the issued collective (:class:`shardfn.primitives._comm.Pending`).
        blocks: 0, or (an all-to-all reduce-scatter) how many received blocks to add, in
            axis order, after the wait.
    """

    pending: _comm.Pending
    blocks: int


def psum_scatter_flat_start(x: torch.Tensor, ax: Axis) -> FlatPending:
    """Issue :func:`psum_scatter_flat`; :func:`wait_flat` gives this rank's summed block.

    Issue every bucket of a step before waiting for the first one: inductor then runs
    each collective while the compute that does not need its result goes on
    (docs/compile.md, "Overlap").

    Args:
        x: a 1-D tensor of ``ax.size`` equal blocks.
        ax: the axis.

    Returns:
        A :class:`FlatPending`; ``wait_flat(...)`` equals ``psum_scatter_flat(x, ax)``.

    Example:
        >>> issued = [psum_scatter_flat_start(b, ax) for b in buckets]
        >>> mine = [wait_flat(p) for p in issued]
    """
    split = _blocks(x, ax)
    if ax.size == 1 or x.is_complex() or not _pairwise(ax.group_name, x.device.type):
        return FlatPending(_comm.psum_scatter_start(x, ax, 0), 0)
    moved = _comm._issue(ax, "psum_scatter", _comm._nbytes(x) * (ax.size - 1) / ax.size,
                         lambda: _ops.all_to_all_single(x.contiguous(), split, split,
                                                        ax.group_name))
    return FlatPending(_comm.Pending(moved, ax.describe("psum_scatter"), 0, False, False),
                       ax.size)


def all_gather_flat_start(x: torch.Tensor, ax: Axis) -> FlatPending:
    """Issue :func:`all_gather_flat`; :func:`wait_flat` gives every rank's ``x``.

    Args:
        x: this rank's 1-D block (the same size on every rank).
        ax: the axis.

    Returns:
        A :class:`FlatPending`; ``wait_flat(...)`` equals ``all_gather_flat(x, ax)``.

    Example:
        >>> issued = [all_gather_flat_start(u, ax) for u in units]   # all in flight
    """
    if x.dim() != 1:
        raise ValueError(f"{ax.describe('flat all_gather')}: needs a 1-D tensor, got shape "
                         f"{tuple(x.shape)}")
    if ax.size == 1 or x.is_complex() or not _pairwise(ax.group_name, x.device.type):
        return FlatPending(_comm.all_gather_start(x, ax, 0), 0)
    copies = x.expand(ax.size, x.numel()).reshape(-1)  # block j goes to rank j
    split = [x.numel()] * ax.size
    moved = _comm._issue(ax, "all_gather", _comm._nbytes(x) * (ax.size - 1),
                         lambda: _ops.all_to_all_single(copies, split, split, ax.group_name))
    return FlatPending(_comm.Pending(moved, ax.describe("all_gather"), 0, False, False), 0)


def wait_flat(issued: FlatPending) -> torch.Tensor:
    """Wait for a flat collective and finish it (an all-to-all reduce-scatter adds its blocks).

    Args:
        issued: what :func:`psum_scatter_flat_start` or :func:`all_gather_flat_start` gave.

    Returns:
        The collective's 1-D result.

    Example:
        >>> full = wait_flat(all_gather_flat_start(mine, ax))
    """
    got = _comm.wait(issued.pending)
    if issued.blocks <= 1:
        return got
    pieces = got.unflatten(0, (issued.blocks, -1)).unbind(0)
    out = pieces[0]
    for piece in pieces[1:]:  # axis order: on 2 ranks the eager exchange's very sum
        out = out + piece
    return out


def psum_scatter_flat(x: torch.Tensor, ax: Axis) -> torch.Tensor:
    """Block ``ax.index`` of the sum over the axis of every rank's 1-D ``x``.

    Args:
        x: a 1-D tensor of ``ax.size`` equal blocks.
        ax: the axis.

    Returns:
        ``sum over ranks r of x_r[index * k:(index + 1) * k]`` (``k = x.numel() // ax.size``),
        added in axis order.

    Example:
        >>> psum_scatter_flat(torch.arange(4.0), ax)   # on 2 ranks, rank 1: tensor([4., 6.])
    """
    return wait_flat(psum_scatter_flat_start(x, ax))


def all_gather_flat(x: torch.Tensor, ax: Axis) -> torch.Tensor:
    """Every rank's 1-D ``x``, concatenated in axis order.

    Args:
        x: this rank's 1-D block (the same size on every rank).
        ax: the axis.

    Returns:
        A 1-D tensor of ``ax.size * x.numel()`` values.

    Example:
        >>> all_gather_flat(torch.tensor([float(rank)]), ax)   # 2 ranks: tensor([0., 1.])
    """
    return wait_flat(all_gather_flat_start(x, ax))
