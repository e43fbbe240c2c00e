"""sgd matches torch.optim.SGD (momentum, dampening, Nesterov, weight decay) over 20 steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_cases import run_both, tree_shapes
from torch.testing import assert_close

from shardfn import optim, pytree

# rtol 1e-6 as asked. atol 1e-6 (a few float32 ulps at |p| ~ 4, the largest initial
# values) covers elements that drift close to zero: they keep the absolute rounding of
# their larger past values, and our `p + update` rounds differently from torch's fused
# kernels by up to one ulp per step (SGD: torch's p.add_(g, alpha=-lr) is an FMA;
# AdamW: torch decays p in place before adding the Adam step).
TOL = dict(rtol=1e-6, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    shapes=tree_shapes(),
    lr=st.floats(1e-4, 0.1),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-3, 0.1]),
    dampening=st.sampled_from([0.0, 0.3]),
    foreach=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sgd_matches_torch(shapes, lr, momentum, nesterov, weight_decay, dampening, foreach,
                           seed):
    if nesterov and momentum == 0:
        momentum = 0.9
    if nesterov:
        dampening = 0.0
    ours = optim.sgd(lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                     dampening=dampening)

    def reference(ps):
        return torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov,
                               weight_decay=weight_decay, dampening=dampening, foreach=foreach)

    params, torch_params, state = run_both(ours, reference, shapes, seed)
    for name, p, q in zip(pytree.tree_paths(params), pytree.tree_leaves(params), torch_params,
                          strict=True):
        assert_close(p, q, **TOL, msg=lambda m, name=name: f"leaf {name}: {m}")
    assert state.count.dtype == torch.int64 and int(state.count) == 20
    assert (state.momentum is None) == (momentum == 0)


def test_sgd_first_step_copies_gradient_then_dampens():
    # buf = g on step 1 (no dampening), then buf = m * buf + (1 - d) * g
    opt = optim.sgd(1.0, momentum=0.5, dampening=0.5)
    params = {"w": torch.zeros(2)}
    state = opt.init(params)
    u1, state = opt.update({"w": torch.tensor([2.0, 4.0])}, state, params)
    u2, state = opt.update({"w": torch.tensor([2.0, 4.0])}, state, params)
    assert torch.equal(u1["w"], torch.tensor([-2.0, -4.0]))
    assert torch.equal(u2["w"], torch.tensor([-2.0, -4.0]))  # 0.5 * 2 + 0.5 * 2
    assert torch.equal(state.momentum["w"], torch.tensor([2.0, 4.0]))


def test_sgd_validates_hyperparameters():
    with pytest.raises(ValueError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="learning_rate"):
        optim.sgd(-0.1)
    with pytest.raises(TypeError, match="momentum"):
        optim.sgd(0.1, momentum=lambda step: 0.9)
    opt = optim.sgd(0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="needs params"):
        opt.update({"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}))
