"""Partition specs: gather(shard(x)) == x for random specs, shapes (uneven) and meshes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf

MESHES = [{"x": 1}, {"x": 2}, {"x": 3}, {"x": 4}, {"a": 2, "b": 2}, {"a": 1, "b": 3}]


@st.composite
def spec_cases(draw):
    shape = draw(st.sampled_from(MESHES))
    names = list(shape)
    parts = names + [tuple(names)] if len(names) > 1 else names
    n_leaves = draw(st.integers(1, 3))
    leaves, specs = {}, {}
    for i in range(n_leaves):
        ndim = draw(st.integers(0, 3))
        dims = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
        spec_len = draw(st.integers(0, ndim))
        used: set = set()
        spec = []
        for _ in range(spec_len):
            part = draw(st.sampled_from([None, *parts]))
            axes = set() if part is None else {part} if isinstance(part, str) else set(part)
            if axes & used:
                part = None
            used |= axes
            spec.append(part)
        leaves[f"w{i}"] = dims
        specs[f"w{i}"] = sf.P(*spec)
    return shape, leaves, specs, draw(st.integers(0, 2**16))


def _shard_and_gather(shape, tree, specs):
    import shardfn as sf

    mesh = sf.Mesh(shape)
    local = sf.shard(tree, specs, mesh)
    layouts = sf.layout_of(tree, specs)
    for name, x in local.items():
        assert tuple(x.shape) == sf.local_shape(tree[name].shape, specs[name], mesh)
    return local, sf.gather(local, layouts, mesh)


@given(case=spec_cases())
def test_gather_of_shard_is_identity(worlds, case):
    shape, dims, specs, seed = case
    gen = torch.Generator().manual_seed(seed)
    tree = {k: torch.randn(d, generator=gen) for k, d in dims.items()}
    n = math.prod(shape.values())
    results = worlds(n).run(_shard_and_gather, shape, tree, specs)
    for rank, (_local, full) in enumerate(results):
        for name in tree:
            assert_close(full[name], tree[name], msg=lambda m, r=rank, k=name: f"rank {r} {k}: {m}")


def test_uneven_shard_pads_with_zeros_and_gather_drops_padding():
    mesh = sf.Mesh({"dp": 1})
    x = torch.arange(5.0)
    assert_close(sf.gather(sf.shard(x, sf.P("dp"), mesh), sf.layout_of(x, sf.P("dp")), mesh), x)


def test_uneven_shard_on_three_ranks(worlds):
    x = torch.arange(7.0)

    def on_rank(x):
        import shardfn as sf

        mesh = sf.Mesh({"dp": 3})
        local = sf.shard(x, sf.P("dp"), mesh)
        return local, sf.gather(local, sf.P("dp"), mesh), sf.gather(local, sf.layout_of(x, sf.P(
            "dp")), mesh)

    results = worlds(3).run(on_rank, x)
    assert [r[0].tolist() for r in results] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]
    assert results[0][1].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0]  # bare P: padded length
    assert_close(results[2][2], x)  # Layout: exact


def test_spec_tree_may_be_a_prefix():
    mesh = sf.Mesh({"dp": 1})
    tree = {"a": {"w": torch.ones(2, 2), "b": torch.ones(2)}, "c": torch.ones(3)}
    local = sf.shard(tree, {"a": sf.P("dp"), "c": None}, mesh)
    assert_close(local, tree)


def test_bad_specs_name_the_leaf():
    mesh = sf.Mesh({"dp": 1})
    tree = {"w": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"leaf 'w'.*has 3 entries.*rank 2"):
        sf.shard(tree, {"w": sf.P("dp", None, None)}, mesh)
    with pytest.raises(ValueError, match=r"leaf 'w'.*axis 'tp'.*axes: \('dp',\)"):
        sf.shard(tree, {"w": sf.P("tp")}, mesh)
    with pytest.raises(ValueError, match=r"leaf 'w'.*uses axis 'dp' twice"):
        sf.shard(tree, {"w": sf.P("dp", "dp")}, mesh)
    with pytest.raises(ValueError, match="not a prefix"):
        sf.shard(tree, {"v": sf.P()}, mesh)
    with pytest.raises(TypeError, match="axis name"):
        sf.P(3)
    with pytest.raises(ValueError, match=r"leaf 'w'.*local shard has shape"):
        sf.gather(tree, {"w": sf.Layout(sf.P("dp"), (5, 2))}, mesh)


def test_p_semantics():
    assert sf.P("dp", None) == sf.P("dp")
    assert sf.P(("dp",)) == sf.P("dp")
    assert sf.spec_axes(sf.P(("a", "b"), None, "c")) == ("a", "b", "c")
    assert hash(sf.P("dp", None)) == hash(sf.P("dp"))
    assert repr(sf.P("dp", None)) == "P('dp', None)"


def test_mesh_errors():
    with pytest.raises(ValueError, match="multiply to the world size"):
        sf.Mesh({"dp": 2})
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        sf.Mesh({"dp": 1}).size("tp")
    with pytest.raises(ValueError, match="repeat"):
        sf.Mesh({"dp": 1}).size(("dp", "dp"))
    with pytest.raises(TypeError):
        sf.Mesh({})


def test_mesh_layout_is_row_major(worlds):
    def on_rank():
        import torch.distributed as dist

        import shardfn as sf

        mesh = sf.Mesh({"a": 2, "b": 2})
        sub = mesh.submesh(["b"])
        return (dist.get_rank(), mesh.index("a"), mesh.index("b"), mesh.index(("a", "b")),
                mesh.group_ranks("a"), mesh.group_ranks("b"), sub.ranks,
                mesh.index(("b", "a")))

    for rank, a, b, ab, ga, gb, sub, ba in worlds(4).run(on_rank):
        assert (a, b) == divmod(rank, 2)
        assert ab == rank == ba  # tuple axes are taken in mesh order
        assert ga == [b, b + 2] and gb == [2 * a, 2 * a + 1]
        assert list(sub) == gb
