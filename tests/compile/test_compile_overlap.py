"""A compiled data-parallel step overlaps its gradient all-reduces with the backward.

The order of inductor's generated code is the order of its scheduler's nodes; the
test reads that order from ``Scheduler.codegen`` (and stops there, before any C++ is
compiled: seconds instead of a minute) for a tiny MLP on 2 ranks with one bucket
per leaf, and checks that every bucket's all-reduce is issued before the first
wait, with backward matmuls between the first issue and the first wait. With
``psum`` (issue and wait back to back) in the reduction, each wait came right
after its issue and inductor kept every collective after the previous one's wait:
this test failed there. Values: ``test_compile_dp.py`` (``aot_eager`` bitwise,
inductor within round-off).
"""

from __future__ import annotations

import pytest


def _step(kind: str):
    """``(step, args)`` of this rank for ``kind``: a grad_and_value + AdamW/SGD step."""
    import torch

    import shardfn as sf
    from tests.compile.test_compile_zero3_tp import _case

    if kind in ("zero3", "tp_sp", "fsdp_tp"):
        model, loss_fn, batches = _case(kind)
        opt = sf.optim.adamw(1e-2)
        params, rest = model.split_trainable(model.init(0))

        def step(params, state, x, y):
            loss, grads = torch.func.grad_and_value(
                lambda p: loss_fn(model.merge(p, rest), x, y))(params)[::-1]
            updates, state = opt.update(grads, state, params)
            return sf.optim.apply_updates(params, updates), state, loss

        return step, (params, opt.init(params), *batches[0])
    mesh = sf.Mesh({"dp": 2})
    width = 8 if kind == "dp" else 16
    layers = [torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
              torch.nn.Tanh(), torch.nn.Linear(width, 3)]
    model = sf.functional(torch.nn.Sequential(*(layers if kind != "dp"
                                                else [layers[0], layers[1], layers[4]])))
    params = model.init(0)
    if kind == "dp":  # one bucket per leaf: 4 all-reduces
        dp = sf.data_parallel(mesh, "dp", bucket_bytes=1)
        opt = sf.optim.sgd(0.1)
    else:  # several buckets, each a reduce-scatter and an all-gather
        dp = None
        opt = sf.shard_opt_state(sf.optim.adamw(1e-2), mesh, "dp",
                                 shard_grads=kind == "zero2", bucket_bytes=512)

    def step(params, state, x, y):
        grads, loss = torch.func.grad_and_value(
            lambda p: ((model.apply(p, x) - y) ** 2).mean())(params)
        updates, state = opt.update(dp.reduce_grads(grads) if dp else grads, state, params)
        return sf.optim.apply_updates(params, updates), state, loss

    return step, (params, opt.init(params), torch.randn(64, 6), torch.randn(64, 3))


def _scheduled_order(kind: str = "dp", overlap: bool = False) -> list[str]:
    """On each rank: inductor's scheduled nodes for a compiled ``kind`` step, as tokens.

    ``"I3"``: collective 3 issued, ``"W3"``: its wait, ``"m"``: a matmul, ``"."``: another
    kernel. ``overlap``: compiled with ``sf.overlap_options()``.
    """
    from unittest import mock

    import torch
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.utils import contains_collective, contains_wait

    import shardfn as sf

    class Scheduled(Exception):  # noqa: N818 - not an error: the order is all we need
        pass

    order: list[str] = []

    def capture(scheduler) -> None:
        issued: dict[str, int] = {}  # a collective's output buffer -> its number
        for node in scheduler.nodes:
            if contains_collective(node):
                for buf in node.get_outputs():
                    issued[buf.get_name()] = len(issued)
                order.append(f"I{len(issued) - 1}")
            elif contains_wait(node):
                number = min(issued[dep.name] for dep in node.read_writes.reads
                             if dep.name in issued)
                order.append(f"W{number}")
            else:
                name = getattr(node.node, "python_kernel_name", None) or ""
                order.append("m" if name.endswith(("mm", "addmm")) else ".")
        raise Scheduled

    torch._dynamo.reset()
    step, args = _step(kind)
    # no cache: a cached graph would skip the scheduler
    with mock.patch.object(Scheduler, "codegen", capture), \
            inductor_config.patch(fx_graph_cache=False, compile_threads=1), \
            functorch_config.patch(enable_autograd_cache=False):
        try:
            torch.compile(step, fullgraph=True, backend="inductor",
                          options=sf.overlap_options() if overlap else None)(*args)
        except Exception as error:  # dynamo wraps what the backend raised
            cause: BaseException | None = error
            while cause is not None and not isinstance(cause, Scheduled):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
    torch._dynamo.reset()
    return order


def _matmuls_in_flight(order: list[str]) -> list[int]:
    """Per collective (issue order): the matmuls scheduled between its issue and its wait."""
    issued = {token[1:]: i for i, token in enumerate(order) if token.startswith("I")}
    waited = {token[1:]: i for i, token in enumerate(order) if token.startswith("W")}
    assert issued.keys() == waited.keys(), order
    return [order[issued[n]:waited[n]].count("m") for n in sorted(issued, key=issued.get)]


def test_all_reduces_are_in_flight_during_the_backward(worlds):
    for rank, order in enumerate(worlds(2).run(_scheduled_order)):
        kinds = [token[0] for token in order]
        issues = [i for i, k in enumerate(kinds) if k == "I"]
        waits = [i for i, k in enumerate(kinds) if k == "W"]
        assert len(issues) == len(waits) == 4, (rank, order)
        # every bucket in flight at once: the first wait after the last issue ...
        assert waits[0] > issues[-1], (rank, order)
        # ... and backward matmuls run between the first issue and the first wait
        assert kinds[issues[0]:waits[0]].count("m") >= 2, (rank, order)


@pytest.mark.parametrize("kind", ["zero1", "zero3", "tp_sp"])
def test_sharded_steps_overlap_with_overlap_options(worlds, kind):
    """With ``sf.overlap_options()`` collectives of the compiled ZeRO-1/2, ZeRO-3 and TP + SP
    steps are in flight while matmuls run (ZeRO-1/2: reduce-scatters issued inside the
    backward), more of them than with inductor's defaults, whose peak-memory reordering
    puts most out-of-place collectives right before their waits (docs/compile.md,
    "Overlap"). ZeRO-1 and TP + SP with the defaults: none at all. (The options keep the
    collectives in the graph's order: ``test_compile_dp.py``'s inductor ZeRO-1 test
    aborted on mismatched all-to-alls with torch's own passes.)"""
    for rank, (tuned, default) in enumerate(worlds(2).run(_both_orders, kind)):
        flight, before = _matmuls_in_flight(tuned), _matmuls_in_flight(default)
        # ZeRO-1's small model: its last bucket's reduce-scatter beside the backward
        assert sum(1 for n in flight if n > 0) >= (1 if kind == "zero1" else 2), (rank, tuned)
        assert sum(flight) > sum(before), (rank, tuned, default)
        if kind.startswith("zero") and kind != "zero3":
            first_issue = next(i for i, t in enumerate(tuned) if t.startswith("I"))
            assert "m" in tuned[first_issue:], (rank, tuned)  # issued before the last matmul
        if kind != "zero3":
            assert sum(before) == 0, (rank, default)


def _both_orders(kind: str) -> tuple[list[str], list[str]]:
    return _scheduled_order(kind, overlap=True), _scheduled_order(kind, overlap=False)


def _split_against_expected() -> dict:
    """Each split collective and its one-call form (eager, and compiled with ``aot_eager``)
    against the value computed here from both ranks' inputs."""
    import pytest
    import torch
    import torch._dynamo

    import shardfn as sf
    from shardfn.primitives import _comm

    torch._dynamo.reset()
    mesh = sf.Mesh({"dp": 2, "one": 1})
    index = mesh.index("dp")
    reals = [torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    inputs = {"real": reals, "complex": [torch.view_as_complex(r.contiguous()) for r in reals]}

    def expected(xs: list, axis: str) -> dict:
        if axis == "one":
            mine = xs[index]
            return {"psum": mine, "all_gather": mine, "psum_scatter": mine}
        total = xs[0] + xs[1]  # a + b == b + a: the order the ranks add in does not matter
        return {"psum": total, "all_gather": torch.cat(xs, dim=1),
                "psum_scatter": total[:, 2 * index:2 * index + 2]}

    def both(x, ax):
        return {"psum": (_comm.psum(x, ax), _comm.wait(_comm.psum_start(x, ax))),
                "all_gather": (_comm.all_gather(x, ax, 1),
                               _comm.wait(_comm.all_gather_start(x, ax, 1))),
                "psum_scatter": (_comm.psum_scatter(x, ax, 1),
                                 _comm.wait(_comm.psum_scatter_start(x, ax, 1)))}

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    out = {}
    for axis in ["dp", "one"]:
        ax = _comm.resolve(axis, mesh)
        for name, xs in inputs.items():
            want = expected(xs, axis)
            for how, fn in [("eager", both), ("compiled", compiled)]:
                for op, results in fn(xs[index], ax).items():
                    out[axis, name, how, op] = all(
                        got.shape == want[op].shape and torch.equal(got, want[op])
                        for got in results)
    with pytest.raises(ValueError, match="divisible by the axis size 2"):
        _comm.psum_scatter_start(reals[index], _comm.resolve("dp", mesh), 0)
    return out


def test_split_collectives_and_their_one_call_forms_give_the_expected_values(worlds):
    """Bitwise, real and complex, eager and traced, on an axis of 2 and of 1, against the
    sums, concatenations and blocks of both ranks' inputs computed on each rank."""
    for rank, got in enumerate(worlds(2).run(_split_against_expected)):
        assert len(got) == 2 * 2 * 2 * 3
        for key, equal in got.items():
            assert equal, (rank, key)
