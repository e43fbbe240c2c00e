"""Argument checks of the public collectives: clear errors before anything is sent.

Static arguments (``dim``, ``src``, ``perm`` indices) accept any integer
(numpy, 0-dim tensors) and come back as Python ints; bools and floats are a
TypeError naming the argument.

Example:
    >>> int_arg("broadcast", ax, "src", numpy.int64(1))
    1
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch

from shardfn.primitives._comm import Axis

__all__ = ["as_int", "check_divisible", "check_mean", "check_perm", "dim_arg", "int_arg",
           "summable"]


def as_int(value: Any) -> int | None:
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


def int_arg(op: str, ax: Axis, name: str, value: Any) -> int:
    """A static int argument (``dim``, ``src``, ...) as a Python int, or a TypeError naming it."""
    number = as_int(value)
    if number is None:
        raise TypeError(f"{op} over axis {ax.key!r}: {name} must be an int, got {value!r}")
    return number


def dim_arg(op: str, ax: Axis, path: str, x: torch.Tensor, dim: int,
            ndim: int | None = None) -> int:
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


def summable(x: torch.Tensor) -> torch.Tensor:
    """Bool leaves are summed as counts (int64, like ``torch.sum``); other dtypes as they are."""
    return x.to(torch.int64) if x.dtype == torch.bool else x


def check_divisible(op: str, ax: Axis, path: str, x: torch.Tensor, dim: int) -> None:
    if x.shape[dim] % ax.size:
        raise ValueError(f"{op} over axis {ax.key!r}: leaf {path!r} needs dim {dim} (size "
                         f"{x.shape[dim]} of shape {tuple(x.shape)}) divisible by the axis size "
                         f"{ax.size}; pad it first (sf.shard pads for you)")


def check_mean(op: str, ax: Axis, path: str, x: torch.Tensor) -> None:
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{op} over axis {ax.key!r}: leaf {path!r} has dtype {x.dtype}; the mean "
                        "of integers is not an integer. Cast it first (x.float()) or use psum "
                        "and divide as you mean to")


def check_perm(ax: Axis, perm) -> tuple[tuple[int, int], ...]:
    """``perm`` as a tuple of int pairs, each source and destination in range and at most once."""
    if not isinstance(perm, Iterable) or isinstance(perm, (str, bytes, torch.Tensor)):
        raise TypeError(f"ppermute over axis {ax.key!r}: perm is a sequence of (src, dst) pairs, "
                        f"got {perm!r}")
    pairs = []
    for pair in perm:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or any(as_int(i) is None for i in pair)):
            raise TypeError(f"ppermute over axis {ax.key!r}: perm entries are (src, dst) pairs "
                            f"of ints, got {pair!r} in {perm!r}")
        pairs.append((as_int(pair[0]), as_int(pair[1])))
    sources, dests = [s for s, _ in pairs], [d for _, d in pairs]
    for i in sources + dests:
        if not 0 <= i < ax.size:
            raise ValueError(f"ppermute over axis {ax.key!r} of size {ax.size}: index {i} in "
                             f"perm {pairs} is out of range")
    if len(set(sources)) != len(sources) or len(set(dests)) != len(dests):
        raise ValueError(f"ppermute perm {pairs} repeats a source or a destination")
    return tuple(pairs)
