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

Example:
    >>> mine = psum_scatter_flat(flat, ax)      # flat.numel() == ax.size * k: k summed values
    >>> full = all_gather_flat(mine, ax)        # ax.size * k values, rank order
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfn._torch_internals import c10d_functional as _ops
from shardfn._torch_internals import constant_result, process_groups
from shardfn.primitives import _comm
from shardfn.primitives._comm import Axis

__all__ = ["all_gather_flat", "psum_scatter_flat"]


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
    split = _blocks(x, ax)
    if ax.size == 1 or x.is_complex() or not _pairwise(ax.group_name, x.device.type):
        return _comm.psum_scatter(x, ax, 0)
    got = _comm._issue(ax, "psum_scatter", _comm._nbytes(x) * (ax.size - 1) / ax.size,
                       lambda: _ops.wait_tensor(_ops.all_to_all_single(
                           x.contiguous(), split, split, ax.group_name)))
    pieces = got.unflatten(0, (ax.size, split[0])).unbind(0)
    out = pieces[0]
    for piece in pieces[1:]:
        out = out + piece
    return out


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
    if x.dim() != 1:
        raise ValueError(f"{ax.describe('flat all_gather')}: needs a 1-D tensor, got shape "
                         f"{tuple(x.shape)}")
    if ax.size == 1 or x.is_complex() or not _pairwise(ax.group_name, x.device.type):
        return _comm.all_gather(x, ax, 0)
    copies = x.expand(ax.size, x.numel()).reshape(-1)  # block j goes to rank j
    split = [x.numel()] * ax.size
    return _comm._issue(ax, "all_gather", _comm._nbytes(x) * (ax.size - 1),
                        lambda: _ops.wait_tensor(_ops.all_to_all_single(
                            copies, split, split, ax.group_name)))
