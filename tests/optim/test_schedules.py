"""Schedules vs torch.optim.lr_scheduler and closed forms; step indexing in optimizers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_cases import run_both, tree_shapes
from torch.testing import assert_close

from shardfn import optim, pytree
from shardfn.optim import schedules


def torch_lrs(make_scheduler, base_lr: float, steps: int) -> list[float]:
    """The lr torch uses at optimizer steps 0..steps-1."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    scheduler = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


@settings(max_examples=15, deadline=None)
@given(peak=st.floats(1e-4, 1.0), warmup=st.integers(1, 30), start=st.floats(0.01, 1.0))
def test_linear_warmup_matches_linear_lr(peak, warmup, start):
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, start, 1.0, warmup), peak,
                    warmup + 5)
    ours = optim.linear_warmup(peak, warmup, init_value=start * peak)
    assert_close([ours(torch.tensor(t)) for t in range(len(ref))], ref, rtol=1e-6, atol=0)


@settings(max_examples=15, deadline=None)
@given(peak=st.floats(1e-4, 1.0), decay=st.integers(1, 50), alpha=st.sampled_from([0.0, 0.1]))
def test_cosine_decay_matches_cosine_annealing(peak, decay, alpha):
    # torch's CosineAnnealingLR is periodic past T_max; compare up to T_max (ours stays flat)
    ref = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, decay, alpha * peak),
                    peak, decay + 1)
    ours = optim.cosine_decay(peak, decay, alpha)
    assert_close([ours(t) for t in range(decay + 1)], ref, rtol=1e-6, atol=1e-12)
    assert ours(decay + 7) == pytest.approx(alpha * peak)


def test_warmup_cosine_decay_closed_form():
    lr = schedules.warmup_cosine_decay(1.0, warmup_steps=10, decay_steps=110, end_value=0.1)
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)),
                60: 0.55, 110: 0.1, 500: 0.1}
    for step, value in expected.items():
        assert lr(torch.tensor(step)) == pytest.approx(value, rel=1e-12, abs=1e-15), step
    no_warmup = schedules.warmup_cosine_decay(2.0, 0, 4)
    assert [no_warmup(t) for t in range(5)] == pytest.approx([2.0, 1 + 2 ** -0.5, 1.0,
                                                              1 - 2 ** -0.5, 0.0])
    with pytest.raises(ValueError, match="decay_steps"):
        schedules.warmup_cosine_decay(1.0, 10, 10)


def test_join_and_linear_schedule():
    lr = optim.join([optim.constant(3.0), optim.linear_schedule(2.0, 0.0, 4)], [2])
    assert [lr(t) for t in range(8)] == [3.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="one more schedule"):
        optim.join([optim.constant(1.0)], [3])


@settings(max_examples=10, deadline=None)
@given(shapes=tree_shapes(), seed=st.integers(0, 2**16))
def test_scheduled_adam_matches_torch_with_lambda_lr(shapes, seed):
    # the t-th update (1-based) uses schedule(t - 1), as torch's scheduler does
    peak = 0.05
    lr = schedules.warmup_cosine_decay(peak, warmup_steps=5, decay_steps=15, end_value=1e-3)

    def reference(ps):
        opt = torch.optim.Adam(ps, lr=peak)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: lr(epoch) / peak)

        class Stepper:  # steps the scheduler after each optimizer step
            def step(self):
                opt.step()
                scheduler.step()

        return Stepper()

    params, torch_params, _ = run_both(optim.adam(lr), reference, shapes, seed)
    for p, q in zip(pytree.tree_leaves(params), torch_params, strict=True):
        assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_scale_by_schedule_uses_count_before_increment():
    opt = optim.scale_by_schedule(lambda step: float(step) + 1.0)
    state = opt.init({"w": torch.ones(1)})
    seen = []
    for _ in range(3):
        updates, state = opt.update({"w": torch.ones(1)}, state)
        seen.append(float(updates["w"]))
    assert seen == [1.0, 2.0, 3.0] and int(state.count) == 3
