"""The comparison and its hints on hand-made records (no world needed): every hint fires on
its pattern and not on a plain numeric error; messages name the leaf, record and rank."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.testing._compare import Tolerance, compare_runs, shard_counts


def _run(expected, per_rank, mesh=None, keys=("grads",), previous=None, prev_expected=None):
    """Compare one step (after an init record) of ``grads``."""
    mesh = mesh or {"dp": len(per_rank)}
    init_ref = {"grads": prev_expected if prev_expected is not None else expected * 0}
    ref = [init_ref, {"grads": expected}]
    runs = [[{"grads": previous[r] if previous is not None else init_ref["grads"]},
             {"grads": value}] for r, value in enumerate(per_rank)]
    compare_runs(ref, runs, keys=keys, tolerance=Tolerance(), mesh_shape=mesh)


def _message(*args, **kwargs) -> str:
    with pytest.raises(AssertionError) as caught:
        _run(*args, **kwargs)
    return str(caught.value)


EXPECTED = torch.linspace(1.0, 2.0, 12).reshape(6, 2)


def test_equal_records_pass_and_the_defaults_are_assert_close_defaults():
    _run(EXPECTED, [EXPECTED.clone(), EXPECTED + 1e-7])
    message = _message(EXPECTED, [EXPECTED, EXPECTED + 1e-3])
    assert "grads differs from the reference at step 0 on rank 1 (of 2" in message
    assert "max abs error 0.001" in message and "hint" not in message  # no pattern: no hint


@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 4), rows=st.integers(1, 7))
def test_ratio_n_and_one_over_n(n, rows):
    expected = torch.randn(rows, 3) + 3.0
    assert "exactly" in _message(expected, [expected * n] * n) and f"{n} times" in _message(
        expected, [expected * n] * n)
    assert f"exactly 1/{n}" in _message(expected, [expected / n] * n)


def test_ranks_disagreeing_sum_mean_and_generic():
    parts = [EXPECTED * 0.25, EXPECTED * 0.75]
    assert "their sum equals the reference" in _message(EXPECTED, parts)
    assert "their mean equals the reference" in _message(EXPECTED, [EXPECTED * 0.5,
                                                                    EXPECTED * 1.5])
    assert "disagree with each other" in _message(EXPECTED, [EXPECTED * 0.5, EXPECTED * 3])


def test_rank_dependent_values_at_init_point_to_the_seed():
    ref = [{"params": EXPECTED}]
    runs = [[{"params": EXPECTED}], [{"params": EXPECTED + 1}]]
    with pytest.raises(AssertionError, match="(?s)at init on rank 1.*rank-dependent seed"):
        compare_runs(ref, runs, keys=("params",), tolerance=Tolerance(), mesh_shape={"dp": 2})


def test_shape_hints_padding_spec_dim_and_missing_gather():
    expected = torch.randn(7, 4)
    assert "padding leaked" in _message(expected, [torch.randn(8, 4)] * 2)
    assert "wrong spec dim" in _message(expected, [torch.randn(4, 8)] * 2)
    assert "not gathered along dim 0" in _message(expected, [torch.randn(4, 4)] * 2)


def test_block_hints_wrong_chunk_last_uneven_shard_and_one_rank():
    swapped = torch.cat([EXPECTED[3:], EXPECTED[:3]])
    assert "equals block 1 of the reference" in _message(EXPECTED, [swapped] * 2)
    uneven = torch.randn(7, 2) + 2
    last = uneven.clone()
    last[4:] += 1.0  # rows 4..6: the last of 2 blocks of ceil(7 / 2) = 4
    assert "only the last of 2 blocks along dim 0" in _message(uneven, [last] * 2)
    one = EXPECTED.clone()
    one[:3] *= -1
    assert "only block 0 of 2" in _message(EXPECTED, [one] * 2)


def test_stale_state_is_named():
    before = torch.randn(6, 2)
    stale = EXPECTED.clone()
    stale[3:] = before[3:]  # half the leaf kept its previous value
    message = _message(EXPECTED, [stale] * 2, previous=[before] * 2, prev_expected=before)
    assert "kept their value from the record before (init)" in message


def test_missing_keys_and_leaves_are_reported():
    ref = [{"grads": {"a": EXPECTED, "b": EXPECTED}}]
    with pytest.raises(AssertionError, match=r"missing \['b'\]"):
        compare_runs(ref, [[{"grads": {"a": EXPECTED}}]], keys=("grads",),
                     tolerance=Tolerance(), mesh_shape={"dp": 1})
    with pytest.raises(AssertionError, match="reports no 'grads'"):
        compare_runs(ref, [[{"loss": 1.0}]], keys=("grads",), tolerance=Tolerance(),
                     mesh_shape={"dp": 1})
    # a key the reference does not report is skipped
    compare_runs(ref, [[{"grads": {"a": EXPECTED, "b": EXPECTED}}]], keys=("grads", "loss"),
                 tolerance=Tolerance(), mesh_shape={"dp": 1})


def test_tolerances_and_shard_counts():
    ref = [{"loss": torch.tensor(1.0)}]
    compare_runs(ref, [[{"loss": torch.tensor(1.01)}]], keys=("loss",),
                 tolerance=Tolerance(0.0, 0.02), mesh_shape={"dp": 1})
    with pytest.raises(AssertionError, match="rtol=0.0, atol=0.001"):
        compare_runs(ref, [[{"loss": torch.tensor(1.01)}]], keys=("loss",),
                     tolerance=Tolerance(0.0, 0.001), mesh_shape={"dp": 1})
    assert shard_counts({"dp": 2, "tp": 3}) == (2, 3, 6)
    assert shard_counts({"dp": 1}) == ()
