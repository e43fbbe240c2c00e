"""adam / adamw match torch.optim.Adam / AdamW over 20 steps, with and without decay/mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_cases import STEPS, random_tree, run_both, tree_shapes
from torch.testing import assert_close

from shardfn import optim, pytree

# rtol 1e-6 as asked. atol 1e-6 (a few float32 ulps at |p| ~ 4, the largest initial
# values) covers elements that drift close to zero: they keep the absolute rounding of
# their larger past values, and our `p + update` rounds differently from torch's fused
# kernels by up to one ulp per step (SGD: torch's p.add_(g, alpha=-lr) is an FMA;
# AdamW: torch decays p in place before adding the Adam step).
TOL = dict(rtol=1e-6, atol=1e-6)

hyper = dict(
    lr=st.floats(1e-4, 0.1),
    b1=st.sampled_from([0.0, 0.8, 0.9]),
    b2=st.sampled_from([0.9, 0.999]),
    eps=st.sampled_from([1e-8, 1e-3]),
    foreach=st.booleans(),
    seed=st.integers(0, 2**16),
)


def assert_params_close(params, torch_params):
    for name, p, q in zip(pytree.tree_paths(params), pytree.tree_leaves(params), torch_params,
                          strict=True):
        assert_close(p, q, **TOL, msg=lambda m, name=name: f"leaf {name}: {m}")


@settings(max_examples=20, deadline=None)
@given(shapes=tree_shapes(), weight_decay=st.sampled_from([0.0, 1e-2, 0.3]), **hyper)
def test_adam_matches_torch(shapes, weight_decay, lr, b1, b2, eps, foreach, seed):
    ours = optim.adam(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)

    def reference(ps):
        return torch.optim.Adam(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay,
                                foreach=foreach)

    params, torch_params, state = run_both(ours, reference, shapes, seed)
    assert_params_close(params, torch_params)
    assert state.count.dtype == torch.int64 and int(state.count) == STEPS


@settings(max_examples=20, deadline=None)
@given(shapes=tree_shapes(), weight_decay=st.sampled_from([0.0, 1e-2, 0.3]),
       use_mask=st.booleans(), mask_seed=st.integers(0, 2**16), **hyper)
def test_adamw_matches_torch(shapes, weight_decay, use_mask, mask_seed, lr, b1, b2, eps, foreach,
                             seed):
    n = len(pytree.tree_leaves(random_tree(shapes, torch.Generator())))
    flags = [bool(b) for b in torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(
        mask_seed))] if use_mask else [True] * n
    mask_tree = pytree.tree_unflatten(
        pytree.tree_structure(random_tree(shapes, torch.Generator())), flags)
    ours = optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                       mask=mask_tree if use_mask else None)

    def reference(ps):
        groups = [
            {"params": [p for p, f in zip(ps, flags, strict=True) if f],
             "weight_decay": weight_decay},
            {"params": [p for p, f in zip(ps, flags, strict=True) if not f],
             "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(b1, b2),
                                 eps=eps, foreach=foreach)

    params, torch_params, _ = run_both(ours, reference, shapes, seed)
    assert_params_close(params, torch_params)


def test_adamw_callable_mask_skips_vectors():
    # no decay on biases/norms: with zero gradients only the decayed matrix moves
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    opt = optim.adamw(0.1, weight_decay=0.5,
                      mask=lambda ps: pytree.tree_map(lambda p: p.ndim >= 2, ps))
    grads = pytree.tree_map(torch.zeros_like, params)
    updates, _ = opt.update(grads, opt.init(params), params)
    assert torch.equal(updates["b"], torch.zeros(2))
    assert_close(updates["w"], torch.full((2, 2), -0.05))


def test_adam_state_matches_torch_moments():
    params = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(0))}
    grads = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(1))}
    opt = optim.adam(1e-2)
    _, state = opt.update(grads, opt.init(params), params)
    p = params["w"].clone().requires_grad_(True)
    ref = torch.optim.Adam([p], lr=1e-2)
    p.grad = grads["w"].clone()
    ref.step()
    assert torch.equal(state.mu["w"], ref.state[p]["exp_avg"])
    assert torch.equal(state.nu["w"], ref.state[p]["exp_avg_sq"])


def test_adam_rejects_complex_and_bad_betas():
    with pytest.raises(ValueError, match="b1"):
        optim.adam(1e-3, b1=1.0)
    with pytest.raises(TypeError, match="complex"):
        optim.adam(1e-3).init({"z": torch.zeros(2, dtype=torch.complex64)})
    opt = optim.adamw(1e-3, mask={"w": 1})
    params = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="'w'"):
        opt.update(params, opt.init(params), params)
