"""Purity (no input mutated), tree checks, apply_updates, dtypes and state as pytrees."""

from __future__ import annotations

import io
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_cases import assert_trees_equal, clone_tree, random_tree, tree_shapes
from torch.testing import assert_close

from shardfn import optim, pytree


def all_optimizers():
    return {
        "sgd": optim.sgd(0.1),
        "sgd_nesterov_wd": optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
        "sgd_dampening": optim.sgd(0.1, momentum=0.9, dampening=0.5, weight_decay=0.1),
        "adam": optim.adam(1e-2, weight_decay=0.1),
        "adamw": optim.adamw(1e-2, mask=lambda ps: pytree.tree_map(lambda p: p.ndim > 1, ps)),
        "chain": optim.chain(optim.clip_by_global_norm(0.1),
                             optim.scale_by_schedule(optim.cosine_decay(1.0, 10)),
                             optim.scale(-0.1)),
        "masked": optim.masked(optim.adam(1e-2), lambda ps: pytree.tree_map(lambda p: p.ndim > 0,
                                                                            ps)),
        "multi": optim.multi_transform({"a": optim.adamw(1e-2), "b": optim.sgd(0.1,
                                                                               momentum=0.5)},
                                       lambda ps: pytree.tree_map(lambda p: "ab"[p.ndim % 2], ps)),
    }


NAMES = sorted(all_optimizers())


@settings(max_examples=15, deadline=None)
@given(shapes=tree_shapes(), name=st.sampled_from(NAMES), seed=st.integers(0, 2**16))
def test_update_mutates_nothing_and_is_repeatable(shapes, name, seed):
    opt = all_optimizers()[name]
    gen = torch.Generator().manual_seed(seed)
    params = random_tree(shapes, gen)
    state = opt.init(params)
    for _ in range(2):  # the second step exercises momentum/moment buffers
        grads = random_tree(shapes, gen)
        kept = (clone_tree(params), clone_tree(grads), clone_tree(state))
        updates, new_state = opt.update(grads, state, params)
        assert_trees_equal(params, kept[0])
        assert_trees_equal(grads, kept[1])
        assert_trees_equal(state, kept[2])
        again, again_state = opt.update(grads, state, params)  # pure: same inputs, same outputs
        assert_trees_equal(updates, again)
        assert_trees_equal(new_state, again_state)
        new_params = optim.apply_updates(params, updates)
        assert_trees_equal(params, kept[0])
        params, state = new_params, new_state


@pytest.mark.parametrize("name", NAMES)
def test_missing_or_misshapen_gradient_names_the_leaf(name):
    opt = all_optimizers()[name]
    params = {"w": torch.ones(2, 3), "block": {"b": torch.ones(3), "v": torch.ones(4)}}
    state = opt.init(params)
    missing = {"w": torch.ones(2, 3), "block": {"b": torch.ones(3)}}
    misshapen = {"w": torch.ones(3, 2), "block": {"b": torch.ones(3), "v": torch.ones(4)}}
    cases = [(missing, r"block\.v"), (misshapen, r"'w'.*shape \(\d, \d\).*\(\d, \d\)")]
    for grads, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            if name == "chain":  # clip and scale read neither params nor per-leaf state:
                # the mismatch goes through them and apply_updates reports it
                updates, _ = opt.update(grads, state, params)
                optim.apply_updates(params, updates)
            else:
                opt.update(grads, state, params)


def test_apply_updates_checks_trees_and_keeps_param_dtype():
    params = {"w": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(3)}
    updates = {"w": torch.full((2,), 0.5), "b": torch.full((3,), -0.25)}
    new = optim.apply_updates(params, updates)
    assert new["w"].dtype == torch.bfloat16 and torch.equal(new["w"].float(), torch.full((2,), 1.5))
    assert torch.equal(new["b"], torch.full((3,), 0.75))
    with pytest.raises(ValueError, match=r"\['b'\]"):
        optim.apply_updates(params, {"w": updates["w"]})
    with pytest.raises(TypeError, match="'b'.*float"):
        optim.apply_updates(params, {"w": updates["w"], "b": 1.0})


def test_mixed_dtypes_and_containers():
    class Pair(NamedTuple):
        weight: torch.Tensor
        bias: torch.Tensor

    gen = torch.Generator().manual_seed(0)
    params = {"layers": [Pair(torch.randn(3, 2, generator=gen), torch.randn(2, generator=gen)),
                         Pair(torch.randn(2, 2, generator=gen).double(),
                              torch.randn(2, generator=gen).double())],
              "scale": (torch.randn((), generator=gen),)}
    grads = pytree.tree_map(lambda p: torch.randn(p.shape, generator=gen).to(p.dtype), params)
    opt = optim.adamw(1e-2, weight_decay=0.1)
    updates, state = opt.update(grads, opt.init(params), params)
    assert isinstance(updates["layers"][1], Pair)
    assert updates["layers"][1].weight.dtype == torch.float64
    # each leaf equals the same optimizer run on that leaf alone (grouping by dtype is invisible)
    for path, p, g, u in zip(pytree.tree_paths(params), pytree.tree_leaves(params),
                             pytree.tree_leaves(grads), pytree.tree_leaves(updates), strict=True):
        alone, _ = opt.update({"x": g}, opt.init({"x": p}), {"x": p})
        assert torch.equal(alone["x"], u), path


def test_params_with_requires_grad_and_empty_trees():
    params = {"w": torch.randn(3, requires_grad=True)}
    grads = {"w": torch.ones(3)}
    opt = optim.adamw(0.1, weight_decay=0.1)
    updates, _ = opt.update(grads, opt.init(params), params)
    ref = opt.update(grads, opt.init(params), {"w": params["w"].detach()})[0]
    assert_close(updates["w"].detach(), ref["w"])
    empty_updates, state = opt.update({}, opt.init({}), {})
    assert empty_updates == {} and int(state.count) == 1
    assert float(optim.global_norm({})) == 0.0


def test_state_is_a_saveable_pytree_with_int64_count():
    params = {"w": torch.randn(2, 2), "b": torch.randn(2)}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    state = opt.init(params)
    _, state = opt.update(pytree.tree_map(torch.ones_like, params), state, params)
    assert all(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(state))
    assert state[1].count.dtype == torch.int64 and state[1].count.shape == ()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    grads = pytree.tree_map(torch.ones_like, params)
    assert_trees_equal(opt.update(grads, state, params)[0], opt.update(grads, loaded, params)[0])
