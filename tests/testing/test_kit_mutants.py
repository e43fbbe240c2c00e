"""The mutation test: each broken implementation is caught with the right hint; the correct
versions pass over the strategies' range (meshes, models with tied weights, buffers, frozen
layers, uneven dims)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn.testing import assert_sharded_matches, strategies
from tests.testing import mutants


def _check(case, world):
    return assert_sharded_matches(case.sharded, case.reference, mesh=case.mesh,
                                  inputs=case.inputs, split=case.split, world=world)


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_each_mutant_is_caught_with_its_hint(worlds, name):
    _, hint = mutants.MUTANTS[name]
    with pytest.raises(AssertionError, match=hint) as caught:
        _check(mutants.mutant_case(name), worlds)
    message = str(caught.value)
    # the report names the leaf, the record and the rank, with the errors
    assert " differs from the reference at " in message and " on rank " in message
    assert "max abs error" in message or "shape (" in message


@settings(max_examples=6, deadline=None)
@given(mesh=strategies.meshes(max_ranks=4), seed=st.integers(0, 2**16),
       d=st.integers(1, 4), hidden=st.integers(1, 5))
def test_correct_data_parallel_passes_on_every_mesh(worlds, mesh, seed, d, hidden):
    _check(mutants.dp_case(mesh, d=d, hidden=hidden, seed=seed), worlds)


@settings(max_examples=4, deadline=None)
@given(tp=st.integers(1, 4), per_tp=st.integers(1, 3), d=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_correct_megatron_mlp_passes(worlds, tp, per_tp, d, seed):
    _check(mutants.megatron_case(tp, d=d, per_tp=per_tp, seed=seed), worlds)


@settings(max_examples=4, deadline=None)
@given(n=st.integers(1, 3), model=strategies.models(kinds=("mlp",), d_models=(3, 5),
                                                    max_layers=1),
       seed=st.integers(0, 2**16))
def test_correct_shard_params_passes_on_tiny_models(worlds, n, model, seed):
    _check(mutants.fsdp_case(n, model, seed=seed), worlds)


@settings(max_examples=4, deadline=None)
@given(n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_correct_zero2_passes(worlds, n, seed):
    _check(mutants.zero_case(n, seed=seed), worlds)


def test_a_mutant_on_one_rank_is_not_a_false_alarm(worlds):
    """On one rank a missing mean is no bug: the kit must not flag it."""
    _check(mutants.dp_case({"dp": 1}, bug="missing_grad_mean"), worlds)
    assert sf.testing.COMPARE[0] == "loss"
