"""Single-process reference collectives: what each rank of a mesh would get.

A test computes every rank's input in one process, runs the sharded code on the
local world, and compares each rank's result with these references (and their
autograd gradients with the ones the ranks computed).

Example:
    >>> axis_groups({"a": 2, "b": 2}, "b")
    [[0, 1], [0, 1], [2, 3], [2, 3]]
    >>> ref_psum([torch.tensor(1.0)] * 2, axis_groups({"dp": 2}, "dp"))[0]
    tensor(2.)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "axis_groups",
    "ref_all_gather",
    "ref_all_to_all",
    "ref_broadcast",
    "ref_ppermute",
    "ref_psum",
    "ref_psum_scatter",
]


def axis_groups(shape: Mapping[str, int], axis: str | Sequence[str]) -> list[list[int]]:
    """For every rank of a row-major mesh, the ranks of its slice along ``axis``.

    Args:
        shape: ``axis name -> size`` in mesh order.
        axis: an axis name or several (their product, in mesh order).

    Returns:
        ``groups[r]`` = ranks sharing all coordinates of ``r`` except along ``axis``,
        ordered by their index along ``axis``.
    """
    names = list(shape)
    chosen = {axis} if isinstance(axis, str) else set(axis)
    coords = list(itertools.product(*(range(shape[a]) for a in names)))

    def key(c):
        return tuple(v for a, v in zip(names, c, strict=True) if a not in chosen)

    keys = [key(c) for c in coords]
    return [[s for s in range(len(coords)) if keys[s] == keys[r]] for r in range(len(coords))]


def _index(groups, r):
    return groups[r].index(r)


def ref_psum(xs: Sequence[torch.Tensor], groups) -> list[torch.Tensor]:
    """Per-rank sums over the group."""
    return [sum(xs[s] for s in groups[r]) for r in range(len(xs))]


def ref_all_gather(xs, groups, dim: int) -> list[torch.Tensor]:
    """Per-rank concatenation of the group's tensors along ``dim``."""
    return [torch.cat([xs[s] for s in groups[r]], dim=dim) for r in range(len(xs))]


def ref_psum_scatter(xs, groups, dim: int) -> list[torch.Tensor]:
    """Per-rank block ``index`` of the group sum along ``dim``."""
    sums = ref_psum(xs, groups)
    return [sums[r].chunk(len(groups[r]), dim)[_index(groups, r)] for r in range(len(xs))]


def ref_all_to_all(xs, groups, split_dim: int, concat_dim: int) -> list[torch.Tensor]:
    """Per-rank concatenation of every group member's block ``index``."""
    out = []
    for r in range(len(xs)):
        n, i = len(groups[r]), _index(groups, r)
        out.append(torch.cat([xs[s].chunk(n, split_dim)[i] for s in groups[r]], dim=concat_dim))
    return out


def ref_ppermute(xs, groups, perm) -> list[torch.Tensor]:
    """Per-rank value received along ``perm`` (zeros if none)."""
    out = []
    for r in range(len(xs)):
        srcs = [s for s, d in perm if d == _index(groups, r)]
        out.append(xs[groups[r][srcs[0]]] * 1.0 if srcs else torch.zeros_like(xs[r]))
    return out


def ref_broadcast(xs, groups, src: int) -> list[torch.Tensor]:
    """Per-rank copy of the group's ``src`` tensor."""
    return [xs[groups[r][src]] * 1.0 for r in range(len(xs))]
