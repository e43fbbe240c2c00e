"""Collectives under torch.func.vmap composed with grad / vjp / jacrev: the reference, every time.

Every collective on a 1-D mesh ({"x": 2}) and a 2-D one ({"a": 2, "b": 2}, over one
axis and over both), each transform 20 times in one run() call: a wrong backward
under vmap used to be random (torch's per-example fallback for
``_c10d_functional`` ops raced the other ranks), so one lucky run proves nothing.

The reference runs in the test process on every rank's inputs: the loss is
``sum_r <sin(f_r(x)), c_r>`` (JAX's rule: a per-rank output's gradient is that of
the sum over ranks), its gradient ``T(cos(F(x)) * c)`` with ``T`` the collective's
transpose, and the double backward autograd through that. ``T`` is autograd of the
reference forward; for the invariant forms the reference forward is a pair of
Functions with the stated rules (psum_invariant: backward pvary, pvary: backward
psum_invariant), so their second derivatives follow the transpose-of-transpose
rule too (exact where the cotangents are replicated, as they are for an HVP).
Forward mode (``vmap(jvp)``, ``hessian`` = jacfwd of jacrev) is checked the same way:
a collective is linear, so its jvp is the reference forward of the tangents.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from shardfn.testing import reference as ref

REPEATS = 20  # vmap(grad) of psum: the issue's repro
# vmap(grad), vmap(vjp), grad(vmap) of every collective, every mesh: the matrix's repeats
# (5: the matrix took 55 s of the suite at 20; the repro above keeps 20)
MATRIX_REPEATS = 5
FEW = 1  # the other transforms (and the forward)
BATCH = 3
ACCEPTANCE = ("vmap(grad)", "vmap(vjp)", "grad(vmap)")

# case name -> (public collective, kwargs for an axis of size n); example shape (n, 2n)
OPS = {
    "psum": ("psum", lambda n: {}),
    "pmean": ("pmean", lambda n: {}),
    "psum_invariant": ("psum_invariant", lambda n: {}),
    "pmean_invariant": ("pmean_invariant", lambda n: {}),
    "pvary": ("pvary", lambda n: {}),
    "all_gather": ("all_gather", lambda n: {"dim": 1}),
    "all_gather_untiled": ("all_gather", lambda n: {"dim": -1, "tiled": False}),
    "psum_scatter": ("psum_scatter", lambda n: {"dim": 1}),
    "psum_scatter_untiled": ("psum_scatter", lambda n: {"dim": 0, "tiled": False}),
    "all_to_all": ("all_to_all", lambda n: {"split_dim": 1, "concat_dim": 0}),
    "all_to_all_same_dim": ("all_to_all", lambda n: {"split_dim": 0, "concat_dim": 0}),
    "ppermute_partial": ("ppermute", lambda n: {"perm": [(i, (i + 1) % n) for i in range(n - 1)]}),
    "broadcast": ("broadcast", lambda n: {"src": n - 1}),
}

CONFIGS = [(2, {"x": 2}, "x"), (4, {"a": 2, "b": 2}, "a"), (4, {"a": 2, "b": 2}, ("a", "b"))]


def _modes(f):
    """Transform name -> fn(xb, cb, vb) giving per-example results stacked on dim 0."""
    from torch.func import grad, hessian, jacrev, jvp, vjp, vmap

    def loss(x, c):
        return (torch.sin(f(x)) * c).sum()

    def grad_grad(x, c, v):
        return grad(lambda x: (grad(loss)(x, c) * v).sum())(x)

    def autograd_grad_grad(x, c, v):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss(leaf, c), leaf, create_graph=True)
        return torch.autograd.grad((g * v).sum(), leaf)[0]

    def grad_vmap_moved(xb, cb):
        def total(xm):
            return (torch.sin(vmap(f, in_dims=1, out_dims=1)(xm)) * cb.movedim(0, 1)).sum()

        return grad(total)(xb.movedim(0, 1)).movedim(1, 0)

    return {
        "forward": lambda xb, cb, vb: vmap(f)(xb),
        "vmap(grad)": lambda xb, cb, vb: vmap(grad(loss))(xb, cb),
        "vmap(grad) in_dims=1": lambda xb, cb, vb: vmap(grad(loss), in_dims=(1, 1))(
            xb.movedim(0, 1), cb.movedim(0, 1)),
        "vmap(grad) x unbatched": lambda xb, cb, vb: vmap(grad(loss), in_dims=(None, 0))(
            xb[0], cb),
        "vmap(vjp)": lambda xb, cb, vb: vmap(
            lambda x, c: vjp(lambda x: torch.sin(f(x)), x)[1](c)[0])(xb, cb),
        "grad(vmap)": lambda xb, cb, vb: grad(
            lambda xb: (torch.sin(vmap(f)(xb)) * cb).sum())(xb),
        "grad(vmap) dims moved": lambda xb, cb, vb: grad_vmap_moved(xb, cb),
        "jacrev": lambda xb, cb, vb: jacrev(f)(xb[0]),
        "vmap(grad(grad))": lambda xb, cb, vb: vmap(grad_grad)(xb, cb, vb),
        "autograd double backward": lambda xb, cb, vb: autograd_grad_grad(xb[0], cb[0], vb[0]),
        "vmap(jvp)": lambda xb, cb, vb: vmap(lambda x, t: jvp(f, (x,), (t,))[1])(xb, vb),
        "hessian": lambda xb, cb, vb: hessian(lambda x: loss(x, cb[0]))(xb[0]),
    }


def _on_rank(shape, axis, cases, inputs):
    """Every case's transforms on this rank: case -> mode -> repeats; and any fallback warning."""
    import warnings

    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank()
    mesh = sf.Mesh(shape)
    out = {}
    # check mode (on in local worlds) doubles the time of ~1000 small calls; the hook itself is
    # tested in test_collectives.py, and the other tests here run with it on
    sf.check_consistency(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case, (name, kwargs) in cases.items():
            xb, cb, vb = (t[rank] for t in inputs[case])

            def f(x, name=name, kwargs=kwargs):
                return getattr(sf, name)(x, axis, mesh=mesh, **kwargs)

            out[case] = {mode: [fn(xb, cb, vb) for _ in range(
                MATRIX_REPEATS if mode in ACCEPTANCE else FEW)]
                         for mode, fn in _modes(f).items()}
    return out, [str(w.message) for w in caught if "batching rule" in str(w.message)]


# ---- the single-process reference ------------------------------------------------------


class _RefPsumInvariant(torch.autograd.Function):
    """Group sums of per-rank tensors; backward :class:`_RefPvary` (identity, differentiable)."""

    @staticmethod
    def forward(ctx, groups, *xs):
        ctx.groups = groups
        return tuple(ref.ref_psum(xs, groups))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_RefPvary.apply(ctx.groups, *grads))


class _RefPvary(torch.autograd.Function):
    """Identity on per-rank tensors; backward :class:`_RefPsumInvariant`."""

    @staticmethod
    def forward(ctx, groups, *xs):
        ctx.groups = groups
        return tuple(x.clone() for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_RefPsumInvariant.apply(ctx.groups, *grads))


def _ref_forward(name, kwargs, xs, groups):
    n = len(groups[0])
    if name == "psum":
        return ref.ref_psum(xs, groups)
    if name == "pmean":
        return [s / n for s in ref.ref_psum(xs, groups)]
    if name == "psum_invariant":
        return list(_RefPsumInvariant.apply(groups, *xs))
    if name == "pmean_invariant":
        return [s / n for s in _RefPsumInvariant.apply(groups, *xs)]
    if name == "pvary":
        return list(_RefPvary.apply(groups, *xs))
    if name == "all_gather":
        if kwargs.get("tiled", True):
            return ref.ref_all_gather(xs, groups, kwargs["dim"])
        return [torch.stack([xs[s] for s in groups[r]], kwargs["dim"]) for r in range(len(xs))]
    if name == "psum_scatter":
        out = ref.ref_psum_scatter(xs, groups, kwargs["dim"])
        return out if kwargs.get("tiled", True) else [o.squeeze(kwargs["dim"]) for o in out]
    if name == "all_to_all":
        return ref.ref_all_to_all(xs, groups, kwargs["split_dim"], kwargs["concat_dim"])
    if name == "ppermute":
        return ref.ref_ppermute(xs, groups, kwargs["perm"])
    assert name == "broadcast"
    return ref.ref_broadcast(xs, groups, kwargs["src"])


def _ref_transpose(name, kwargs, us, groups, example):
    """The collective's transpose applied to per-rank cotangents ``us`` (differentiable)."""
    points = [torch.zeros_like(e, requires_grad=True) for e in example]
    outs = _ref_forward(name, kwargs, points, groups)
    total = sum((o * u).sum() for o, u in zip(outs, us, strict=True))
    grads = torch.autograd.grad(total, points, create_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(points, grads, strict=True)]


def _ref_grad(name, kwargs, xs, cs, groups):
    us = [torch.cos(y) * c for y, c in zip(_ref_forward(name, kwargs, xs, groups), cs, strict=True)]
    return _ref_transpose(name, kwargs, us, groups, xs)


def _ref_grad_grad(name, kwargs, xs, cs, vs, groups):
    leaves = [x.clone().requires_grad_() for x in xs]
    g = _ref_grad(name, kwargs, leaves, cs, groups)
    total = sum((gi * v).sum() for gi, v in zip(g, vs, strict=True))
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [torch.zeros_like(x) if h is None else h for x, h in zip(xs, grads, strict=True)]


def _reference(name, kwargs, inputs, groups):
    """Mode -> per-rank expected result (stacked over the batch like the ranks' results)."""
    xb, cb, vb = inputs
    world = len(xb)

    def per_example(fn):
        rows = [fn([t[b] for t in xb], [t[b] for t in cb], [t[b] for t in vb])
                for b in range(BATCH)]
        return [torch.stack([row[r] for row in rows]) for r in range(world)]

    def grads(xs, cs, vs):
        return _ref_grad(name, kwargs, xs, cs, groups)

    example_x = [t[0] for t in xb]
    out_shape = _ref_forward(name, kwargs, example_x, groups)[0].shape
    basis = torch.eye(out_shape.numel()).reshape(-1, *out_shape)
    jac = [torch.stack(per) for per in zip(*(
        _ref_transpose(name, kwargs, [e] * world, groups, example_x) for e in basis),
        strict=True)]
    in_shape = example_x[0].shape
    first_c = [t[0] for t in cb]

    def grad_at(*xs):
        return tuple(_ref_grad(name, kwargs, list(xs), first_c, groups))

    # hessian = jacfwd(jacrev): column s is the derivative of the gradient along e_s on
    # every rank at once (the ranks' forward-mode tangents are all the same basis vector)
    columns = [torch.autograd.functional.jvp(grad_at, tuple(example_x), (e,) * world)[1]
               for e in torch.eye(in_shape.numel()).reshape(-1, *in_shape)]
    hess = [torch.stack([col[r] for col in columns], -1).reshape(*in_shape, *in_shape)
            for r in range(world)]
    per_rank_grads = per_example(grads)
    return {
        "forward": per_example(lambda xs, cs, vs: _ref_forward(name, kwargs, xs, groups)),
        "vmap(grad)": per_rank_grads,
        "vmap(grad) in_dims=1": per_rank_grads,
        "vmap(grad) x unbatched": per_example(
            lambda xs, cs, vs: _ref_grad(name, kwargs, example_x, cs, groups)),
        "vmap(vjp)": per_rank_grads,
        "grad(vmap)": per_rank_grads,
        "grad(vmap) dims moved": per_rank_grads,
        "jacrev": [j.reshape(*out_shape, *example_x[0].shape) for j in jac],
        "vmap(grad(grad))": per_example(
            lambda xs, cs, vs: _ref_grad_grad(name, kwargs, xs, cs, vs, groups)),
        "autograd double backward": [h for h in _ref_grad_grad(
            name, kwargs, example_x, [t[0] for t in cb], [t[0] for t in vb], groups)],
        "vmap(jvp)": per_example(lambda xs, cs, vs: _ref_forward(name, kwargs, vs, groups)),
        "hessian": hess,
    }


@pytest.mark.parametrize("world,shape,axis", CONFIGS, ids=["x", "a of a,b", "a+b"])
def test_collective_transforms_match_reference_every_time(worlds, world, shape, axis):
    groups = ref.axis_groups(shape, axis)
    n = len(groups[0])
    cases, inputs, expected = {}, {}, {}
    for seed, case in enumerate(sorted(OPS)):
        name, make_kwargs = OPS[case]
        cases[case] = (name, make_kwargs(n))
        gen = torch.Generator().manual_seed(seed)
        xb = [torch.randn(BATCH, n, 2 * n, generator=gen) for _ in range(world)]
        out_shape = _ref_forward(name, cases[case][1], [x[0] for x in xb], groups)[0].shape
        cb = [torch.randn(BATCH, *out_shape, generator=gen) for _ in range(world)]
        vb = [torch.randn(BATCH, n, 2 * n, generator=gen) for _ in range(world)]
        inputs[case] = (xb, cb, vb)
        expected[case] = _reference(name, cases[case][1], inputs[case], groups)

    results = worlds(world).run(_on_rank, shape, axis, cases, inputs)
    for rank, (out, fallbacks) in enumerate(results):
        assert not fallbacks, f"rank {rank}: per-example fallback used: {fallbacks[:1]}"
        for case, modes in out.items():
            assert set(modes) == set(expected[case])
            for mode, repeats in modes.items():
                for i, got in enumerate(repeats):
                    assert_close(got, expected[case][mode][rank], msg=lambda m, r=rank, c=case,
                                 md=mode, k=i: f"{c} on rank {r}, {md}, repeat {k}: {m}")


def test_psum_vmap_of_grad_issue_repro(worlds):
    """The issue's repro: vmap(grad) of psum on {"x": 2} gives 2 * cotangent, 20 times out of 20."""

    def on_rank():
        import torch.distributed as dist

        import shardfn as sf

        rank = dist.get_rank()
        xb, ctb = torch.ones(3, 4) * (rank + 1), torch.arange(12.0).reshape(3, 4)
        with sf.Mesh({"x": 2}):
            fn = torch.func.vmap(torch.func.grad(lambda x, c: (sf.psum(x, "x") * c).sum()))
            return [fn(xb, ctb) for _ in range(REPEATS)]

    for per_rank in worlds(2).run(on_rank):
        for got in per_rank:
            assert_close(got, 2 * torch.arange(12.0).reshape(3, 4))


def test_vmap_records_one_batched_collective(worlds):
    """Under vmap(grad) each collective (forward and backward) is one call of the batched size."""

    def on_rank():
        import shardfn as sf

        mesh = sf.Mesh({"x": 2})
        xb = torch.ones(3, 4)  # 3 examples of 16 bytes: 48 bytes a call
        sf.reset_comm_stats()
        torch.func.vmap(torch.func.grad(
            lambda x: sf.all_gather(x, "x", mesh=mesh).sum()))(xb)
        stats = sf.comm_stats()
        sf.reset_comm_stats()
        return stats

    for stats in worlds(2).run(on_rank):
        assert stats.calls["x"] == 2
        assert stats.by_op[("x", "all_gather")] == 48  # B_in * (N - 1)
        assert stats.by_op[("x", "psum_scatter")] == 96 * 1 / 2  # B_in (96) * (N - 1) / N
