"""Pipeline balance: explicit lists checked, partitions by parameters and by (fake or measured)
time are optimal, deterministic and contiguous."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.transforms.pipeline.balance import (
    balance_units,
    measure_unit_times,
    partition,
    unit_param_counts,
)


def _compositions(n: int, k: int):
    """Every way to write n as k positive parts, in order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def _stage_costs(costs, counts):
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return out


@settings(max_examples=8, deadline=None)
@given(costs=st.lists(st.integers(0, 20), min_size=1, max_size=9), data=st.data())
def test_partition_is_the_brute_force_min_max(costs, data):
    k = data.draw(st.integers(1, len(costs)))
    counts = partition(costs, k)
    assert len(counts) == k and sum(counts) == len(costs) and min(counts) >= 1
    best = min(max(_stage_costs(costs, c)) for c in _compositions(len(costs), k))
    assert max(_stage_costs(costs, counts)) == best
    # the tie-break: least sum of squares among the optimal ones
    optimal = [c for c in _compositions(len(costs), k) if max(_stage_costs(costs, c)) == best]
    least = min(sum(x * x for x in _stage_costs(costs, c)) for c in optimal)
    assert sum(x * x for x in _stage_costs(costs, counts)) == least
    assert partition(list(costs), k) == counts  # deterministic


def test_partition_examples():
    assert partition([1, 1, 1, 1], 2) == (2, 2)
    assert partition([4, 1, 1, 1, 1, 4], 3) == (1, 4, 1)
    assert partition([0, 0, 0], 3) == (1, 1, 1)
    assert partition([10, 1, 1, 1], 2) == (1, 3)
    # a tie up to round-off (0.1 + 0.2 vs 0.3): max and squares equal, the earlier split wins
    assert partition([0.1, 0.2, 0.30000000000000004, 0.3], 2) == (2, 2)
    assert partition([5.0], 1) == (1,)


def test_partition_errors():
    with pytest.raises(ValueError, match="n_stages=5 must be an int in 1..4"):
        partition([1, 1, 1, 1], 5)
    with pytest.raises(ValueError, match="n_stages=0"):
        partition([1, 1], 0)
    with pytest.raises(ValueError, match="unit 1 has cost -1"):
        partition([1, -1], 1)
    with pytest.raises(ValueError, match="unit 0 has cost inf"):
        partition([float("inf"), 1], 1)


def _mlp():
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 64), nn.Linear(64, 16),
                         nn.Linear(16, 16))


def test_explicit_balance_checked():
    model = _mlp()
    assert balance_units(model, 2, [3, 2]) == (3, 2)
    assert balance_units(list(model), 3, (1, 1, 3)) == (1, 1, 3)
    with pytest.raises(ValueError, match=r"balance \[2, 2\] covers 4 units but the model has 5 "
                                         r"\(units 4..4 would have no stage\)"):
        balance_units(model, 2, [2, 2])
    with pytest.raises(ValueError, match="covers 6 units but the model has only 5"):
        balance_units(model, 2, [3, 3])
    with pytest.raises(ValueError, match="has 3 entries for 2 stages"):
        balance_units(model, 2, [1, 2, 2])
    with pytest.raises(ValueError, match="stage 1 gets 0 units"):
        balance_units(model, 2, [5, 0])
    with pytest.raises(ValueError, match="stage 0 gets 2.5 units"):
        balance_units(model, 2, [2.5, 2.5])
    with pytest.raises(ValueError, match="one of \\('params', 'time'\\)"):
        balance_units(model, 2, "flops")
    with pytest.raises(TypeError, match="unit 1 is a str"):
        balance_units([nn.ReLU(), "relu"], 1, "params")


def test_balance_by_params():
    model = _mlp()
    assert unit_param_counts(model) == [272, 0, 1088, 1040, 272]
    # [272, 0, 1088 | 1040, 272]: max 1360; [272, 0 | 1088, ...] is worse
    assert balance_units(model, 2, "params") == (3, 2)
    # 272 | 0, 1088 | 1040, 272 ties 272, 0 | 1088 | ...: the zero-cost GELU goes to the later stage
    assert balance_units(model, 3, "params") == (1, 2, 2)
    shared = nn.Linear(4, 4)
    assert unit_param_counts([shared, nn.Sequential(shared, nn.ReLU())]) == [20, 20]


def test_balance_by_time_with_injected_costs():
    model = _mlp()
    assert balance_units(model, 2, "time", costs=[5.0, 1.0, 1.0, 1.0, 1.0]) == (1, 4)
    assert balance_units(model, 2, "params", costs=[1, 1, 1, 1, 5]) == (4, 1)
    with pytest.raises(ValueError, match="3 costs for 5 units"):
        balance_units(model, 2, "time", costs=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="pass sample="):
        balance_units(model, 2, "time")


class _Slow(nn.Module):
    """A unit whose forward takes 100 ms whatever the machine's load."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(0.1)  # far above a loaded machine's stalls of a small Linear
        return self.lin(x)


def test_balance_by_measured_time_puts_the_slow_unit_alone():
    units = [nn.Linear(8, 8), nn.Linear(8, 8), _Slow(), nn.Linear(8, 8)]
    before = [p.detach().clone() for u in units for p in u.parameters()]
    times = measure_unit_times(units, torch.randn(4, 8), repeats=2)
    assert len(times) == 4 and min(times) > 0
    assert times[2] >= 0.1 and times[2] > 2 * max(times[0], times[1], times[3])
    assert balance_units(units, 3, "time", sample=torch.randn(4, 8), repeats=1) == (2, 1, 1)
    # the model is left as it was: no .grad written, parameters unchanged
    assert all(p.grad is None for u in units for p in u.parameters())
    after = [p.detach() for u in units for p in u.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_measure_integer_input_and_non_tensor_unit():
    units = [nn.Embedding(10, 8), nn.Linear(8, 8)]
    assert len(measure_unit_times(units, torch.tensor([[1, 2, 3]]), repeats=1)) == 2

    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(TypeError, match="unit 1 \\(Pair\\) returned a tuple"):
        measure_unit_times([nn.Linear(2, 2), Pair()], torch.randn(1, 2), repeats=1)
    with pytest.raises(ValueError, match="repeats=0"):
        measure_unit_times([nn.Linear(2, 2)], torch.randn(1, 2), repeats=0)
