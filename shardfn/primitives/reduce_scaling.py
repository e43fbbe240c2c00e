"""Divide before and after a low-precision gradient reduction, as FSDP2 does.

Summing ``N`` fp16 gradients and dividing afterwards overflows when the sum
leaves fp16's range even though the mean fits (two ranks' 40000 is 80000 >
65504). FSDP2 divides by a ``pre`` factor before the reduction and by the rest
after it, ``pre * post == N``, ``pre`` the smallest power of two with
``pre * pre >= N`` that divides ``N`` (or the largest such): the partial sums
stay near the mean's magnitude, and underflow stays as unlikely as overflow.
In float32/float64 one division after the reduction is exact enough.

Example:
    >>> divide_factors(4, torch.float16)
    (2.0, 2.0)
    >>> divide_factors(4, torch.float32)
    (1.0, 4.0)
"""

from __future__ import annotations

import torch

__all__ = ["divide_factors"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def divide_factors(count: int, dtype: torch.dtype) -> tuple[float, float]:
    """``(pre, post)`` divisors for a mean over ``count`` ranks reduced in ``dtype``.

    Args:
        count: the number of ranks whose gradients are summed.
        dtype: the dtype the reduction runs in.

    Returns:
        ``(pre, post)`` with ``pre * post == count``: divide by ``pre`` before the
        sum and by ``post`` after it. ``pre`` is 1 outside fp16/bf16.
    """
    if count < 1:
        raise ValueError(f"divide_factors needs count >= 1, got {count}")
    if dtype not in _LOW_PRECISION:
        return 1.0, float(count)
    pre = 1
    while count % (pre * 2) == 0 and count / pre > pre:
        pre *= 2
    return float(pre), count / pre
