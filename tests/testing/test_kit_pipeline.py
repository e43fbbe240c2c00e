"""The kit on ``pipeline_stages``: a pipelined AdamW step equals the unsplit ``nn.Sequential``.

The sharded side is a hand-built :class:`Trainer` around ``pp.value_and_grad`` (the
pipeline is a whole step, not a loss to differentiate, so ``loss_trainer`` does not
fit); ``pp.gather`` gathers the parameters, the gradients and Adam's moments (trees
with the parameters' names). Every schedule on ``{"pp": 2}``, interleaved with four
stages, pp x dp on ``{"pp": 2, "dp": 2}`` (the kit splits the batch over ``"dp"``),
and a loss summed over the micro-batch instead of averaged, caught with the ratio hint.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import pytest
import torch
from torch import nn

import shardfn as sf
from shardfn.testing import Trainer, assert_sharded_matches, loss_trainer
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, schedule_status

STEPS = 3


def _opt():
    return sf.optim.adamw(1e-2, weight_decay=0.1)


def _gather_tree(pp, tree):
    """``pp.gather`` on every subtree named like this rank's leaves (params, grads, mu, nu)."""
    if isinstance(tree, Mapping):
        if set(tree) == set(pp.names):
            return pp.gather(tree)
        return {k: _gather_tree(pp, v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_gather_tree(pp, v) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_gather_tree(pp, v) for v in tree)
    return tree  # Adam's count: the same on every rank


def pipeline_trainer(pp, seed: int, opt) -> Trainer:
    """One side: ``pp.value_and_grad`` on the rank's batch, then ``opt``; gathered by pp."""
    params = pp.init(seed)

    def step(state, xy):
        loss, grads = pp.value_and_grad(state["params"], *xy)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return ({"params": sf.optim.apply_updates(state["params"], updates),
                 "opt_state": opt_state}, {"loss": loss, "grads": grads})

    def gather(values):
        return {k: _gather_tree(pp, v) if k in ("params", "grads", "opt_state") else v
                for k, v in values.items()}

    return Trainer({"params": params, "opt_state": opt.init(params)}, step, gather)


def reference(n_units: int, seed: int, loss_fn=mse):
    model = sf.functional(nn.Sequential(*mlp_units(n_units)))
    return loss_trainer(model.init(seed), lambda p, xy: loss_fn(model.apply(p, xy[0]), xy[1]),
                        opt=_opt())


def sharded(n_units: int, seed: int, loss_fn=mse, dp_axis=None, **options):
    def make(mesh):
        pp = sf.pipeline_stages(mlp_units(n_units), mesh, "pp", loss_fn=loss_fn,
                                dp_axis=dp_axis, **options)
        return pipeline_trainer(pp, seed, _opt())
    return make


def _inputs(rows: int):
    return [batch(rows, seed=10 + s) for s in range(STEPS)]


def _skip_missing(name: str, p: int, m: int, v: int) -> None:
    status = schedule_status(name, p, m, v)
    if status == "missing":
        pytest.skip(f"make_schedule has no {name!r} yet")
    assert status is None, status


# (schedule, virtual, units, balance, microbatches, rows): uneven micro-batches too
PP2_CASES = [
    ("gpipe", 1, 6, [3, 3], 3, 10),       # micro-batches of 4, 3, 3 rows
    ("1f1b", 1, 6, [2, 4], 4, 12),
    ("1f1b", 1, 6, [4, 2], 2, 9),         # 5 and 4 rows
    ("zb-h1", 1, 6, [3, 3], 2, 8),
    ("zb-h1", 1, 6, [2, 4], 4, 11),
    ("interleaved", 2, 8, [2, 2, 2, 2], 4, 12),   # 4 stages, rank r holds r and r + 2
    ("interleaved", 2, 10, [2, 2, 4, 2], 2, 6),
]


@pytest.mark.parametrize(("schedule", "virtual", "units", "balance", "m", "rows"), PP2_CASES)
def test_pipeline_adamw_steps_match_the_unsplit_model(worlds, schedule, virtual, units,
                                                      balance, m, rows):
    _skip_missing(schedule, 2, m, virtual)
    records = assert_sharded_matches(
        sharded(units, 3, balance=balance, schedule=schedule, microbatches=m,
                virtual=virtual),
        reference(units, 3), mesh={"pp": 2}, inputs=_inputs(rows), world=worlds,
        compare=("loss", "grads", "params", "opt_state"))
    # each rank really ran a pipeline: every rank's gathered tree is the full model's
    assert all(set(r[-1]["params"]) == set(records[0][0]["params"]) for r in records)


def test_pipeline_on_four_stages_matches(worlds):
    _skip_missing("1f1b", 4, 4, 1)
    assert_sharded_matches(sharded(8, 5, balance=[2, 2, 2, 2], schedule="1f1b", microbatches=4),
                           reference(8, 5), mesh={"pp": 4}, inputs=_inputs(8), world=worlds,
                           compare=("loss", "grads", "params", "opt_state"))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_pp_x_dp_matches_the_unsplit_model(worlds, schedule):
    """{"pp": 2, "dp": 2}: the kit gives each dp replica its half of the batch; dp_axis
    averages gradients and loss, so the gathered grads are the whole batch's."""
    _skip_missing(schedule, 2, 3, 1)
    assert_sharded_matches(sharded(6, 4, dp_axis="dp", balance=[3, 3], schedule=schedule,
                                   microbatches=3),
                           reference(6, 4), mesh={"pp": 2, "dp": 2}, inputs=_inputs(12),
                           world=worlds, compare=("loss", "grads", "params", "opt_state"))


def test_pp_x_dp_without_dp_axis_is_caught(worlds):
    """Without dp_axis each replica keeps its own half-batch gradient: the ranks disagree."""
    with pytest.raises(AssertionError, match=r"(?s)loss.*ranks disagree"):
        assert_sharded_matches(sharded(6, 4, balance=[3, 3], schedule="1f1b", microbatches=3),
                               reference(6, 4), mesh={"pp": 2, "dp": 2}, inputs=_inputs(12),
                               world=worlds)


def summed_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mutation: a sum over the micro-batch's rows (a mean over the rest)."""
    return ((out - target) ** 2).sum(0).mean()


def test_a_loss_summed_over_the_micro_batch_is_caught_with_the_ratio(worlds):
    """pipeline_stages scales each micro-batch's loss by its share of the batch, which is
    right for a mean: a sum makes loss and gradients micro-batch-size times too big. Two
    micro-batches of 2 rows on {"pp": 2}: exactly 2 times the reference (the ratio hint
    names mesh sizes and their products, so the micro-batch size is picked to be one)."""
    with pytest.raises(AssertionError) as caught:
        assert_sharded_matches(sharded(6, 3, loss_fn=summed_mse, balance=[3, 3],
                                       schedule="1f1b", microbatches=2),
                               reference(6, 3), mesh={"pp": 2}, inputs=_inputs(4),
                               world=worlds, compare=("grads", "params"))
    message = str(caught.value)
    assert re.search(r"grads\['0\.(bias|weight)'\] differs from the reference at step 0",
                     message), message
    assert "exactly 2 times the reference" in message, message
    # pp x dp: each replica pipelines 8 rows in 2 micro-batches of 4, a mesh-size product
    with pytest.raises(AssertionError, match=r"(?s)loss differs.*exactly 4 times the reference"):
        assert_sharded_matches(sharded(6, 3, loss_fn=summed_mse, dp_axis="dp", balance=[3, 3],
                                       schedule="zb-h1", microbatches=2),
                               reference(6, 3), mesh={"pp": 2, "dp": 2}, inputs=_inputs(16),
                               world=worlds)
