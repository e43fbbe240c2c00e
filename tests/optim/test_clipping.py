"""clip_by_global_norm matches torch.nn.utils.clip_grad_norm_; sharded norms psum per axis set."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_cases import clone_tree, random_tree, tree_shapes
from torch.testing import assert_close

import shardfn
import shardfn.primitives
from shardfn import optim, pytree
from shardfn.spec import P

TOL = dict(rtol=1e-6, atol=1e-7)


def torch_clipped(grads, max_norm):
    leaves = [g.clone().requires_grad_(False) for g in pytree.tree_leaves(grads)]
    holders = [torch.zeros_like(g, requires_grad=True) for g in leaves]
    for h, g in zip(holders, leaves, strict=True):
        h.grad = g
    norm = torch.nn.utils.clip_grad_norm_(holders, max_norm)
    return [h.grad for h in holders], norm


@settings(max_examples=20, deadline=None)
@given(shapes=tree_shapes(), max_norm=st.sampled_from([1e-4, 0.1, 1.0, 3.0, 1e3]),
       scale=st.sampled_from([1e-4, 0.01, 1.0, 10.0]), seed=st.integers(0, 2**16))
def test_clip_matches_torch(shapes, max_norm, scale, seed):
    grads = random_tree(shapes, torch.Generator().manual_seed(seed), scale)
    expected, expected_norm = torch_clipped(grads, max_norm)
    opt = optim.clip_by_global_norm(max_norm)
    clipped, _ = opt.update(grads, opt.init(grads))
    assert_close(optim.global_norm(grads), expected_norm, **TOL)
    for name, ours, ref in zip(pytree.tree_paths(clipped), pytree.tree_leaves(clipped), expected,
                               strict=True):
        assert_close(ours, ref, **TOL, msg=lambda m, name=name: f"leaf {name}: {m}")


@settings(max_examples=15, deadline=None)
@given(shapes=tree_shapes(), seed=st.integers(0, 2**16))
def test_replicated_specs_without_mesh_equal_unsharded(shapes, seed):
    # every spec replicated (P(), None, prefix entries): no psum, same norm as no specs
    grads = random_tree(shapes, torch.Generator().manual_seed(seed))
    specs = {key: (P() if i % 2 else None) for i, key in enumerate(grads)}
    opt = optim.clip_by_global_norm(0.5, specs=specs, mesh=None)
    ours, _ = opt.update(grads, opt.init(grads))
    plain = optim.clip_by_global_norm(0.5)
    ref, _ = plain.update(grads, plain.init(grads))
    for a, b in zip(pytree.tree_leaves(ours), pytree.tree_leaves(ref), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(optim.global_norm(grads, P()), optim.global_norm(grads))


def test_sharded_norm_psums_once_per_axis_set(monkeypatch):
    # Fake a mesh {"dp": 2, "tp": 3} where every rank holds identical local shards: the
    # global sum of squares of a leaf sharded over axes A is local * prod(size[A]), and a
    # replicated leaf counts once. A psum per leaf, or psum-ing replicated leaves, fails.
    sizes = {"dp": 2, "tp": 3}
    calls = []

    def fake_psum(x, axis, *, mesh=None):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        calls.append(axes)
        return x * math.prod(sizes[a] for a in axes)

    monkeypatch.setattr(shardfn.primitives, "psum", fake_psum)
    gen = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen),
             "c": torch.randn(2, 2, generator=gen), "d": torch.randn(3, generator=gen),
             "e": torch.randn(6, 2, generator=gen)}
    specs = {"a": P("dp", None), "b": P("dp"), "c": P(None, ("dp", "tp")), "d": None,
             "e": P("tp", None)}
    factor = {"a": 2, "b": 2, "c": 6, "d": 1, "e": 3}
    expected = math.sqrt(sum(factor[k] * float(g.double().square().sum())
                             for k, g in grads.items()))
    norm = optim.global_norm(grads, specs, mesh="fake")
    assert_close(norm, torch.tensor(expected, dtype=torch.float32), **TOL)
    assert sorted(calls) == [("dp",), ("dp", "tp"), ("tp",)]


def test_clip_does_not_mutate_and_handles_prefix_spec_errors():
    grads = {"a": torch.full((3,), 10.0), "b": {"c": torch.ones(2)}}
    before = clone_tree(grads)
    opt = optim.clip_by_global_norm(1.0)
    clipped, _ = opt.update(grads, opt.init(grads))
    assert torch.equal(grads["a"], before["a"]) and torch.equal(grads["b"]["c"], before["b"]["c"])
    assert_close(optim.global_norm(clipped), torch.tensor(1.0), rtol=1e-5, atol=0)
    bad = optim.clip_by_global_norm(1.0, specs={"a": None, "b": "dp"})
    with pytest.raises(ValueError, match="b.c"):
        bad.update(grads, bad.init(grads))
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(-1.0)


def test_sharded_over_adds_its_axis_to_every_leaf(monkeypatch):
    # Inside sharded_over("dp") (ZeRO: each rank holds a disjoint part of every leaf) every
    # leaf's sum of squares is psum-ed over "dp" as well as over its own spec's axes.
    calls = []

    def fake_psum(x, axis, *, mesh=None):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        calls.append((axes, mesh))
        return x * {("dp",): 2, ("dp", "tp"): 6}[axes]

    monkeypatch.setattr(shardfn.primitives, "psum", fake_psum)
    grads = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    mesh = shardfn.Mesh({"dp": 1, "tp": 1})
    with optim.sharded_over("dp", mesh):
        norm = optim.global_norm(grads, {"a": None, "b": P("tp")})
        clipped, _ = optim.clip_by_global_norm(1.0).update(grads, optim.EmptyState())
    assert_close(norm, torch.tensor(math.sqrt(2 * 9.0 + 6 * 16.0)))
    assert [c[0] for c in calls[:2]] == [("dp",), ("dp", "tp")] and calls[0][1] is mesh
    assert_close(clipped["a"], torch.tensor([3.0]) / (math.sqrt(2 * 25.0) + 1e-6))
    # a rank whose local part is empty still joins the same psums (else the others hang)
    calls.clear()
    with optim.sharded_over("dp", mesh):
        empty_norm = optim.global_norm({"a": torch.zeros(0), "b": torch.zeros(0)},
                                       {"a": None, "b": P("tp")})
        optim.global_norm({})
    assert float(empty_norm) == 0.0
    assert [c[0] for c in calls] == [("dp",), ("dp", "tp"), ("dp",)]
    assert optim.global_norm(grads) == 5.0  # the context is gone


def test_clip_coefficient_includes_torch_epsilon():
    grads = {"g": torch.tensor([3e-4, 4e-4])}  # norm 5e-4: the 1e-6 shows at 2e-3 relative
    clipped, _ = optim.clip_by_global_norm(1e-4).update(grads, optim.EmptyState())
    assert_close(clipped["g"], grads["g"] * (1e-4 / (5e-4 + 1e-6)), rtol=1e-6, atol=0)
