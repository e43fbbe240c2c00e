"""Buffers in a pipeline step: ``value_and_grad(..., mutable=True)`` returns them updated.

BatchNorm units in training mode: each stage's forwards update its running
statistics micro-batch by micro-batch, so the buffers after the step equal
those of the unsplit ``sf.functional(nn.Sequential(*units))`` applied with
``mutable=True`` to the micro-batches in order (threading the buffers), and so do
the loss and gradients; two steps in a row (``{**params, **buffers}``) too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.functional import functional
from shardfn.transforms.pipeline import pipeline_stages
from tests.transforms.pipeline._pipeline_models import (
    batch,
    mse,
    schedule_status,
    virtual_for,
)


def bn_units() -> list[nn.Module]:
    return [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
            nn.Linear(8, 3)]


def microbatch_reference(seed: int, m: int, steps: list[tuple[torch.Tensor, torch.Tensor]]):
    """Per step (loss, grads, buffers) of the unsplit model run on the micro-batches in
    order, the buffers threaded through them (and on to the next step)."""
    model = functional(nn.Sequential(*bn_units()))
    params = model.init(seed)
    trainable, buffers = model.split_trainable(params)
    found = []
    for x, y in steps:
        for t in trainable.values():
            t.requires_grad_(True)
        total = 0.0
        for xi, yi in zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True):
            out, buffers = model.apply({**trainable, **buffers}, xi, mutable=True)
            total = total + mse(out, yi) * (xi.shape[0] / x.shape[0])
        grads = torch.autograd.grad(total, list(trainable.values()))
        found.append((total.detach(), dict(zip(trainable, grads, strict=True)),
                      {n: b.detach() for n, b in buffers.items()}))
    return found


def _steps(p: int, schedule: str, m: int, balance: list[int], rows: list[int]):
    pp = pipeline_stages(bn_units(), sf.Mesh({"pp": p}), balance=balance, schedule=schedule,
                         microbatches=m, loss_fn=mse, virtual=virtual_for(schedule))
    params, found = pp.init(0), []
    for k, n in enumerate(rows):
        loss, grads, buffers = pp.value_and_grad(params, *batch(n, seed=k), mutable=True)
        found.append((loss, grads, buffers))
        params = {**params, **buffers}
    plain = pp.value_and_grad(pp.init(0), *batch(rows[0], seed=0))  # mutable=False: 2 items
    return found, plain


@pytest.mark.parametrize("schedule, balance", [
    ("gpipe", [2, 4]), ("1f1b", [3, 3]), ("zb-h1", [2, 4]), ("interleaved", [1, 2, 1, 2])])
def test_buffers_follow_the_microbatches_in_order(worlds, schedule, balance):
    p, m, v = 2, 4, virtual_for(schedule)
    if schedule_status(schedule, p, m, v) is not None:
        pytest.skip(f"make_schedule has no {schedule!r} for p={p}, m={m}")
    rows = [8, 9]  # 9 rows: uneven micro-batches (3, 2, 2, 2)
    expected = microbatch_reference(0, m, [batch(n, seed=k) for k, n in enumerate(rows)])
    seen = set()
    for found, plain in worlds(p).run(_steps, p, schedule, m, balance, rows):
        assert len(plain) == 2
        assert_close(plain[0], expected[0][0])
        for (loss, grads, buffers), (ref_loss, ref_grads, ref_buffers) in zip(
                found, expected, strict=True):
            assert_close(loss, ref_loss)
            for name, grad in grads.items():
                assert_close(grad, ref_grads[name])
            for name, value in buffers.items():
                assert_close(value, ref_buffers[name])
            seen |= set(buffers)
        for name, count in found[-1][2].items():
            if "num_batches" in name:
                assert int(count) == 2 * m  # every micro-batch of both steps counted
    assert seen == set(expected[0][2])  # every BatchNorm buffer, from the rank holding it


def test_mutable_is_refused_with_remat_and_must_be_a_bool():
    pp = pipeline_stages(bn_units(), sf.Mesh({"pp": 1}), balance=[6], schedule="gpipe",
                         microbatches=2, loss_fn=mse, remat=sf.checkpoint_policies.nothing_saveable)
    with pytest.raises(ValueError, match="mutable=True.*not supported with remat="):
        pp.value_and_grad(pp.init(0), *batch(4), mutable=True)
    with pytest.raises(TypeError, match="mutable must be True or False"):
        pp.value_and_grad(pp.init(0), *batch(4), mutable=1)


def _zero3_steps(rows: list[int]):
    pp = pipeline_stages(bn_units(), sf.Mesh({"pp": 2, "dp": 2}), balance=[3, 3],
                         schedule="1f1b", microbatches=2, loss_fn=mse, dp_axis="dp",
                         stage_transform=lambda f, mesh: sf.shard_params(f, mesh, "dp"))
    params, found = pp.init(0), []
    for k, n in enumerate(rows):  # both dp replicas get the same batch: the reference's
        loss, grads, buffers = pp.value_and_grad(params, *batch(n, seed=k), mutable=True)
        params = {**params, **buffers}
        found.append((loss, buffers))
    return found


def test_buffers_with_zero3_stages(worlds):
    """pp x shard_params: each stage model's ``apply(..., mutable=True)`` updates them."""
    rows = [8, 6]
    expected = microbatch_reference(0, 2, [batch(n, seed=k) for k, n in enumerate(rows)])
    seen = set()
    for found in worlds(4).run(_zero3_steps, rows):
        for (loss, buffers), (ref_loss, _, ref_buffers) in zip(found, expected, strict=True):
            assert_close(loss, ref_loss)
            for name, value in buffers.items():
                assert_close(value, ref_buffers[name])
            seen |= set(buffers)
    assert seen == set(expected[0][2])
