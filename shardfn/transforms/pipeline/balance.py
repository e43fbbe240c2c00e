"""Split a model's units into contiguous pipeline stages: explicit, by parameters or by time.

``balance_units(units, n_stages, by)`` returns how many consecutive units each stage
gets (the form ``pipeline_stages(balance=...)`` takes):

* ``by=[2, 1, 1]``: checked (one count per stage, each >= 1, covering every unit);
* ``by="params"``: each unit costs its parameter count; the partition minimises the
  largest stage's count (FairScale's ``balance_by_size`` without the activation term);
* ``by="time"``: each unit costs its measured forward + backward time on a sample
  input (FairScale's ``balance_by_time``); the same partition of the costs.

The partition (:func:`partition`) is exact and deterministic: first the smallest
possible maximum stage cost (dynamic programme over split points), then, among the
partitions reaching it, the one with the smallest sum of squared stage costs, and
among those the earliest split points (the last split first: a zero-cost unit on a
boundary goes to the later stage). ``costs=`` replaces the measurement (tests,
or costs the caller knows).

Example:
    >>> partition([4, 1, 1, 1, 1, 4], 3)
    (1, 4, 1)
    >>> import torch.nn as nn
    >>> balance_units([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 64), nn.Linear(64, 8)], 2, "params")
    (3, 1)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
import torch.nn as nn

__all__ = ["BalanceBy", "balance_units", "measure_unit_times", "partition",
           "unit_param_counts"]

#: ``balance=`` by name: split the units by parameter count or by measured time
BalanceBy = Literal["params", "time"]
_BY: tuple[BalanceBy, ...] = get_args(BalanceBy)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def partition(costs: Sequence[float], n_stages: int) -> tuple[int, ...]:
    """Contiguous split of ``costs`` into ``n_stages`` non-empty groups, minimising the
    largest group's sum (ties: smallest sum of squares, then earliest splits).

    Args:
        costs: one non-negative cost per unit.
        n_stages: groups (``1 <= n_stages <= len(costs)``).

    Returns:
        Units per stage, summing to ``len(costs)``.

    Raises:
        ValueError: a negative or non-finite cost, or ``n_stages`` out of range.

    Example:
        >>> partition([1, 2, 3, 4], 2)
        (3, 1)
    """
    costs = [float(c) for c in costs]
    bad = [i for i, c in enumerate(costs) if not (c >= 0 and c != float("inf"))]
    if bad:
        raise ValueError(f"balance: unit {bad[0]} has cost {costs[bad[0]]}; costs must be "
                         "finite and >= 0")
    n = len(costs)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or not 1 <= n_stages <= n:
        raise ValueError(f"balance: n_stages={n_stages!r} must be an int in 1..{n} (each "
                         f"stage gets at least one of the {n} units)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(j: int, i: int) -> float:
        return prefix[i] - prefix[j]

    # best_max[k][i]: smallest max over k groups of the first i units
    inf = float("inf")
    best_max = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    best_max[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            best_max[k][i] = min(max(best_max[k - 1][j], cost(j, i)) for j in range(k - 1, i))
    limit = best_max[n_stages][n]
    # among partitions whose every group is <= limit: least sum of squares, earliest splits
    squares = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(n_stages + 1)]
    squares[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                group = cost(j, i)
                if squares[k - 1][j] == inf or (group > limit and not _close(group, limit)):
                    continue
                total = squares[k - 1][j] + group * group
                if squares[k][i] == inf or (total < squares[k][i]
                                            and not _close(total, squares[k][i])):
                    squares[k][i], choice[k][i] = total, j
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        j = choice[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def _as_units(units: Any) -> list[nn.Module]:
    listed = list(units.children()) if isinstance(units, nn.Sequential) else list(units)
    for i, unit in enumerate(listed):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"balance: unit {i} is a {type(unit).__name__}, not an nn.Module "
                            "(pass an nn.Sequential or a list of modules)")
    return listed


def unit_param_counts(units: Any) -> list[int]:
    """Parameters (elements) per unit; a parameter shared by two units counts in both.

    Example:
        >>> unit_param_counts([nn.Linear(2, 3), nn.ReLU()])
        [9, 0]
    """
    return [sum(p.numel() for p in unit.parameters()) for unit in _as_units(units)]


def measure_unit_times(units: Any, sample: Any, repeats: int = 3) -> list[float]:
    """Median seconds of each unit's forward + backward, the units run in order on ``sample``.

    Each unit gets the previous unit's (detached) output; its backward is the gradient
    of ``output.sum()`` with respect to its trainable parameters and floating input, by
    ``torch.autograd.grad`` (no ``.grad`` is written). The model is not changed: its
    buffers (BatchNorm statistics, ``num_batches_tracked``) are restored afterwards and
    the passes draw from a forked random state (dropout leaves the caller's stream alone).

    Args:
        units: an ``nn.Sequential`` or a list of modules.
        sample: the first unit's input (one micro-batch is representative).
        repeats: timed passes (>= 1); the median is kept.

    Returns:
        One time per unit, in seconds.

    Raises:
        TypeError: a unit that does not return one tensor.
    """
    listed = _as_units(units)
    if repeats < 1:
        raise ValueError(f"balance: repeats={repeats} must be >= 1")
    kept = _snapshot(listed)  # the passes update BatchNorm statistics and draw random numbers
    devices = sorted({t.device.index or 0 for t in _tensors(listed, sample) if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        try:
            return _timed_passes(listed, sample, repeats)
        finally:
            _restore(kept)


def _tensors(units: list[nn.Module], sample: Any) -> list[torch.Tensor]:
    found = [t for unit in units for t in (*unit.parameters(), *unit.buffers())]
    return found + ([sample] if isinstance(sample, torch.Tensor) else [])


def _snapshot(units: list[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every buffer of the units with a copy of its value (running statistics, counters)."""
    seen: set[int] = set()
    kept = []
    for unit in units:
        for buffer in unit.buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                kept.append((buffer, buffer.detach().clone()))
    return kept


def _restore(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in kept:
            buffer.copy_(value)


def _timed_passes(listed: list[nn.Module], sample: Any, repeats: int) -> list[float]:
    samples: list[list[float]] = [[] for _ in listed]
    for _ in range(repeats + 1):  # the first pass warms up and is not kept
        x = sample
        for i, unit in enumerate(listed):
            floating = isinstance(x, torch.Tensor) and x.is_floating_point()
            x_in = x.detach().clone().requires_grad_(True) if floating else x  # sample kept
            start = time.perf_counter()
            with torch.enable_grad():
                out = _run_unit(unit, i, x_in)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"balance by='time': unit {i} ({type(unit).__name__}) "
                                    f"returned a {type(out).__name__}; each unit must return "
                                    "one tensor (the next unit's input)")
                wrt = ([x_in] if floating else []) + [p for p in unit.parameters()
                                                      if p.requires_grad]
                if wrt and out.requires_grad:
                    torch.autograd.grad(out.float().sum(), wrt, allow_unused=True)
            samples[i].append(time.perf_counter() - start)
            x = out.detach()
    return [statistics.median(s[1:]) for s in samples]


def _run_unit(unit: nn.Module, i: int, x: Any) -> Any:
    try:
        return unit(x)
    except Exception as error:  # noqa: BLE001 - re-raised with what was being measured
        raise ValueError(f"balance='time': unit {i} ({type(unit).__name__}) failed on the "
                         f"input it got while timing the units ({type(error).__name__}: "
                         f"{error}); sample= must be an input of the first unit (one "
                         "micro-batch), or pass a list of unit counts") from error


def _check_explicit(balance: Sequence[Any], n_stages: int, n_units: int) -> tuple[int, ...]:
    counts = list(balance)
    if len(counts) != n_stages:
        raise ValueError(f"balance {counts} has {len(counts)} entries for {n_stages} stages "
                         "(give one unit count per stage)")
    for stage, count in enumerate(counts):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"balance {counts}: stage {stage} gets {count!r} units; each "
                             "stage needs an int >= 1")
    if sum(counts) != n_units:
        raise ValueError(f"balance {counts} covers {sum(counts)} units but the model has "
                         f"{n_units} (units {sum(counts)}..{n_units - 1} would have no stage)"
                         if sum(counts) < n_units else
                         f"balance {counts} covers {sum(counts)} units but the model has "
                         f"only {n_units}")
    return tuple(counts)


def balance_units(units: Any, n_stages: int, by: Sequence[int] | BalanceBy, *, sample: Any = None,
                  costs: Sequence[float] | None = None, repeats: int = 3) -> tuple[int, ...]:
    """Units per pipeline stage: an explicit list checked, or a partition by cost.

    Args:
        units: an ``nn.Sequential`` or a list of modules (the pipeline's units, in order).
        n_stages: stages (all ranks' virtual stages).
        by: a list of unit counts per stage, ``"params"`` or ``"time"``.
        sample: ``by="time"``: the first unit's input (one micro-batch).
        costs: one cost per unit, used instead of counting or measuring.
        repeats: ``by="time"``: timed passes per unit.

    Returns:
        Units per stage, consecutive, summing to ``len(units)``.

    Raises:
        ValueError: a list of the wrong length, a count below 1, counts that do not cover
            every unit, an unknown ``by``, ``"time"`` without a sample, or ``costs`` of
            the wrong length.

    Example:
        >>> balance_units([nn.Linear(4, 4)] * 4, 2, "time", costs=[1.0, 3.0, 1.0, 1.0])
        (2, 2)
    """
    listed = _as_units(units)
    if not isinstance(by, str):
        return _check_explicit(by, n_stages, len(listed))
    if by not in _BY:
        raise ValueError(f"balance={by!r}: give a list of unit counts per stage or one of "
                         f"{_BY}")
    if costs is not None:
        if len(costs) != len(listed):
            raise ValueError(f"balance: {len(costs)} costs for {len(listed)} units")
    elif by == "params":
        costs = unit_param_counts(listed)
    elif sample is None:
        raise ValueError("balance='time' measures each unit's forward and backward: pass "
                         "sample= (an input of the first unit), or costs=")
    else:
        costs = measure_unit_times(listed, sample, repeats)
    return partition(costs, n_stages)
