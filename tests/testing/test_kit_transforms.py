"""The kit on the transforms the rewritten test files do not cover: tensor_split (gathered
with its specs, the Adam state too), remat (inside a data-parallel step) and precision (a
stated tolerance)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardfn as sf
from shardfn.testing import assert_sharded_matches, loss_trainer
from tests.testing import mutants


def _mlp():
    torch.manual_seed(0)
    return sf.functional(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)))


def _mse(apply):
    return lambda p, batch: (apply(p, batch[0]) - batch[1]).square().mean()


def _tp_sharded(mesh):
    tp = sf.tensor_split(_mlp(), mesh, "tp", {"0": "colwise", "2": "rowwise"})
    params, specs, opt = tp.init(0), dict(tp.specs), sf.optim.adam(1e-2)
    gather = sf.testing.gather_with({"params": specs, "grads": specs,
                                     "opt_state": sf.testing.state_specs(opt.init(params), specs)})
    return loss_trainer(params, _mse(tp.apply), opt=opt, gather=gather)


def test_tensor_split_matches_the_unsplit_model(worlds):
    fmodel = _mlp()
    batches = mutants.megatron_case(2).inputs
    assert_sharded_matches(_tp_sharded, lambda: loss_trainer(fmodel.init(0), _mse(fmodel.apply),
                                                             opt=sf.optim.adam(1e-2)),
                           mesh={"tp": 2}, inputs=batches, world=worlds)


def _remat_dp(mesh):
    loss = sf.remat(mutants.mlp_loss, policy=sf.checkpoint_policies.dots_saveable)
    return loss_trainer(mutants.mlp_params(3, 5, 0), loss, opt=sf.optim.sgd(0.1),
                        reduce_grads=lambda g: sf.pmean(g, "dp"),
                        reduce_loss=lambda value: sf.pmean(value, "dp"))


def test_remat_in_a_data_parallel_step_matches(worlds):
    case = mutants.dp_case({"dp": 2})
    assert_sharded_matches(_remat_dp, case.reference, mesh=case.mesh, inputs=case.inputs,
                           world=worlds)


def _bf16_dp(mesh):
    model = sf.with_precision(_mlp(), sf.Precision(param_dtype=torch.bfloat16))
    loss = lambda p, b: _mse(model.apply)(p, b).float()  # noqa: E731
    return loss_trainer(model.init(0), loss, reduce_grads=lambda g: sf.pmean(g, "dp"),
                        reduce_loss=lambda value: sf.pmean(value, "dp"))


def test_precision_matches_within_a_stated_bf16_tolerance(worlds):
    """bf16 compute on half batches rounds differently from one bf16 pass over the whole
    batch: bf16 has 8 bits of mantissa, so 3e-2 (a few bf16 ulps) is the stated tolerance."""
    model = sf.with_precision(_mlp(), sf.Precision(param_dtype=torch.bfloat16))
    reference = lambda: loss_trainer(model.init(0),  # noqa: E731
                                     lambda p, b: _mse(model.apply)(p, b).float())
    inputs = mutants.regression_batches(8, 4, 1, 0)
    inputs = [(x, torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
              for x, _ in inputs]
    assert_sharded_matches(_bf16_dp, reference, n_ranks=2, inputs=inputs, world=worlds,
                           rtol=3e-2, atol=3e-2)
    with pytest.raises(AssertionError, match="grads"):  # float32 defaults: too tight for bf16
        assert_sharded_matches(_bf16_dp, reference, n_ranks=2, inputs=inputs, world=worlds)
    with pytest.raises(ValueError, match="both rtol and atol"):
        assert_sharded_matches(_bf16_dp, reference, n_ranks=2, inputs=inputs, rtol=1e-2)
