"""``dp.grad_and_value``: the pure data-parallel gradient with its reduction overlapped.

It must be bitwise ``dp.reduce_grads(sf.grad_and_value(fn)(...))`` (the same bucket plan,
the same sums) and hence the one-process full-batch gradient, for any world size,
containers, ``argnums``/``has_aux``/``weight=``, leaves that get no gradient on some
ranks and tied leaves; under ``torch.compile`` it is that composition; and the first
bucket's reduction must start while the backward still runs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transforms import _models


def _loss(params, extra, batch):
    """_models' loss, a second differentiated tree (a tuple), a leaf ("rare") that only
    ranks whose first input is positive use, and one no rank uses ("unused")."""
    x, y = batch
    loss = _models.loss_fn(params, batch) + (extra[0] * x[:, :1]).square().mean()
    if x[0, 0] > 0:
        loss = loss + params["rare"].square().sum()
    return loss, {"rows": torch.tensor(float(x.shape[0])), "mean_x": x.mean()}


def _params(shape, seed):
    params = _models.init_params(*shape, seed)
    params["rare"] = torch.linspace(-1, 1, 5)
    params["unused"] = torch.ones(2, 2)
    return params, (torch.tensor([0.5, -1.0]),)


def _global_batch(rows, vocab, seed):
    x, y = _models.make_batch(rows, vocab, seed)
    x[0, 0] = abs(x[0, 0]) + 1  # rank 0 uses "rare"; the others as their x says
    return x, y


def _rank_rows(rows: int, n: int, rank: int, uneven: bool) -> slice:
    """This rank's rows: equal shares, or ``rank + 1`` parts of ``n (n + 1) / 2``."""
    if not uneven:
        share = rows // n
        return slice(rank * share, (rank + 1) * share)
    unit = rows // (n * (n + 1) // 2)
    start = unit * rank * (rank + 1) // 2
    return slice(start, start + unit * (rank + 1))


def _on_rank(n, shape, seed, bucket_bytes, argnums, has_aux, uneven, rows):
    import shardfn as sf

    mesh = sf.Mesh({"dp": n})
    rank = mesh.index("dp")
    dp = sf.data_parallel(mesh, "dp", bucket_bytes=bucket_bytes)
    params, extra = _params(shape, seed)
    x, y = _global_batch(rows, shape[0], seed)
    mine = _rank_rows(rows, n, rank, uneven)
    batch = (x[mine], y[mine])

    def fn(params, extra, batch):
        loss, aux = _loss(params, extra, batch)
        return (loss, aux) if has_aux else loss

    weight = (lambda params, extra, batch: batch[0].shape[0]) if uneven else None
    got = dp.grad_and_value(fn, argnums, has_aux, weight=weight)(params, extra, batch)
    grads, value = sf.grad_and_value(fn, argnums, has_aux)(params, extra, batch)
    want = dp.reduce_grads(grads, weight=mine.stop - mine.start if uneven else None), value
    return got, want, params["rare"].clone()


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), vocab=st.integers(3, 9), d=st.integers(1, 4),
       bucket_bytes=st.sampled_from([4, 24, 100, 2**20]),
       argnums=st.sampled_from([0, (0, 1), (1, 0)]), has_aux=st.booleans(),
       uneven=st.booleans(), seed=st.integers(0, 2**16))
def test_bitwise_reduce_grads_and_the_full_batch_gradient(worlds, n, vocab, d, bucket_bytes,
                                                         argnums, has_aux, uneven, seed):
    shape, rows = (vocab, d, 3), 2 * n * (n + 1)
    results = worlds(n).run(_on_rank, n, shape, seed, bucket_bytes, argnums, has_aux, uneven, rows)
    for got, want, _ in results:
        # bitwise, leaf by leaf, with the same structure, values and aux
        assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(want)
        for a, b in zip(torch.utils._pytree.tree_leaves(got),
                        torch.utils._pytree.tree_leaves(want), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    # every rank holds the same averaged gradients; "unused" gets zeros
    grads = [r[0][0] for r in results]
    for g in grads[1:]:
        for a, b in zip(torch.utils._pytree.tree_leaves(grads[0]),
                        torch.utils._pytree.tree_leaves(g), strict=True):
            assert torch.equal(a, b)
    tree = grads[0] if isinstance(argnums, int) else grads[0][argnums.index(0)]
    assert torch.equal(tree["unused"], torch.zeros(2, 2))
    # the one-process full-batch gradient of the model's loss (the "rare" and "extra" terms
    # differ per rank by design; the model leaves do not depend on them)
    params, _ = _params(shape, seed)
    full = torch.func.grad(_models.loss_fn)(
        {k: v for k, v in params.items() if k not in ("rare", "unused")},
        _global_batch(rows, vocab, seed))
    for k, v in full.items():
        torch.testing.assert_close(tree[k], v)


def _tied_and_wrong(n):
    import torch.distributed as dist

    import shardfn as sf

    dp = sf.data_parallel(sf.Mesh({"dp": n}), "dp", bucket_bytes=8)
    w = torch.arange(6.0)
    rank = dist.get_rank()

    def fn(p):  # the same tensor under two names (tied): one gradient per name
        return (p["a"] * (rank + 1)).sum() + (p["b"] ** 2).sum()

    got = dp.grad_and_value(fn)({"a": w, "b": w})
    want = dp.reduce_grads(sf.grad_and_value(fn)({"a": w, "b": w})[0])
    errors = {}
    for name, call in {
            "int leaf": lambda: dp.grad_and_value(fn)({"a": w, "b": torch.arange(6)}),
            "argnums": lambda: dp.grad_and_value(fn, argnums=3)({"a": w, "b": w}),
            "weight": lambda: sf.data_parallel(sf.Mesh({"dp": n}), "dp", average=False)
            .grad_and_value(fn, weight=2.0)}.items():
        try:
            call()
            errors[name] = None
        except (TypeError, ValueError) as error:
            errors[name] = str(error)
    return got, want, errors


def test_tied_leaves_and_clear_errors(worlds):
    for got, want, errors in worlds(2).run(_tied_and_wrong, 2):
        assert torch.equal(got[0]["a"], torch.full((6,), 1.5)), got  # mean of 1 and 2
        assert torch.equal(got[0]["b"], 2 * torch.arange(6.0))
        assert all(torch.equal(got[0][k], want[k]) for k in "ab")
        assert "floating point" in errors["int leaf"] and "int64" in errors["int leaf"], errors
        assert "out of range" in errors["argnums"], errors
        assert "average=True" in errors["weight"], errors


def _launch_order(n):
    """Record, on the autograd graph's own schedule, when backward computes each layer's
    input gradient and when each bucket's reduce-scatter is posted."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms import _dp_grad

    events = []
    start = _dp_grad.start_reduce_scatter

    def spy(plan, flats, ax, **kw):
        events.append(("reduce", kw["tag"]))
        return start(plan, flats, ax, **kw)

    _dp_grad.start_reduce_scatter = spy
    try:
        dp = sf.data_parallel(sf.Mesh({"dp": n}), "dp", bucket_bytes=64 * 4)
        params = {f"layer{i}": torch.eye(8) + 0.01 * i for i in range(4)}

        def mark(i):
            return lambda grad: events.append(("backward", i))

        def fn(p, x):
            for i in range(4):
                x = torch.tanh(x @ p[f"layer{i}"])
                x.register_hook(mark(i))  # its gradient: backward is at layer i
            return x.square().mean()

        x = torch.randn(3, 8) * (dist.get_rank() + 1)
        dp.grad_and_value(fn)(params, x)
        return events
    finally:
        _dp_grad.start_reduce_scatter = start


def test_first_bucket_reduction_starts_during_backward(worlds):
    """One 256-byte bucket per layer; the last layer's reduction must be posted before
    backward reaches the first layer (no overlap: every reduction after backward)."""
    for engine in worlds(2).run(_launch_order, 2):
        kinds = [kind for kind, _ in engine]
        assert kinds.count("reduce") == 4, engine
        first_reduce = kinds.index("reduce")
        assert first_reduce < engine.index(("backward", 0)), engine


def _compiled_step():
    import torch._dynamo
    from torch._dynamo.utils import counters

    import shardfn as sf

    torch._dynamo.reset()
    counters.clear()
    mesh = sf.Mesh({"dp": 2})
    dp = sf.data_parallel(mesh, "dp", bucket_bytes=64)
    params = _models.init_params(5, 3, 2, 0)
    batch = _models.make_batch(2, 5, mesh.index("dp"))

    def step(params, batch):
        return dp.grad_and_value(_models.loss_fn)(params, batch)

    eager = step(params, batch)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(params, batch)
    return eager, compiled, counters["stats"]["unique_graphs"]


def test_compiled_is_one_graph_and_bitwise_eager(worlds):
    for eager, compiled, graphs in worlds(2).run(_compiled_step):
        assert graphs == 1
        assert torch.equal(eager[1], compiled[1])
        for k in eager[0]:
            assert torch.equal(eager[0][k], compiled[0][k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_reduce_dtype_and_low_precision_are_bitwise(worlds, dtype):
    def on_rank():
        import torch.distributed as dist

        import shardfn as sf

        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(rank)
        params = {"w": torch.randn(7, 3, generator=gen).to(dtype),
                  "v": torch.randn(5, generator=gen)}

        def fn(p):
            return (p["w"].float().sin().sum() * (rank + 1) + p["v"].square().sum())

        out = []
        for precision in (None, sf.Precision(reduce_dtype=torch.float32)):
            dp = sf.data_parallel(sf.Mesh({"dp": 3}), "dp", bucket_bytes=20,
                                  precision=precision)
            got = dp.grad_and_value(fn)(params)[0]
            want = dp.reduce_grads(sf.grad_and_value(fn)(params)[0])
            out.append(all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
                           for k in want))
        return out

    assert worlds(3).run(on_rank) == [[True, True]] * 3
