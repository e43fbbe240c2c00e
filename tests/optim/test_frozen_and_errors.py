"""Non-floating leaves are frozen, mixed-dtype trees work, bad hyper-parameters are refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn import optim, pytree

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd_momentum_wd": lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
    "adam_wd": lambda: optim.adam(0.1, weight_decay=0.1),
    "adamw": lambda: optim.adamw(0.1, weight_decay=0.1),
    "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(0.1)),
    "masked": lambda: optim.masked(optim.adam(0.1), lambda p: pytree.tree_map(
        lambda x: x.ndim >= 2, p)),
    "multi": lambda: optim.multi_transform(
        {"a": optim.adamw(0.1), "b": optim.sgd(0.1, momentum=0.5), "c": optim.identity()},
        lambda p: pytree.tree_map(lambda x: "a" if x.ndim >= 2 else "b", p)),
    "scale_schedule": lambda: optim.chain(optim.scale(-0.1),
                                          optim.scale_by_schedule(optim.constant(0.5))),
    "donating": lambda: optim.donating(optim.chain(optim.clip_by_global_norm(0.5),
                                                   optim.adamw(0.1))),
    "identity": lambda: optim.identity(),
    "set_to_zero": lambda: optim.set_to_zero(),
}


def _bn_params():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model = sf.functional(net)
    return model.init(0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_integer_buffers_are_frozen(name):
    """BatchNorm's num_batches_tracked (int64) gets a zero int64 update and no state math;
    the floating leaves step exactly as in a tree without it."""
    params = _bn_params()
    int_names = [k for k, v in params.items() if not v.is_floating_point()]
    assert int_names, "the model must hold an integer buffer"
    gen = torch.Generator().manual_seed(0)
    grads = {k: torch.randn(v.shape, generator=gen) if v.is_floating_point()
             else torch.full_like(v, 7) for k, v in params.items()}
    floats = {k: v for k, v in params.items() if k not in int_names}
    opt, ref = OPTIMIZERS[name](), OPTIMIZERS[name]()
    state, ref_state = opt.init(params), ref.init(floats)
    for _ in range(3):
        updates, state = opt.update({k: g.clone() for k, g in grads.items()}, state, params)
        ref_updates, ref_state = ref.update({k: grads[k].clone() for k in floats}, ref_state,
                                            floats)
        for k in int_names:
            assert updates[k].dtype == params[k].dtype and torch.equal(
                updates[k], torch.zeros_like(params[k])), k
        assert_close({k: updates[k] for k in floats}, ref_updates)
        params = optim.apply_updates(params, updates)
        floats = optim.apply_updates(floats, ref_updates)


def test_sgd_on_a_mixed_fp32_bf16_tree_steps_each_leaf_in_its_dtype():
    """Like torch.optim.SGD (each param in its dtype); was an IndexError without momentum."""
    gen = torch.Generator().manual_seed(1)
    params = {"a": torch.randn(3, generator=gen), "b": torch.randn(4, generator=gen).bfloat16()}
    grads = {"a": torch.randn(3, generator=gen), "b": torch.randn(4, generator=gen).bfloat16()}
    for momentum in (0.0, 0.9):
        opt = optim.sgd(0.1, momentum=momentum)
        state = opt.init(params)
        tparams = [p.clone().requires_grad_() for p in params.values()]
        torch_opt = torch.optim.SGD(tparams, lr=0.1, momentum=momentum)
        ours = params
        for _ in range(3):
            updates, state = opt.update(grads, state, ours)
            ours = optim.apply_updates(ours, updates)
            for p, g in zip(tparams, grads.values(), strict=True):
                p.grad = g.clone()
            torch_opt.step()
        assert ours["a"].dtype == torch.float32 and ours["b"].dtype == torch.bfloat16
        assert_close(ours["a"], tparams[0].detach())
        # bf16: ours rounds p + update once more than torch's fused add (one bf16 ulp)
        assert_close(ours["b"], tparams[1].detach(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("make, arg", [
    (lambda v: optim.adam(v), "learning_rate"),
    (lambda v: optim.adamw(v), "learning_rate"),
    (lambda v: optim.sgd(v), "learning_rate"),
    (lambda v: optim.adam(1e-3, b1=v), "b1"),
    (lambda v: optim.adam(1e-3, b2=v), "b2"),
    (lambda v: optim.adam(1e-3, eps=v), "eps"),
    (lambda v: optim.adamw(1e-3, weight_decay=v), "weight_decay"),
    (lambda v: optim.sgd(0.1, momentum=v), "momentum"),
    (lambda v: optim.sgd(0.1, weight_decay=v), "weight_decay"),
    (lambda v: optim.clip_by_global_norm(v), "max_norm"),
    (lambda v: optim.constant(v), "value"),
    (lambda v: optim.cosine_decay(v, 10), "peak"),
    (lambda v: optim.linear_schedule(v, 0.0, 10), "init_value"),
])
@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_nan_and_negative_hyper_parameters_are_refused(make, arg, bad):
    if bad < 0 and arg in ("value", "peak", "init_value"):  # negative schedule values are legal
        bad = math.inf
    with pytest.raises(ValueError, match=arg):
        make(bad)


def test_schedule_returning_nan_is_a_run_time_matter():
    opt = optim.adam(lambda step: 1e-3)  # a schedule is accepted at construction
    assert opt.init({"w": torch.zeros(2)}).count == 0
