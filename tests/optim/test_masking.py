"""chain, masked and multi_transform follow optax's semantics."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_cases import random_tree, tree_shapes
from torch.testing import assert_close

from shardfn import optim, pytree


def run(opt, params, grads_seq):
    state = opt.init(params)
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def make_problem(shapes, seed, steps=3):
    gen = torch.Generator().manual_seed(seed)
    return random_tree(shapes, gen), [random_tree(shapes, gen) for _ in range(steps)]


def test_chain_applies_in_order_and_keeps_a_state_tuple():
    params = {"w": torch.tensor([1.0, -2.0])}
    grads = {"w": torch.tensor([30.0, 40.0])}  # norm 50
    opt = optim.chain(optim.clip_by_global_norm(5.0), optim.sgd(0.1, momentum=0.9))
    state = opt.init(params)
    assert isinstance(state, tuple) and len(state) == 2
    assert isinstance(state[1], optim.SgdState)
    updates, state = opt.update(grads, state, params)
    assert_close(updates["w"], -0.1 * grads["w"] * 5.0 / (50.0 + 1e-6))
    assert_close(state[1].momentum["w"], grads["w"] * 5.0 / (50.0 + 1e-6))
    with pytest.raises(ValueError, match="tuple of 2"):
        opt.update(grads, state[0], params)


@settings(max_examples=15, deadline=None)
@given(shapes=tree_shapes(), seed=st.integers(0, 2**16), mask_seed=st.integers(0, 2**16))
def test_masked_applies_inner_only_to_selected_leaves(shapes, seed, mask_seed):
    params, grads_seq = make_problem(shapes, seed)
    treedef = pytree.tree_structure(params)
    n = treedef.num_leaves
    flags = [bool(b) for b in torch.randint(0, 2, (n,),
                                            generator=torch.Generator().manual_seed(mask_seed))]

    def keep_selected(tree):
        kept = [x if f else None for x, f in zip(pytree.tree_leaves(tree), flags, strict=True)]
        return pytree.tree_unflatten(treedef, kept)

    inner = optim.adam(0.05)
    opt = optim.masked(inner, pytree.tree_unflatten(treedef, flags))
    state = opt.init(params)
    # the inner state covers only the selected leaves
    assert len(pytree.tree_leaves(state.inner_state.mu)) == sum(flags)
    ref_state = inner.init(keep_selected(params))
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        ref_updates, ref_state = inner.update(keep_selected(grads), ref_state,
                                              keep_selected(params))
        ref_iter = iter(pytree.tree_leaves(ref_updates))
        for u, g, f in zip(pytree.tree_leaves(updates), pytree.tree_leaves(grads), flags,
                           strict=True):
            # selected: the inner update, bit for bit; others: passed through unchanged
            assert torch.equal(u, next(ref_iter) if f else g)
        params = optim.apply_updates(params, updates)


def test_masked_with_callable_and_prefix_mask():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2), "head": {"w": torch.ones(3, 1)}}
    grads = pytree.tree_map(torch.ones_like, params)
    by_rank = optim.masked(optim.scale(-0.5), lambda ps: pytree.tree_map(lambda p: p.ndim > 1, ps))
    updates, _ = by_rank.update(grads, by_rank.init(params), params)
    assert torch.equal(updates["b"], torch.ones(2))
    assert torch.equal(updates["w"], torch.full((2, 2), -0.5))
    prefix = optim.masked(optim.scale(-0.5), {"w": False, "b": False, "head": True})
    updates, _ = prefix.update(grads, prefix.init(params), params)
    assert torch.equal(updates["head"]["w"], torch.full((3, 1), -0.5))
    assert torch.equal(updates["w"], torch.ones(2, 2))


@settings(max_examples=15, deadline=None)
@given(shapes=tree_shapes(), seed=st.integers(0, 2**16))
def test_multi_transform_equals_each_transform_on_its_group(shapes, seed):
    params, grads_seq = make_problem(shapes, seed)
    keys = sorted(params)
    labels = {k: ("fast" if i % 2 == 0 else "slow") for i, k in enumerate(keys)}
    transforms = {"fast": optim.sgd(0.1, momentum=0.9), "slow": optim.adamw(1e-2)}
    ours, state = run(optim.multi_transform(transforms, labels), params, grads_seq)
    assert set(state.inner_states) == {"fast", "slow"}
    for label, t in transforms.items():
        group = [k for k in keys if labels[k] == label]
        ref, _ = run(t, {k: params[k] for k in group}, [{k: g[k] for k in group}
                                                         for g in grads_seq])
        for k in group:
            for a, b in zip(pytree.tree_leaves(ours[k]), pytree.tree_leaves(ref[k]), strict=True):
                assert torch.equal(a, b), f"group {label}, leaf {k}"


def test_multi_transform_labels_callable_freezes_and_reports_unknown_label():
    params = {"embed": torch.ones(3, 2), "w": torch.ones(2, 2), "norm": torch.ones(2)}
    grads = pytree.tree_map(torch.ones_like, params)

    def labels(ps):
        return {k: ("frozen" if k == "embed" else "decay" if p.ndim > 1 else "plain")
                for k, p in ps.items()}

    opt = optim.multi_transform(
        {"frozen": optim.set_to_zero(), "decay": optim.sgd(0.5, weight_decay=1.0),
         "plain": optim.sgd(0.5)}, labels)
    updates, _ = opt.update(grads, opt.init(params), params)
    assert torch.equal(updates["embed"], torch.zeros(3, 2))
    assert torch.equal(updates["w"], torch.full((2, 2), -1.0))
    assert torch.equal(updates["norm"], torch.full((2,), -0.5))
    bad = optim.multi_transform({"decay": optim.identity()}, {"embed": "decay", "w": "decay",
                                                              "norm": "nodecay"})
    with pytest.raises(ValueError, match="'norm'.*'nodecay'"):
        bad.init(params)
