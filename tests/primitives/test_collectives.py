"""Collectives: forward and gradients equal a single-process reference.

Every rank's input is drawn in the test process; the ranks run the collective
and its gradient (torch.func.grad, grad_and_value, vjp and torch.autograd) on
the local world; the reference runs all ranks' computation in this process and
differentiates ``sum_r <cotangent_r, out_r>`` with autograd (JAX's rule).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from shardfn.testing import reference as ref

MESHES = {1: [{"x": 1}], 2: [{"x": 2}], 3: [{"x": 3}], 4: [{"x": 4}, {"a": 2, "b": 2}]}

# op -> (needs the chosen dim divisible by the axis size, reference forward)
OPS = {
    "psum": (False, lambda xs, g, kw: ref.ref_psum(xs, g)),
    "pmean": (False, lambda xs, g, kw: [y / len(g[0]) for y in ref.ref_psum(xs, g)]),
    "all_gather": (False, lambda xs, g, kw: ref.ref_all_gather(xs, g, kw["dim"])),
    "psum_scatter": (True, lambda xs, g, kw: ref.ref_psum_scatter(xs, g, kw["dim"])),
    "all_to_all": (True, lambda xs, g, kw: ref.ref_all_to_all(
        xs, g, kw["split_dim"], kw["concat_dim"])),
    "ppermute": (False, lambda xs, g, kw: ref.ref_ppermute(xs, g, kw["perm"])),
    "broadcast": (False, lambda xs, g, kw: ref.ref_broadcast(xs, g, kw["src"])),
}


@st.composite
def cases(draw, op: str):
    n = draw(st.integers(1, 4))
    shape = draw(st.sampled_from(MESHES[n]))
    names = list(shape)
    axis = draw(st.sampled_from(names + ([tuple(names)] if len(names) > 1 else [])))
    size = shape[axis] if isinstance(axis, str) else n
    ndim = draw(st.integers(1, 3))
    dims = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    kwargs: dict = {}
    if op in ("all_gather", "psum_scatter"):
        kwargs["dim"] = dim
    if op == "all_to_all":
        kwargs["split_dim"] = dim
        kwargs["concat_dim"] = draw(st.integers(-ndim, ndim - 1))
    if OPS[op][0]:
        dims[dim] *= size
    if op == "ppermute":
        dests = draw(st.permutations(range(size)))
        keep = draw(st.integers(0, size))
        kwargs["perm"] = [(s, d) for s, d in zip(range(size), dests, strict=True)][:keep]
    if op == "broadcast":
        kwargs["src"] = draw(st.integers(0, size - 1))
    seed = draw(st.integers(0, 2**16))
    return n, shape, axis, tuple(dims), kwargs, seed


def _on_rank(op, shape, axis, xs, cotangents, kwargs):
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = sf.Mesh(shape)
    x, cot = xs[rank], cotangents[rank]

    def f(x):
        return getattr(sf, op)(x, axis, mesh=mesh, **kwargs)

    def loss(x):
        return (f(x) * cot).sum()

    out = f(x)
    g_func = torch.func.grad(loss)(x)
    g_gv, value = torch.func.grad_and_value(loss)(x)
    _, vjp_fn = torch.func.vjp(f, x)
    (g_vjp,) = vjp_fn(cot)
    leaf = x.clone().requires_grad_()
    loss(leaf).backward()
    return out, {"grad": g_func, "grad_and_value": g_gv, "vjp": g_vjp, "autograd": leaf.grad}, value


def _check(worlds, op, case, ref_grads=None, replicated=None):
    """``replicated``: ``"x"`` (the inputs) or ``"cot"`` (the output cotangents) are made
    equal on every rank, as the op declares them (check mode verifies it, issue #23)."""
    n, shape, axis, dims, kwargs, seed = case
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(dims, generator=gen) for _ in range(n)]
    if replicated == "x":
        xs = [xs[0]] * n
    groups = ref.axis_groups(shape, axis)
    leaves = [x.clone().requires_grad_() for x in xs]
    ref_out = OPS[op][1](leaves, groups, kwargs) if op in OPS else None
    if ref_out is None:
        ref_out = ref_forward_invariant(op, leaves, groups)
    cotangents = [torch.randn(o.shape, generator=gen) for o in ref_out]
    if replicated == "cot":
        cotangents = [cotangents[0]] * n
    if ref_grads is None:
        total = sum((o * c).sum() for o, c in zip(ref_out, cotangents, strict=True))
        if not total.requires_grad:  # e.g. an empty ppermute: every output is zeros
            total = total + 0.0 * sum(x.sum() for x in leaves)
        ref_grads = torch.autograd.grad(total, leaves, allow_unused=True)
        ref_grads = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, ref_grads,
                                                                            strict=True)]
    else:
        ref_grads = ref_grads(cotangents, groups)
    results = worlds(n).run(_on_rank, op, shape, axis, xs, cotangents, kwargs)
    for rank, (out, grads, value) in enumerate(results):
        assert_close(out, ref_out[rank].detach(), msg=lambda m, r=rank: f"rank {r} forward: {m}")
        assert_close(value, (ref_out[rank] * cotangents[rank]).sum().detach())
        for how, g in grads.items():
            assert_close(g, ref_grads[rank], msg=lambda m, r=rank, h=how: f"rank {r} {h}: {m}")


def ref_forward_invariant(op, xs, groups):
    if op in ("psum_invariant", "pmean_invariant"):
        sums = ref.ref_psum(xs, groups)
        return sums if op == "psum_invariant" else [s / len(groups[0]) for s in sums]
    assert op == "pvary"
    return [x * 1.0 for x in xs]


@pytest.mark.parametrize("op", sorted(OPS))
def test_collective_matches_reference(worlds, op):
    @given(case=cases(op))
    def check(case):
        _check(worlds, op, case)

    check()


@pytest.mark.parametrize("op", ["psum_invariant", "pmean_invariant", "pvary"])
def test_invariant_forms(worlds, op):
    """psum_invariant/pmean_invariant: identity (scaled) backward; pvary: psum backward."""

    def grads(cotangents, groups):
        n = len(groups[0])
        if op == "psum_invariant":
            return cotangents
        if op == "pmean_invariant":
            return [c / n for c in cotangents]
        return ref.ref_psum(cotangents, groups)

    @given(case=cases("psum"))
    def check(case):
        _check(worlds, op, case, ref_grads=grads, replicated="x" if op == "pvary" else "cot")

    check()


def test_psum_gradient_rule_is_not_double_counted(worlds):
    """The classic data-parallel loss: pmean_invariant of local losses, grad = mean of grads."""

    def on_rank(xs):
        import torch.distributed as dist

        import shardfn as sf

        mesh = sf.Mesh({"dp": 4})
        w = torch.ones(3)
        x = xs[dist.get_rank()]

        def loss(w):
            return sf.pmean_invariant((x * w).sum() ** 2, "dp", mesh=mesh)

        def loss_varying(w):
            return sf.pmean((x * w).sum() ** 2, "dp", mesh=mesh)

        return torch.func.grad(loss)(w), torch.func.grad(loss_varying)(w)

    xs = [torch.randn(3) for _ in range(4)]
    w = torch.ones(3, requires_grad=True)
    expected = torch.autograd.grad(sum((x * w).sum() ** 2 for x in xs) / 4, w)[0]
    for rank, (g_inv, g_var) in enumerate(worlds(4).run(on_rank, xs)):
        x = xs[rank]
        own = torch.autograd.grad((x * w).sum() ** 2, w)[0]
        # invariant form: each rank's gradient of its share; psum of them is the true gradient
        assert_close(g_inv, own / 4)
        # varying form: per-rank output summed over ranks counts the mean 4 times
        assert_close(g_var, own)
    assert_close(sum(r[0] for r in worlds(4).run(on_rank, xs)), expected)


def test_vmap_over_collectives(worlds):
    def on_rank():
        import torch.distributed as dist

        import shardfn as sf

        mesh = sf.Mesh({"dp": 2})
        x = torch.arange(6.0).reshape(3, 2) + 10 * dist.get_rank()
        gathered = torch.func.vmap(lambda v: sf.all_gather(v, "dp", mesh=mesh))(x)
        summed = torch.func.vmap(lambda v: sf.psum(v, "dp", mesh=mesh), in_dims=1)(x)
        return gathered, summed

    (g0, s0), (g1, s1) = worlds(2).run(on_rank)
    x0, x1 = torch.arange(6.0).reshape(3, 2), torch.arange(6.0).reshape(3, 2) + 10
    assert_close(g0, torch.cat([x0, x1], dim=1))
    assert_close(s0, (x0 + x1).T)
    assert_close(g1, g0)
    assert_close(s1, s0)


def test_comm_stats_counts_ring_bytes(worlds):
    def on_rank():
        import shardfn as sf

        mesh = sf.Mesh({"dp": 4})
        sf.reset_comm_stats()
        x = torch.zeros(8)  # 32 bytes
        sf.psum(x, "dp", mesh=mesh)
        sf.all_gather(x, "dp", mesh=mesh)
        sf.psum_scatter(x, "dp", mesh=mesh)
        stats = sf.comm_stats()
        sf.reset_comm_stats()
        return stats, sf.comm_stats().total_bytes

    for stats, after_reset in worlds(4).run(on_rank):
        assert stats.by_op[("dp", "psum")] == 2 * 32 * 3 / 4
        assert stats.by_op[("dp", "all_gather")] == 4 * 32 * 3 / 4
        assert stats.by_op[("dp", "psum_scatter")] == 32 * 3 / 4
        assert stats.calls["dp"] == 3
        assert after_reset == 0


def test_collective_errors_name_the_axis(worlds):
    def on_rank():
        import shardfn as sf

        mesh = sf.Mesh({"dp": 2})
        errors = []
        for call in (
            lambda: sf.psum(torch.ones(2), "tp", mesh=mesh),
            lambda: sf.psum_scatter(torch.ones(3), "dp", mesh=mesh),
            lambda: sf.all_gather(torch.ones(2), "dp", dim=3, mesh=mesh),
            lambda: sf.ppermute(torch.ones(2), "dp", [(0, 1), (1, 1)], mesh=mesh),
            lambda: sf.psum({"w": 1.0}, "dp", mesh=mesh),
            lambda: sf.psum(torch.ones(2), "dp"),
        ):
            try:
                call()
                errors.append(None)
            except (ValueError, TypeError) as err:
                errors.append(str(err))
        return errors

    errors = worlds(2).run(on_rank)[0]
    assert "unknown mesh axis 'tp'" in errors[0]
    assert "divisible by the axis size 2" in errors[1]
    assert "dim 3 is out of range" in errors[2]
    assert "repeats a source or a destination" in errors[3]
    assert "leaf 'w'" in errors[4]
    assert "no mesh" in errors[5]


def test_mesh_context_and_single_process():
    """A world of one process: no process group, collectives are identities."""
    mesh = sf.Mesh({"dp": 1, "tp": 1})
    x = torch.randn(3)
    with mesh:
        assert_close(sf.psum(x, "dp"), x)
        assert_close(sf.all_gather(x, ("dp", "tp")), x)
        assert sf.axis_index("tp") == 0 and sf.axis_size(("dp", "tp")) == 1
    with pytest.raises(ValueError, match="no mesh"):
        sf.psum(x, "dp")


def test_zero_dim_and_zero_size_leaves(worlds):
    """0-dim leaves: a clear error where there is no dim to split or join (all_gather tiled,
    psum_scatter, all_to_all), a stack for all_gather(tiled=False); zero-size all_to_all keeps
    the right shape (it used to return the input's)."""

    def on_rank():
        import torch.distributed as dist

        import shardfn as sf

        rank = dist.get_rank()
        mesh = sf.Mesh({"x": 2})
        scalar = torch.tensor(float(rank + 1))
        errors = []
        for call in (
            lambda: sf.all_gather({"s": scalar}, "x", mesh=mesh),
            lambda: sf.psum_scatter({"s": scalar}, "x", mesh=mesh),
            lambda: sf.all_to_all({"s": scalar}, "x", 0, 0, mesh=mesh),
            lambda: sf.all_gather({"s": scalar}, "x", dim=1, tiled=False, mesh=mesh),
        ):
            try:
                call()
                errors.append(None)
            except ValueError as err:
                errors.append(str(err))
        stacked = sf.all_gather(scalar, "x", tiled=False, mesh=mesh)
        stacked_grad = torch.func.grad(
            lambda s: (sf.all_gather(s, "x", tiled=False, mesh=mesh) * torch.tensor([1., 2.])).sum()
        )(scalar)
        scalar_ops = [sf.psum(scalar, "x", mesh=mesh), sf.pmean(scalar, "x", mesh=mesh),
                      sf.ppermute(scalar, "x", [(0, 1)], mesh=mesh),
                      sf.broadcast(scalar, "x", src=1, mesh=mesh)]
        shapes = [tuple(sf.all_to_all(torch.zeros(shape), "x", s, c, mesh=mesh).shape)
                  for shape, s, c in [((0, 3), 0, 1), ((2, 0), 1, 0), ((2, 0), 0, 1),
                                      ((0, 4), 1, 1), ((0,), 0, 0)]]
        gathered = [tuple(sf.all_gather(torch.zeros(0, 3), "x", dim=d, mesh=mesh).shape)
                    for d in (0, 1)]
        return errors, stacked, stacked_grad, scalar_ops, shapes, gathered

    for rank, (errors, stacked, grad, scalar_ops, shapes, gathered) in enumerate(
            worlds(2).run(on_rank)):
        assert "all_gather over axis 'x': leaf 's' is a 0-dim tensor" in errors[0]
        assert "tiled=False" in errors[0]
        assert "psum_scatter over axis 'x': leaf 's' is a 0-dim tensor" in errors[1]
        assert "all_to_all over axis 'x': leaf 's' is a 0-dim tensor" in errors[2]
        assert "dim 1 is out of range" in errors[3] and "valid: -1..0" in errors[3]
        assert_close(stacked, torch.tensor([1.0, 2.0]))
        assert_close(grad, torch.tensor(2.0 * (rank + 1)))  # psum_scatter of [1, 2]: own entry x2
        assert_close(scalar_ops, [torch.tensor(3.0), torch.tensor(1.5),
                                  torch.tensor(1.0 if rank == 1 else 0.0), torch.tensor(2.0)])
        assert shapes == [(0, 6), (4, 0), (1, 0), (0, 4), (0,)]
        assert gathered == [(0, 3), (0, 6)]


def test_complex_leaves_forward_and_vjp(worlds):
    """Complex tensors work in every collective (gloo's all_to_all has no complex type: sent
    as the real view); forward and vjp equal the reference."""
    ops = {
        "psum": ({}, lambda xs, g: ref.ref_psum(xs, g)),
        "pmean": ({}, lambda xs, g: [y / 2 for y in ref.ref_psum(xs, g)]),
        "all_gather": ({"dim": 1}, lambda xs, g: ref.ref_all_gather(xs, g, 1)),
        "psum_scatter": ({"dim": 0}, lambda xs, g: ref.ref_psum_scatter(xs, g, 0)),
        "all_to_all": ({"split_dim": 0, "concat_dim": 1},
                       lambda xs, g: ref.ref_all_to_all(xs, g, 0, 1)),
        "ppermute": ({"perm": [(0, 1), (1, 0)]}, lambda xs, g: ref.ref_ppermute(xs, g,
                                                                               [(0, 1), (1, 0)])),
        "broadcast": ({"src": 1}, lambda xs, g: ref.ref_broadcast(xs, g, 1)),
    }
    gen = torch.Generator().manual_seed(0)
    groups = ref.axis_groups({"x": 2}, "x")
    xs = [torch.randn(4, 3, dtype=torch.complex64, generator=gen) for _ in range(2)]
    cases = {}
    for op, (kwargs, forward) in ops.items():
        leaves = [x.clone().requires_grad_() for x in xs]
        outs = forward(leaves, groups)
        cots = [torch.randn(o.shape, dtype=torch.complex64, generator=gen) for o in outs]
        grads = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]
        cases[op] = (kwargs, cots, [o.detach() for o in outs], grads)

    def on_rank(xs, cases):
        import torch.distributed as dist

        import shardfn as sf

        rank = dist.get_rank()
        mesh = sf.Mesh({"x": 2})
        out = {}
        for op, (kwargs, cots, _, _) in cases.items():
            y, vjp_fn = torch.func.vjp(lambda x, op=op, kw=kwargs: getattr(sf, op)(
                x, "x", mesh=mesh, **kw), xs[rank])
            out[op] = (y, vjp_fn(cots[rank])[0])
        return out

    for rank, out in enumerate(worlds(2).run(on_rank, xs, cases)):
        for op, (y, g) in out.items():
            assert y.dtype == torch.complex64, op
            assert_close(y, cases[op][2][rank], msg=lambda m, o=op: f"{o} forward: {m}")
            assert_close(g, cases[op][3][rank], msg=lambda m, o=op: f"{o} vjp: {m}")


def test_integer_and_bool_leaves(worlds):
    """Integers sum in their dtype; bools are counted (int64, like torch.sum); a mean of
    integers is a TypeError naming the leaf; copies keep the dtype."""

    def on_rank():
        import torch.distributed as dist

        import shardfn as sf

        rank = dist.get_rank()
        mesh = sf.Mesh({"x": 2})
        ints = torch.tensor([1, 2, 3, 4], dtype=torch.int32) * (rank + 1)
        flags = torch.tensor([True, False, True, rank == 1])
        out = {
            "psum int32": sf.psum(ints, "x", mesh=mesh),
            "psum bool": sf.psum(flags, "x", mesh=mesh),
            "psum bool, axis of 1": sf.psum(flags, "one", mesh=sf.Mesh({"x": 2, "one": 1})),
            "psum_scatter bool": sf.psum_scatter(flags, "x", mesh=mesh),
            "psum_invariant int64": sf.psum_invariant(ints.long(), "x", mesh=mesh),
            "all_gather bool": sf.all_gather(flags, "x", mesh=mesh),
            "all_to_all int32": sf.all_to_all(ints, "x", 0, 0, mesh=mesh),
            "ppermute bool": sf.ppermute(flags, "x", [(1, 0)], mesh=mesh),
            "broadcast int32": sf.broadcast(ints, "x", src=1, mesh=mesh),
        }
        errors = []
        for fn in (sf.pmean, sf.pmean_invariant):
            for leaf in (ints, flags):
                try:
                    fn({"n": leaf}, "x", mesh=mesh)
                    errors.append(None)
                except TypeError as err:
                    errors.append(str(err))
        return out, errors

    (out0, errors), (out1, _) = worlds(2).run(on_rank)
    ints = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    assert torch.equal(out0["psum int32"], 3 * ints)
    assert torch.equal(out0["psum bool"], torch.tensor([2, 0, 2, 1]))
    assert torch.equal(out0["psum bool, axis of 1"], torch.tensor([1, 0, 1, 0]))  # same dtype
    assert torch.equal(out0["psum_scatter bool"], torch.tensor([2, 0]))
    assert torch.equal(out1["psum_scatter bool"], torch.tensor([2, 1]))
    assert torch.equal(out0["psum_invariant int64"], 3 * ints.long())
    assert torch.equal(out0["all_gather bool"], torch.tensor([True, False, True, False,
                                                              True, False, True, True]))
    assert torch.equal(out0["all_to_all int32"], torch.tensor([1, 2, 2, 4], dtype=torch.int32))
    assert torch.equal(out0["ppermute bool"], torch.tensor([True, False, True, True]))
    assert torch.equal(out1["ppermute bool"], torch.zeros(4, dtype=torch.bool))
    assert torch.equal(out0["broadcast int32"], 2 * ints)
    for err in errors:
        assert err is not None and "leaf 'n'" in err and "Cast it first" in err


def test_check_mode_hook_once_per_call_before_leaf_validation(worlds):
    """Every public collective calls consistency.check_call once per call (not per leaf), with
    its static arguments, after validating, and not on an axis of one rank."""

    def on_rank():
        import shardfn as sf
        from shardfn.primitives import consistency

        calls = []
        original = consistency.check_call
        consistency.check_call = lambda op, ax, tree=None, **static: calls.append(
            (op, ax.names, sorted(tree) if isinstance(tree, dict) else None, static))
        mesh = sf.Mesh({"x": 2, "one": 1})
        tree = {"a": torch.ones(2, 4), "b": torch.ones(2, 2)}
        try:
            for op, kwargs in [("psum", {}), ("pmean", {}), ("psum_invariant", {}),
                               ("pmean_invariant", {}), ("pvary", {}),
                               ("all_gather", {"dim": 1, "tiled": False}),
                               ("psum_scatter", {"dim": 0, "tiled": True}),
                               ("all_to_all", {"split_dim": 0, "concat_dim": 1}),
                               ("ppermute", {"perm": [(0, 1)]}), ("broadcast", {"src": 1})]:
                getattr(sf, op)(tree, "x", mesh=mesh, **kwargs)
                getattr(sf, op)(tree, "one", mesh=mesh, **({"perm": [(0, 0)]} if op == "ppermute"
                                                            else {"src": 0} if op == "broadcast"
                                                            else kwargs))
            # backward collectives are not public calls: no hook
            torch.func.grad(lambda x: sf.all_gather(x, "x", mesh=mesh).sum())(torch.ones(2))
            for bad in (lambda: sf.psum_scatter(tree, "x", dim=5, mesh=mesh),
                        lambda: sf.all_to_all({"a": torch.ones(3)}, "x", 0, 0, mesh=mesh),
                        lambda: sf.ppermute(tree, "x", [(0, 2)], mesh=mesh),
                        lambda: sf.pmean({"a": torch.ones(2, dtype=torch.int64)}, "x",
                                         mesh=mesh)):
                try:
                    bad()
                except (ValueError, TypeError):
                    pass
        finally:
            consistency.check_call = original
        return calls

    calls = worlds(2).run(on_rank)[0]
    assert [c[0] for c in calls] == ["psum", "pmean", "psum_invariant", "pmean_invariant",
                                     "pvary", "all_gather", "psum_scatter", "all_to_all",
                                     "ppermute", "broadcast", "all_gather",
                                     # leaves are validated after the hook (a leaf bad on one
                                     # rank only must not leave the others waiting); static
                                     # arguments (the bad perm) before it
                                     "psum_scatter", "all_to_all", "pmean"]
    assert all(c[1] == ("x",) and c[2] == ["a", "b"] for c in calls[:10])
    assert calls[5][3] == {"dim": 1, "tiled": False}
    assert calls[6][3] == {"dim": 0, "tiled": True}
    assert calls[7][3] == {"split_dim": 0, "concat_dim": 1}
    assert calls[8][3] == {"perm": ((0, 1),)}
    assert calls[9][3] == {"src": 1}


def test_bad_static_arguments_are_refused_locally(worlds):
    """What one rank can see is wrong is refused there, before anything is sent."""

    def on_rank():
        import numpy

        import shardfn as sf

        mesh = sf.Mesh({"x": 2})
        errors = []
        for call in (
            lambda: sf.ppermute(torch.ones(2), "x", [(0, 1, 2)], mesh=mesh),
            lambda: sf.ppermute(torch.ones(2), "x", [(0.0, 1)], mesh=mesh),
            lambda: sf.ppermute(torch.ones(2), "x", [(0, -1)], mesh=mesh),
            lambda: sf.broadcast(torch.ones(2), "x", src=1.0, mesh=mesh),
            lambda: sf.broadcast(torch.ones(2), "x", src=2, mesh=mesh),
            lambda: sf.all_gather(torch.ones(2), "x", dim=True, mesh=mesh),
            lambda: sf.psum_scatter(torch.ones(3, 2), "x", dim=0, tiled=False, mesh=mesh),
            lambda: sf.ppermute(torch.ones(2), "x", 1, mesh=mesh),
        ):
            try:
                call()
                errors.append(None)
            except (ValueError, TypeError) as err:
                errors.append(f"{type(err).__name__}: {err}")
        # integers that are not Python ints (numpy, 0-dim tensors) are fine
        x = torch.ones(2)
        fine = [sf.ppermute(x, "x", [(numpy.int64(0), torch.tensor(1))], mesh=mesh),
                sf.all_gather(x, "x", dim=numpy.int32(0), mesh=mesh),
                sf.broadcast(x, "x", src=torch.tensor(1), mesh=mesh)]
        return errors, fine

    errors, fine = worlds(2).run(on_rank)[0]
    assert [tuple(t.shape) for t in fine] == [(2,), (4,), (2,)]
    assert errors[0].startswith("TypeError") and "(src, dst) pairs" in errors[0]
    assert errors[1].startswith("TypeError") and "(src, dst) pairs" in errors[1]
    assert errors[2].startswith("ValueError") and "index -1" in errors[2]
    assert errors[3].startswith("TypeError") and "src must be an int" in errors[3]
    assert errors[4].startswith("ValueError") and "valid: 0..1" in errors[4]
    assert errors[5].startswith("TypeError") and "dim must be an int" in errors[5]
    assert errors[6].startswith("ValueError") and "needs dim 0 of size 2" in errors[6]
    assert errors[7].startswith("TypeError") and "perm is a sequence" in errors[7]


def _fp16_means(value: float):
    import torch.distributed as dist

    import shardfn as sf

    mesh = sf.Mesh({"x": dist.get_world_size()})
    x = torch.full((3,), value, dtype=torch.float16)
    mean = sf.pmean(x, "x", mesh=mesh)
    invariant = sf.pmean_invariant(x, "x", mesh=mesh)
    return mean, invariant


@pytest.mark.parametrize("n, value", [(2, 40000.0), (4, 30000.0)])
def test_fp16_pmean_of_a_mean_that_fits_does_not_overflow(worlds, n, value):
    # a plain sum first would give inf (2 * 40000 > 65504); FSDP2's pre/post division doesn't
    for mean, invariant in worlds(n).run(_fp16_means, value):
        expected = torch.full((3,), value, dtype=torch.float16)
        assert_close(mean, expected)
        assert_close(invariant, expected)


def test_gather_and_scatter_along_a_later_dim_are_row_major(worlds):
    """all_gather / psum_scatter along dim != 0 give contiguous results, as torch.cat does,
    so ``.view`` on them works like on the unsharded value."""

    def on_rank():
        mesh = sf.Mesh({"dp": 2})
        x = torch.arange(12.0).reshape(2, 3, 2) + 100 * mesh.index("dp")
        gathered = sf.all_gather(x, "dp", dim=2, mesh=mesh)
        scattered = sf.psum_scatter(x.repeat(1, 1, 2), "dp", dim=2, mesh=mesh)
        return (gathered.is_contiguous(), scattered.is_contiguous(), gathered.view(-1),
                scattered.view(-1))

    results = worlds(2).run(on_rank)
    xs = [torch.arange(12.0).reshape(2, 3, 2) + 100 * r for r in range(2)]
    whole = torch.cat(xs, dim=2)
    summed = (xs[0] + xs[1]).repeat(1, 1, 2)
    for r, (g_ok, s_ok, gathered, scattered) in enumerate(results):
        assert g_ok and s_ok
        assert_close(gathered, whole.reshape(-1))
        assert_close(scattered, summed[:, :, 2 * r:2 * r + 2].reshape(-1))
