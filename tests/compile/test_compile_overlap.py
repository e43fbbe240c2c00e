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


def _scheduled_order() -> list[str]:
    """On each rank: the kinds of inductor's scheduled nodes for a compiled dp step."""
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

    def kind(node) -> str:
        if contains_collective(node):
            return "issue"
        if contains_wait(node):
            return "wait"
        name = getattr(node.node, "python_kernel_name", None) or ""
        return "mm" if name.endswith(("mm", "addmm")) else "kernel"

    def capture(scheduler) -> None:
        order.extend(kind(node) for node in scheduler.nodes)
        raise Scheduled

    torch._dynamo.reset()
    mesh = sf.Mesh({"dp": 2})
    model = sf.functional(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                              torch.nn.Linear(8, 3)))
    params = model.init(0)
    dp = sf.data_parallel(mesh, "dp", bucket_bytes=1)  # one bucket per leaf: 4 all-reduces
    opt = sf.optim.sgd(0.1)

    def step(params, state, x, y):
        grads, loss = torch.func.grad_and_value(
            lambda p: ((model.apply(p, x) - y) ** 2).mean())(params)
        updates, state = opt.update(dp.reduce_grads(grads), state, params)
        return sf.optim.apply_updates(params, updates), state, loss

    # no cache: a cached graph would skip the scheduler
    with mock.patch.object(Scheduler, "codegen", capture), \
            inductor_config.patch(fx_graph_cache=False, compile_threads=1), \
            functorch_config.patch(enable_autograd_cache=False):
        try:
            torch.compile(step, fullgraph=True, backend="inductor")(
                params, opt.init(params), torch.randn(4, 6), torch.randn(4, 3))
        except Exception as error:  # dynamo wraps what the backend raised
            cause: BaseException | None = error
            while cause is not None and not isinstance(cause, Scheduled):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
    torch._dynamo.reset()
    return order


def test_all_reduces_are_in_flight_during_the_backward(worlds):
    for rank, order in enumerate(worlds(2).run(_scheduled_order)):
        issues = [i for i, k in enumerate(order) if k == "issue"]
        waits = [i for i, k in enumerate(order) if k == "wait"]
        assert len(issues) == len(waits) == 4, (rank, order)
        # every bucket in flight at once: the first wait after the last issue ...
        assert waits[0] > issues[-1], (rank, order)
        # ... and backward matmuls run between the first issue and the first wait
        assert order[issues[0]:waits[0]].count("mm") >= 2, (rank, order)


def _split_against_one_call() -> dict:
    """Each split collective (eager, and compiled with ``aot_eager``) against the one-call op."""
    import pytest
    import torch
    import torch._dynamo

    import shardfn as sf
    from shardfn.primitives import _comm

    torch._dynamo.reset()
    mesh = sf.Mesh({"dp": 2, "one": 1})
    gen = torch.Generator().manual_seed(mesh.index("dp"))  # differs per rank
    real = torch.randn(3, 4, 2, generator=gen)
    values = {"real": real, "complex": torch.view_as_complex(real.contiguous())}

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
        for name, x in values.items():
            for how, fn in [("eager", both), ("compiled", compiled)]:
                for op, (want, got) in fn(x, ax).items():
                    out[axis, name, how, op] = (want.shape == got.shape and torch.equal(want, got),
                                                not torch.equal(want, x) if axis == "dp" else True)
    with pytest.raises(ValueError, match="divisible by the axis size 2"):
        _comm.psum_scatter_start(real, _comm.resolve("dp", mesh), 0)
    return out


def test_split_collectives_equal_the_one_call_ones(worlds):
    """Bitwise, real and complex, eager and traced, on an axis of 2 and of 1; a reduced or
    gathered value differs from the input (the check can fail)."""
    for rank, got in enumerate(worlds(2).run(_split_against_one_call)):
        assert len(got) == 2 * 2 * 2 * 3
        for key, (equal, moved) in got.items():
            assert equal and moved, (rank, key)
