"""assert_sharded_matches' boundary: bad arguments get clear errors before any world starts;
a batch that does not split names its leaf; a sharded side that is not a Trainer is refused;
the records it returns are every rank's, init first."""

from __future__ import annotations

import pytest
import torch

from shardfn.testing import RankError, Trainer, assert_sharded_matches, split_over
from tests.testing import mutants

CASE = mutants.dp_case({"dp": 2})


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(mesh={"dp": 2}, n_ranks=3), "has 2 ranks, not n_ranks=3"),
    (dict(), "pass mesh="),
    (dict(n_ranks=2, inputs=lambda step: None), "needs steps="),
    (dict(n_ranks=2, inputs=[1], steps=2), "only 1 inputs"),
    (dict(n_ranks=2, rtol=1e-3), "both rtol and atol"),
    (dict(n_ranks=2, compare="grads"), "sequence of key names"),
    (dict(n_ranks=2, inputs=CASE.inputs, compare=("nothing",)), "nothing to compare"),
])
def test_bad_arguments_are_refused_before_running(kwargs, message):
    with pytest.raises(ValueError, match=message):
        assert_sharded_matches(CASE.sharded, CASE.reference, **kwargs)


def test_split_names_the_leaf_and_the_sharded_side_must_be_a_trainer(worlds):
    odd = [(torch.randn(3, 3), torch.randn(3))]  # 3 rows over 2 ranks
    with pytest.raises(RankError, match=r"batch leaf '0' \(\(3, 3\)\).*over mesh axis 'dp'"):
        assert_sharded_matches(CASE.sharded, CASE.reference, n_ranks=2, inputs=odd,
                               world=worlds)
    with pytest.raises(RankError, match="must return a sf.testing.Trainer, got dict"):
        assert_sharded_matches(lambda mesh: {}, CASE.reference, n_ranks=2, inputs=CASE.inputs,
                               world=worlds)


def test_records_come_back_per_rank_with_init_first(worlds):
    records = assert_sharded_matches(CASE.sharded, CASE.reference, mesh=CASE.mesh,
                                     inputs=CASE.inputs, split=split_over("dp"), world=worlds)
    assert len(records) == 2 and all(len(r) == 1 + len(CASE.inputs) for r in records)
    assert set(records[0][0]) == {"params", "opt_state"}
    assert {"loss", "grads", "params"} <= set(records[1][-1])
    torch.testing.assert_close(records[0][-1]["params"], records[1][-1]["params"])
    assert isinstance(CASE.reference(), Trainer)
