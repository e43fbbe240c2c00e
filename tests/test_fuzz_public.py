"""Fuzz the public API with malformed and mismatched input: right answer or a clear error.

Hypothesis draws a mesh, a collective (or ``shard``/``gather``), an axis, static
arguments and every rank's input tree, some of them malformed (unknown axes,
out-of-range dims and sources, bad permutations, None and non-tensor leaves,
0-dim and zero-size tensors, complex and integer dtypes) or mismatched between
ranks (another shape, dtype, tree or permutation on one rank). The ranks run the
call in check mode. Each example must end in exactly one of two ways:

* every rank returns, the inputs were consistent, and each rank's result equals
  the single-process reference; or
* every rank raises a ``ValueError``/``TypeError`` raised by shardfn itself (the
  innermost frame is in the ``shardfn`` package), with a message.

Anything else fails the test: a result from inconsistent inputs, a wrong
number, another exception type (an internal traceback), a rank that crashed or
a hang past the check mode's timeout (the local world's run timeout turns it
into an error).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from shardfn.testing import reference as ref

CHECK_TIMEOUT_S = 3.0
RUN_TIMEOUT_S = 60.0

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.bool,
          torch.complex64]
OPS = ["psum", "pmean", "psum_invariant", "pmean_invariant", "pvary", "all_gather",
       "psum_scatter", "all_to_all", "ppermute", "broadcast"]


# ---- running a case on every rank --------------------------------------------------


def _outcome(fn, *args) -> tuple:
    """``("ok", value)`` or ``("error", type name, message, raised in shardfn, traceback)``."""
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - classified below
        frames = traceback.extract_tb(e.__traceback__)
        inner = frames[-1].filename if frames else ""
        ours = "/shardfn/" in inner.replace("\\", "/") and "/shardfn/testing/" not in inner
        return ("error", type(e).__name__, str(e), ours, traceback.format_exc())


def _with_check(fn, *args):
    from shardfn.primitives import consistency

    before = consistency.check_timeout()
    sf.check_consistency(True, timeout=CHECK_TIMEOUT_S)
    try:
        return _outcome(fn, *args)
    finally:
        sf.check_consistency(True, timeout=before)


def _build(spec: Any) -> Any:
    """A leaf description -> a value: ``("t", shape, dtype, seed)`` is a tensor."""
    if isinstance(spec, tuple) and spec and spec[0] == "t":
        _, shape, dtype, seed = spec
        g = torch.Generator().manual_seed(seed)
        if dtype.is_complex:
            return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) * (1 + 2j)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        if not dtype.is_floating_point:
            return torch.randint(-50, 50, shape, generator=g).to(dtype)
        return torch.randn(shape, generator=g).to(dtype)
    if isinstance(spec, dict):
        return {k: _build(v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_build(v) for v in spec]
    return spec


def _call(op: str, mesh_axes: dict, axis: Any, static: dict, trees: list) -> Any:
    """Run on each rank: build the mesh and this rank's input, call the collective."""
    rank = _rank()
    mesh = sf.Mesh(mesh_axes)
    tree = _build(trees[rank])
    return getattr(sf, op)(tree, axis, mesh=mesh, **static)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# ---- strategies ----------------------------------------------------------------------


@st.composite
def leaf_specs(draw, ndim_min: int = 0):
    ndim = draw(st.integers(ndim_min, 3))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES[:1] * 4 + DTYPES))
    return ("t", shape, dtype, draw(st.integers(0, 2**16)))


@st.composite
def collective_cases(draw):
    n = draw(st.sampled_from([2, 3]))
    op = draw(st.sampled_from(OPS))
    axis = draw(st.sampled_from(["x"] * 6 + ["nope", 3, None, ("x",)]))
    base = draw(st.one_of(
        leaf_specs(),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), leaf_specs(), min_size=1, max_size=2),
        st.just({"a": None}), st.just({"a": 1.5}), st.just([("t", (2,), torch.float32, 1), "s"]),
    ))
    trees = [base] * n
    # per-rank differences: another seed always (values differ), sometimes a mismatch
    trees = [_reseed(t, r) for r, t in enumerate(trees)]
    mismatch = draw(st.sampled_from([None] * 4 + ["shape", "dtype", "tree"]))
    if mismatch is not None:
        bad = draw(st.integers(0, n - 1))
        trees[bad] = _mismatch(trees[bad], mismatch)
    static: dict = {}
    if op in ("all_gather", "psum_scatter"):
        static["dim"] = draw(st.integers(-4, 3))
        static["tiled"] = draw(st.booleans())
    if op == "all_to_all":
        static["split_dim"] = draw(st.integers(-3, 3))
        static["concat_dim"] = draw(st.integers(-3, 3))
    if op == "ppermute":
        static["perm"] = draw(st.one_of(
            st.just([(i, (i + 1) % n) for i in range(n)]),
            st.just([(0, 1)]), st.just([(0, 1), (1, 1)]), st.just([(0, n)]),
            st.just([]),
        ))
    if op == "broadcast":
        static["src"] = draw(st.sampled_from([0, n - 1, n, -1]))
    return n, op, axis, static, trees


def _reseed(spec, salt: int):
    if isinstance(spec, tuple) and spec and spec[0] == "t":
        return ("t", spec[1], spec[2], spec[3] + 7919 * salt)
    if isinstance(spec, dict):
        return {k: _reseed(v, salt) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_reseed(v, salt) for v in spec]
    return spec


def _mismatch(spec, kind: str):
    if isinstance(spec, tuple) and spec and spec[0] == "t":
        _, shape, dtype, seed = spec
        if kind == "shape":
            return ("t", shape + (2,), dtype, seed)
        if kind == "dtype":
            return ("t", shape, torch.int32 if dtype != torch.int32 else torch.float32, seed)
        return {"extra": spec}
    if isinstance(spec, dict):
        if kind == "tree":
            return {**spec, "zz": ("t", (2,), torch.float32, 5)}
        return {k: _mismatch(v, kind) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_mismatch(v, kind) for v in spec] if kind != "tree" else spec[:1]
    return spec


# ---- the reference -------------------------------------------------------------------


def _reference(op: str, n: int, static: dict, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    groups = ref.axis_groups({"x": n}, "x")
    if op in ("psum", "psum_invariant") and xs[0].dtype == torch.bool:
        xs = [x.long() for x in xs]  # bools are counted, as torch.sum counts them
    if op in ("psum", "psum_invariant"):
        return ref.ref_psum(xs, groups)
    if op in ("pmean", "pmean_invariant"):
        return [y / n for y in ref.ref_psum(xs, groups)]
    if op == "pvary":
        return list(xs)
    if op == "all_gather":
        if static["tiled"]:
            return ref.ref_all_gather(xs, groups, static["dim"])
        return [torch.stack(xs, dim=static["dim"])] * n
    if op == "psum_scatter":
        if static["tiled"]:
            return ref.ref_psum_scatter(xs, groups, static["dim"])
        total = sum(xs[1:], xs[0])
        return [b.squeeze(static["dim"]) for b in total.chunk(n, dim=static["dim"])]
    if op == "all_to_all":
        return ref.ref_all_to_all(xs, groups, static["split_dim"], static["concat_dim"])
    if op == "ppermute":
        return ref.ref_ppermute(xs, groups, static["perm"])
    if op == "broadcast":
        return ref.ref_broadcast(xs, groups, static["src"])
    raise AssertionError(op)


def _check_outcomes(outcomes: list[tuple], case) -> None:
    n, op, axis, static, trees = case
    kinds = {o[0] for o in outcomes}
    for r, o in enumerate(outcomes):
        if o[0] == "error":
            _, kind, message, ours, tb = o
            assert kind in ("ValueError", "TypeError", "ConsistencyError"), (
                f"rank {r}: {op} raised {kind}, not a clear ValueError/TypeError:\n{tb}")
            assert ours, f"rank {r}: {op}'s {kind} came from outside shardfn:\n{tb}"
            assert message.strip(), f"rank {r}: {op} raised {kind} with no message"
    assert kinds == {"ok"} or kinds == {"error"}, (
        f"{op}: some ranks returned and others raised: {[o[:3] for o in outcomes]}")
    if kinds == {"error"}:
        return
    assert len({repr(_shape_tree(t)) for t in trees}) == 1, (
        f"{op} returned a result although the ranks' inputs differ: {trees}")
    per_rank = [_build(t) for t in trees]
    import optree

    leaves = [optree.tree_leaves(t, namespace="shardfn") for t in per_rank]
    outs = [optree.tree_leaves(o[1], namespace="shardfn") for o in outcomes]
    for i in range(len(leaves[0])):
        expected = _reference(op, n, static, [leaves[r][i] for r in range(n)])
        for r in range(n):
            got, want = outs[r][i], expected[r]
            assert_close(got, want.to(got.dtype) if op.startswith("pmean") else want,
                         msg=lambda m, r=r: f"rank {r}, {op} {static}: {m}",
                         **_tolerance(got.dtype))


def _tolerance(dtype: torch.dtype) -> dict:
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 1e-2, "atol": 1e-2}
    return {}


def _shape_tree(spec):
    if isinstance(spec, tuple) and spec and spec[0] == "t":
        return (spec[1], spec[2])
    if isinstance(spec, dict):
        return {k: _shape_tree(v) for k, v in sorted(spec.items())}
    if isinstance(spec, list):
        return [_shape_tree(v) for v in spec]
    return spec


@settings(max_examples=40, deadline=None)
@given(collective_cases())
def test_collectives_give_the_reference_or_a_clear_error(worlds, case):
    n, op, axis, static, trees = case
    outcomes = worlds(n).run(_with_check, _call, op, {"x": n}, axis, static, trees,
                             timeout=RUN_TIMEOUT_S)
    _check_outcomes(outcomes, case)


# ---- meshes, specs and shard/gather ----------------------------------------------------


@st.composite
def shard_cases(draw):
    n = draw(st.sampled_from([1, 2, 3]))
    mesh_axes = draw(st.sampled_from([{"x": n}, {"x": n, "y": 1}]))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    part = st.sampled_from([None, "x", "y", "nope", ("x", "y"), ("x", "x")])
    spec = draw(st.one_of(
        st.builds(lambda ps: sf.P(*ps), st.lists(part, max_size=4)),
        st.just(None), st.just("x"), st.just(3),
    ))
    tree_kind = draw(st.sampled_from(["tensor", "dict", "none-leaf", "int-leaf"]))
    layout = draw(st.booleans())
    return n, mesh_axes, shape, spec, tree_kind, layout, draw(st.integers(0, 2**16))


def _shard_round_trip(mesh_axes, shape, spec, tree_kind, layout, seed):
    mesh = sf.Mesh(mesh_axes)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    tree = {"tensor": x, "dict": {"w": x}, "none-leaf": {"w": x, "b": None},
            "int-leaf": {"w": x, "b": 3}}[tree_kind]
    specs = spec if tree_kind == "tensor" else {"w": spec, **({} if tree_kind == "dict" else
                                                                {"b": sf.P()})}
    if layout:
        specs = sf.layout_of(tree, specs)
    local = sf.shard(tree, specs, mesh)
    return tree, sf.gather(local, specs, mesh)


@settings(max_examples=30, deadline=None)
@given(shard_cases())
def test_shard_then_gather_is_exact_or_a_clear_error(worlds, case):
    n, mesh_axes, shape, spec, tree_kind, layout, seed = case
    outcomes = worlds(n).run(_with_check, _shard_round_trip, mesh_axes, shape, spec, tree_kind,
                             layout, seed, timeout=RUN_TIMEOUT_S)
    kinds = {o[0] for o in outcomes}
    for r, o in enumerate(outcomes):
        if o[0] == "error":
            assert o[1] in ("ValueError", "TypeError", "ConsistencyError"), (
                f"rank {r}: shard/gather raised {o[1]}:\n{o[4]}")
            assert o[3], f"rank {r}: the {o[1]} came from outside shardfn:\n{o[4]}"
    assert kinds in ({"ok"}, {"error"}), [o[:3] for o in outcomes]
    if kinds == {"ok"}:
        for tree, full in (o[1] for o in outcomes):
            import optree

            for a, b in zip(optree.tree_leaves(tree, namespace="shardfn"),
                            optree.tree_leaves(full, namespace="shardfn"), strict=True):
                assert_close(b, a)


@pytest.mark.parametrize("axes", [
    {}, [], {"dp": 0}, {"dp": -1}, {"dp": 2.0}, {"": 1}, {1: 1}, {"dp": True}, {"dp": 3},
    "dp", None,
])
def test_bad_meshes_are_refused(axes):
    with pytest.raises((TypeError, ValueError)) as info:
        sf.Mesh(axes)
    assert str(info.value)
