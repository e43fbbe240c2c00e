"""Buffer donation: donating(opt) and apply_updates(donate=True) give bitwise the same results,
write in place, and never touch anything without donation."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_cases import assert_trees_equal, clone_tree, random_tree, tree_shapes
from test_optim_base import all_optimizers

from shardfn import optim, pytree


def donation_optimizers():
    out = all_optimizers()
    out["sgd_momentum"] = optim.sgd(0.1, momentum=0.9)
    scalars = lambda ps: pytree.tree_map(lambda p: p.ndim == 0, ps)  # noqa: E731
    out["zero_and_scale"] = optim.chain(optim.masked(optim.set_to_zero(), scalars),
                                        optim.scale(-0.5))
    return out


NAMES = sorted(donation_optimizers())


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(tree) if t.numel()}


@settings(max_examples=20, deadline=None)
@given(shapes=tree_shapes(), name=st.sampled_from(NAMES), seed=st.integers(0, 2**16))
def test_donating_is_bitwise_the_same_and_pure_path_untouched(shapes, name, seed):
    opt = donation_optimizers()[name]
    donating = optim.donating(opt)
    gen = torch.Generator().manual_seed(seed)
    params = random_tree(shapes, gen)
    params_d = clone_tree(params)
    state, state_d = opt.init(params), donating.init(params_d)
    for _ in range(3):  # the second and third steps exercise the moment buffers
        grads = random_tree(shapes, gen)
        kept = (clone_tree(params), clone_tree(grads), clone_tree(state))
        updates, new_state = opt.update(grads, state, params)
        assert_trees_equal(params, kept[0])  # nothing mutated without donation
        assert_trees_equal(grads, kept[1])
        assert_trees_equal(state, kept[2])
        state = new_state
        updates_d, state_d = donating.update(clone_tree(grads), state_d, params_d)
        assert_trees_equal(updates_d, updates)
        assert_trees_equal(state_d, state)
        new_params = optim.apply_updates(params, updates)
        assert_trees_equal(params, kept[0])
        params_d = optim.apply_updates(params_d, updates_d, donate=True)
        assert_trees_equal(params_d, new_params)
        params = new_params


def test_donated_adamw_writes_in_place():
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    opt = optim.donating(optim.adamw(1e-2, weight_decay=0.1))
    state = opt.init(params)
    for _ in range(2):
        grads = {"w": torch.randn(4, 3), "b": torch.randn(3)}
        before_state, before_grads = _storages(state), _storages(grads)
        updates, state = opt.update(grads, state, params)
        assert _storages(state.mu) | _storages(state.nu) <= before_state  # moments in place
        assert _storages(updates) == before_grads  # updates written into the gradients
        new = optim.apply_updates(params, updates, donate=True)
        assert new is params  # added in place, the same tree back


def test_donated_sgd_momentum_writes_in_place():
    params = {"w": torch.randn(5)}
    opt = optim.donating(optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01))
    state = opt.init(params)
    buffer = state.momentum["w"]
    for _ in range(3):
        grads = {"w": torch.randn(5)}
        updates, state = opt.update(grads, state, params)
        assert state.momentum["w"] is buffer and updates["w"] is grads["w"]


def test_donation_falls_back_when_leaves_share_memory():
    shared = torch.randn(3)
    grads = {"a": shared, "b": shared}  # the same tensor twice: writing it twice would be wrong
    params = {"a": torch.ones(3), "b": torch.ones(3)}
    opt = optim.adam(0.1)
    expected, _ = opt.update(grads, opt.init(params), params)
    kept = shared.clone()
    updates, _ = optim.donating(opt).update(grads, opt.init(params), params)
    assert_trees_equal(updates, expected)
    assert torch.equal(shared, kept)
    tied = {"a": params["a"], "b": params["a"]}
    new = optim.apply_updates(tied, {"a": torch.ones(3), "b": torch.ones(3)}, donate=True)
    assert torch.equal(new["a"], torch.full((3,), 2.0)) and torch.equal(params["a"], torch.ones(3))


def test_apply_updates_donated_on_leaves_that_require_grad():
    w = torch.ones(3, requires_grad=True)
    out = optim.apply_updates({"w": w}, {"w": torch.full((3,), 0.5)}, donate=True)
    assert out["w"] is w and torch.equal(w.detach(), torch.full((3,), 1.5))
    assert w.grad_fn is None and w.requires_grad


def test_apply_updates_donated_keeps_param_dtype():
    p = torch.randn(8).to(torch.bfloat16)
    u = torch.randn(8)
    expected = optim.apply_updates({"p": p}, {"p": u})["p"]
    out = optim.apply_updates({"p": p.clone()}, {"p": u}, donate=True)["p"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_writable_in_place():
    w = torch.zeros(4, 4)
    assert optim.donation.writable_in_place([w[0], w[1], torch.zeros(2)])
    assert not optim.donation.writable_in_place([w, w[1]])
    assert not optim.donation.writable_in_place([w[:, 0], w[0]])  # overlapping strided views
    with torch.enable_grad():
        assert not optim.donation.writable_in_place([torch.zeros(2, requires_grad=True)])
