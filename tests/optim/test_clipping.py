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


# ---- ord 1 / 2 / inf, clip_grads (the norm comes back), sharded trees on real worlds ----

ORDS = [1, 2, math.inf, "inf"]


def torch_clipped_ord(grads, max_norm, ord):
    """torch.nn.utils.clip_grad_norm_(norm_type=ord) on the leaves of the full tree."""
    leaves = [g.clone() for g in pytree.tree_leaves(grads)]
    holders = [torch.zeros_like(g, requires_grad=True) for g in leaves]
    for h, g in zip(holders, leaves, strict=True):
        h.grad = g
    norm_type = math.inf if ord == "inf" else float(ord)
    norm = torch.nn.utils.clip_grad_norm_(holders, max_norm, norm_type=norm_type)
    return [h.grad for h in holders], norm


def full_norm(grads, ord):
    """The reference: torch.linalg.vector_norm of every element of the tree, concatenated."""
    flat = torch.cat([g.reshape(-1).double() for g in pytree.tree_leaves(grads)])
    return torch.linalg.vector_norm(flat, math.inf if ord == "inf" else float(ord))


def with_negative_extreme(grads, generator):
    """Make the element of largest |g| negative and larger than any other: a max(g) instead of
    max(|g|), or zero padding taken for a value, gives the wrong inf-norm."""
    leaves = pytree.tree_leaves(grads)
    i = int(torch.randint(len(leaves), (), generator=generator))
    flat = leaves[i].view(-1)
    flat[int(torch.randint(flat.numel(), (), generator=generator))] = -(
        max(float(g.abs().max()) for g in leaves) + 1.0)
    return grads


@settings(max_examples=20, deadline=None)
@given(shapes=tree_shapes(), ord=st.sampled_from(ORDS),
       max_norm=st.sampled_from([1e-3, 0.5, 2.0, 1e3]), seed=st.integers(0, 2**16))
def test_ord_norms_and_clip_grads_match_torch_unsharded(shapes, ord, max_norm, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = with_negative_extreme(random_tree(shapes, gen), gen)
    before = clone_tree(grads)
    expected, expected_norm = torch_clipped_ord(grads, max_norm, ord)
    assert_close(optim.global_norm(grads, ord=ord), full_norm(grads, ord).float(), **TOL)
    clipped, norm = optim.clip_grads(grads, max_norm, ord=ord)
    assert_close(norm, expected_norm, **TOL)
    for name, ours, ref in zip(pytree.tree_paths(clipped), pytree.tree_leaves(clipped), expected,
                               strict=True):
        assert_close(ours, ref, **TOL, msg=lambda m, name=name: f"leaf {name}: {m}")
    opt = optim.clip_by_global_norm(max_norm, ord=ord)
    via_opt, _ = opt.update(grads, opt.init(grads))
    for a, b in zip(pytree.tree_leaves(via_opt), pytree.tree_leaves(clipped), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(pytree.tree_leaves(grads), pytree.tree_leaves(before), strict=True):
        assert torch.equal(a, b)  # clip_grads is pure


def test_the_three_norms_differ_and_count_each_element_once():
    grads = {"a": torch.tensor([3.0, -4.0]), "b": torch.tensor([[-12.0]])}
    assert float(optim.global_norm(grads, ord=1)) == 19.0
    assert float(optim.global_norm(grads, ord=2)) == 13.0
    assert float(optim.global_norm(grads, ord=math.inf)) == 12.0
    assert float(optim.global_norm(grads, ord="inf")) == 12.0
    clipped, norm = optim.clip_grads(grads, 6.0, ord="inf")
    assert float(norm) == 12.0
    assert_close(clipped["b"], torch.tensor([[-12.0 * 6.0 / (12.0 + 1e-6)]]), rtol=1e-7, atol=0)
    # an empty local part has max |g| = 0 (not an error) and an int leaf is frozen
    assert float(optim.global_norm({"e": torch.zeros(0), "i": torch.tensor([-7])}, ord="inf")) == 0
    assert float(optim.global_norm({}, ord=1)) == 0.0
    assert float(optim.clip_grads({}, 1.0, ord=math.inf)[1]) == 0.0


@pytest.mark.parametrize("bad", [3, 0, -1, 0.5, "fro", "nuc", "2", -math.inf, True, None, [2]])
def test_bad_ord_is_refused_naming_the_valid_ones(bad):
    grads = {"a": torch.ones(2)}
    with pytest.raises(ValueError, match=r"ord must be 1, 2 or inf"):
        optim.global_norm(grads, ord=bad)
    with pytest.raises(ValueError, match=r"ord must be 1, 2 or inf"):
        optim.clip_by_global_norm(1.0, ord=bad)  # at construction, not at the first update
    with pytest.raises(ValueError, match=r"ord must be 1, 2 or inf"):
        optim.clip_grads(grads, 1.0, ord=bad)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_grads(grads, -1.0)


def test_ord_1_psums_and_ord_inf_gathers_once_per_axis_set(monkeypatch):
    # Fake mesh {"dp": 2, "tp": 3}, identical local shards on every rank: ord 1 multiplies a
    # leaf's sum |g| by prod(size[A]); ord inf takes the max of the gathered local maxima. A
    # replicated leaf is not reduced; every rank issues the same collectives, sorted by axis set.
    sizes = {"dp": 2, "tp": 3}
    calls = []

    def fake_psum(x, axis, *, mesh=None):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        calls.append(("psum", axes))
        return x * math.prod(sizes[a] for a in axes)

    def fake_all_gather(x, axis, *, dim=0, tiled=True, mesh=None):
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        calls.append(("all_gather", axes))
        assert not tiled and x.dim() == 0
        n = math.prod(sizes[a] for a in axes)  # the other ranks' maxima: a smaller one, and 0
        return torch.stack([x, x / 2] + [torch.zeros_like(x)] * (n - 2))

    monkeypatch.setattr(shardfn.primitives, "psum", fake_psum)
    monkeypatch.setattr(shardfn.primitives, "all_gather", fake_all_gather)
    gen = torch.Generator().manual_seed(1)
    grads = {"a": torch.randn(4, 3, generator=gen), "c": torch.randn(2, 2, generator=gen),
             "d": torch.randn(3, generator=gen), "e": torch.randn(6, 2, generator=gen)}
    specs = {"a": P("dp", None), "c": P(None, ("dp", "tp")), "d": None, "e": P("tp", None)}
    factor = {"a": 2, "c": 6, "d": 1, "e": 3}
    expected_1 = sum(factor[k] * float(g.double().abs().sum()) for k, g in grads.items())
    assert_close(optim.global_norm(grads, specs, mesh="fake", ord=1),
                 torch.tensor(expected_1, dtype=torch.float32), **TOL)
    assert calls == [("psum", ("dp",)), ("psum", ("dp", "tp")), ("psum", ("tp",))]
    calls.clear()
    expected_inf = max(float(g.abs().max()) for g in grads.values())
    assert float(optim.global_norm(grads, specs, mesh="fake", ord="inf")) == expected_inf
    assert calls == [("all_gather", ("dp",)), ("all_gather", ("dp", "tp")),
                     ("all_gather", ("tp",))]
    # a rank with empty local parts joins the same gathers, in the same order
    calls.clear()
    empty = {k: torch.zeros(0) for k in grads}
    assert float(optim.global_norm(empty, specs, mesh="fake", ord=math.inf)) == 0.0
    assert calls == [("all_gather", ("dp",)), ("all_gather", ("dp", "tp")),
                     ("all_gather", ("tp",))]
    # inside sharded_over("dp") every leaf is also gathered over dp
    calls.clear()
    with optim.sharded_over("dp", "fake"):
        optim.clip_grads(grads, 1.0, {**dict.fromkeys(grads), "e": P("tp", None)}, ord="inf")
    assert calls == [("all_gather", ("dp",)), ("all_gather", ("dp", "tp"))]


MESHES = {1: [{"dp": 1}], 2: [{"dp": 2}, {"dp": 2, "tp": 1}, {"dp": 1, "tp": 2}],
          3: [{"dp": 3}], 4: [{"dp": 4}, {"dp": 2, "tp": 2}]}


@st.composite
def sharded_case(draw):
    """A world size, a 1-D or 2-D mesh, a tree of shapes (uneven dims too) and a spec per leaf."""
    n = draw(st.integers(1, 4))
    mesh_axes = draw(st.sampled_from(MESHES[n]))
    shapes = draw(tree_shapes())
    names = list(mesh_axes)
    parts = [None, *names, *([tuple(names)] if len(names) == 2 else [])]

    def spec_for(shape):
        kind = draw(st.sampled_from(["P", "P", "P", "Layout", "None"]))
        if kind == "None":
            return None
        entries, used = [], set()
        for _ in range(draw(st.integers(0, len(shape)))):
            part = draw(st.sampled_from(parts))
            axes = set() if part is None else ({part} if isinstance(part, str) else set(part))
            if axes & used:
                part = None
            used |= axes
            entries.append(part)
        return (kind, tuple(entries))

    specs = pytree.tree_map(spec_for, shapes, is_leaf=lambda x: isinstance(x, tuple) and all(
        isinstance(d, int) for d in x))
    return n, mesh_axes, shapes, specs


def _sharded_norms(mesh_axes, full, spec_desc, expected_clipped, max_norm):
    import shardfn as sf
    from shardfn import optim as sf_optim

    mesh = sf.Mesh(dict(mesh_axes))
    layouts = sf.layout_of(full, pytree.tree_map(
        lambda d: sf.P() if d is None else sf.P(*d[1]), spec_desc,
        is_leaf=lambda d: d is None or (isinstance(d, tuple) and d[0] in ("P", "Layout"))))
    specs = pytree.tree_map(
        lambda d, lay: None if d is None else (lay if d[0] == "Layout" else sf.P(*d[1])),
        spec_desc, layouts,
        is_leaf=lambda d: d is None or (isinstance(d, tuple) and d[0] in ("P", "Layout")))
    shards = sf.shard(full, layouts, mesh)
    out = {}
    for ord in ORDS:
        norm = sf_optim.global_norm(shards, specs, mesh, ord=ord)
        clipped, total = sf_optim.clip_grads(shards, max_norm, specs, mesh, ord=ord)
        out[str(ord)] = (norm, total, clipped, sf.shard(expected_clipped[str(ord)], layouts, mesh))
    return out


@settings(max_examples=25, deadline=None)
@given(case=sharded_case(), max_norm=st.sampled_from([1e-2, 1.0, 1e3]),
       seed=st.integers(0, 2**16))
def test_sharded_norms_equal_the_full_tree_and_clip_grads_matches_torch(worlds, case, max_norm,
                                                                        seed):
    n, mesh_axes, shapes, spec_desc = case
    gen = torch.Generator().manual_seed(seed)
    full = with_negative_extreme(random_tree(shapes, gen), gen)
    treedef = pytree.tree_flatten(full)[1]
    expected, expected_norms = {}, {}
    for ord in ORDS:
        leaves, expected_norms[str(ord)] = torch_clipped_ord(full, max_norm, ord)
        expected[str(ord)] = pytree.tree_unflatten(treedef, leaves)
        assert_close(expected_norms[str(ord)], full_norm(full, ord).float(), **TOL)
    results = worlds(n).run(_sharded_norms, tuple(mesh_axes.items()), full, spec_desc, expected,
                            max_norm)
    for rank, result in enumerate(results):
        for ord in ORDS:
            norm, total, clipped, expected_shards = result[str(ord)]
            where = f"rank {rank}, mesh {mesh_axes}, ord {ord}"
            assert_close(norm, full_norm(full, ord).float(), **TOL,
                         msg=lambda m, where=where: f"global_norm, {where}: {m}")
            assert_close(total, expected_norms[str(ord)], **TOL,
                         msg=lambda m, where=where: f"clip_grads norm, {where}: {m}")
            assert torch.equal(total, results[0][str(ord)][1]), f"{where}: norms differ by rank"
            for name, ours, ref in zip(pytree.tree_paths(clipped), pytree.tree_leaves(clipped),
                                       pytree.tree_leaves(expected_shards), strict=True):
                assert_close(ours, ref, **TOL,
                             msg=lambda m, name=name, where=where: f"leaf {name}, {where}: {m}")
