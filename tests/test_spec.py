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
    bare = {}
    for name in tree:  # a bare P: the exact tensor or a ValueError, never a padded one
        try:
            bare[name] = sf.gather(local[name], specs[name], mesh)
        except ValueError as err:
            bare[name] = str(err)
    return local, sf.gather(local, layouts, mesh), bare


@given(case=spec_cases())
def test_gather_of_shard_is_identity(worlds, case):
    shape, dims, specs, seed = case
    gen = torch.Generator().manual_seed(seed)
    tree = {k: torch.randn(d, generator=gen) for k, d in dims.items()}
    n = math.prod(shape.values())
    results = worlds(n).run(_shard_and_gather, shape, tree, specs)
    for rank, (_local, full, bare) in enumerate(results):
        for name in tree:
            assert_close(full[name], tree[name], msg=lambda m, r=rank, k=name: f"rank {r} {k}: {m}")
            sharded = [d for d, part in enumerate(specs[name]) if part is not None
                       and math.prod(shape[a] for a in sf.spec_axes(sf.P(part))) > 1
                       and tree[name].shape[d] > 0]
            if sharded:
                assert isinstance(bare[name], str) and "leaf '<root>'" in bare[name], bare[name]
                assert f"dim {sharded[0]}" in bare[name] and "sf.layout_of" in bare[name]
            else:
                assert_close(bare[name], tree[name])


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
        return local, sf.gather(local, sf.P("dp"), mesh, padded=True), sf.gather(
            local, sf.layout_of(x, sf.P("dp")), mesh)

    results = worlds(3).run(on_rank, x)
    assert [r[0].tolist() for r in results] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]
    assert results[0][1].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0]  # padded=True: padded length
    assert_close(results[2][2], x)  # Layout: exact


@pytest.mark.parametrize("size", [7, 9])
def test_gather_with_a_bare_p_on_a_sharded_dim_refuses(worlds, size):
    """gather(shard(x, P), P) used to return 9 rows for 7 without a word; now it names the leaf.

    An even split (9 over 3) is refused too: from the shards alone 7, 8 and 9 rows look
    the same, so gather cannot tell and never guesses.
    """

    def on_rank(x):
        import shardfn as sf

        mesh = sf.Mesh({"dp": 3, "r": 1})
        local = sf.shard({"w": x, "b": x}, {"w": sf.P(None, "dp"), "b": sf.P(None, "r")}, mesh)
        try:
            sf.gather(local, {"w": sf.P(None, "dp"), "b": sf.P(None, "r")}, mesh)
        except ValueError as err:
            message = str(err)
        exact = sf.gather(local, sf.layout_of({"w": x, "b": x}, {"w": sf.P(None, "dp"),
                                                                 "b": sf.P(None, "r")}), mesh)
        only_unsharded = sf.gather(local["b"], sf.P(None, "r"), mesh)  # axis of size 1: exact
        return message, exact, only_unsharded

    x = torch.randn(2, size)
    for message, exact, only_unsharded in worlds(3).run(on_rank, x):
        assert "leaf 'w'" in message and "dim 1" in message and "'dp'" in message
        assert "sf.layout_of" in message and "padded=True" in message
        assert_close(exact, {"w": x, "b": x})
        assert_close(only_unsharded, x)


def test_none_leaves_pass_through_shard_gather_and_layout_of():
    """A None value leaf is an empty subtree (JAX): kept as None whatever P or None covers it."""
    mesh = sf.Mesh({"dp": 1})
    x = torch.randn(3, 2)
    tree = {"w": x, "b": None, "blocks": [None, {"v": x}]}
    for specs in ({"w": sf.P("dp"), "b": sf.P(), "blocks": sf.P("dp")},
                  {"w": sf.P("dp"), "b": None, "blocks": None}, sf.P("dp"), None):
        local = sf.shard(tree, specs, mesh)
        assert local["b"] is None and local["blocks"][0] is None
        layouts = sf.layout_of(tree, specs)
        assert layouts["b"] is None and layouts["blocks"][0] is None
        for back in (sf.gather(local, specs, mesh), sf.gather(local, layouts, mesh)):
            assert back["b"] is None and back["blocks"][0] is None
            assert_close(back["w"], x)
            assert_close(back["blocks"][1]["v"], x)


def test_non_tensor_leaves_and_layout_mismatches_name_the_leaf():
    mesh = sf.Mesh({"dp": 1})
    x = torch.randn(3, 2)
    with pytest.raises(TypeError, match=r"shard: leaf 'b' is a int, not a Tensor"):
        sf.shard({"w": x, "b": 3}, sf.P(), mesh)
    with pytest.raises(TypeError, match=r"gather: leaf 'b' is a str"):
        sf.gather({"w": x, "b": "s"}, sf.P(), mesh)
    with pytest.raises(TypeError, match=r"layout_of: leaf 'b' is a float"):
        sf.layout_of({"w": x, "b": 1.0}, sf.P())
    layout = sf.Layout(sf.P("dp"), (3, 2))
    with pytest.raises(TypeError, match=r"leaf 'b' is None but its spec .* shape \(3, 2\)"):
        sf.shard({"w": x, "b": None}, {"w": layout, "b": layout}, mesh)
    with pytest.raises(TypeError, match=r"leaf 'b' is None"):
        sf.gather({"w": x, "b": None}, {"w": layout, "b": layout}, mesh)
    with pytest.raises(ValueError, match=r"shard: leaf 'w' has shape \(3, 2\).*\(4, 2\)"):
        sf.shard({"w": x}, {"w": sf.Layout(sf.P("dp"), (4, 2))}, mesh)


def test_shard_checks_that_the_input_is_replicated(worlds):
    """sf.shard calls the check-mode hook once, over all mesh axes, with the whole tree."""

    def on_rank():
        import contextlib

        import shardfn as sf
        from shardfn.primitives import consistency

        calls = []
        original = consistency.check_replicated
        consistency.check_replicated = lambda what, ax, tree: calls.append((what, ax.names,
                                                                            ax.size, tree))
        try:
            mesh = sf.Mesh({"a": 2, "b": 1})
            tree = {"w": torch.ones(4, 2), "b": None}
            sf.shard(tree, {"w": sf.P("a"), "b": None}, mesh)
            with contextlib.suppress(ValueError):
                sf.shard(tree, {"w": sf.P("nope")}, mesh)  # refused before the hook
            sf.shard(tree, sf.P(), mesh)
        finally:
            consistency.check_replicated = original
        return [(what, names, size, sorted(t)) for what, names, size, t in calls]

    for calls in worlds(2).run(on_rank):
        assert calls == [("sf.shard input", ("a", "b"), 2, ["b", "w"])] * 2


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
