"""Memory tracker: exact byte counts for known allocations, autograd and torch.func."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn.memory as mem

MIB = 1 << 20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_alloc_and_free_exact():
    with mem.track() as t:
        a = _bytes(1000)
        b = torch.zeros(250)  # 1000 bytes
        assert t.current_bytes == 2000
        del a
        assert t.current_bytes == 1000
        c = _bytes(3000)
        del b, c
    assert (t.peak_bytes, t.current_bytes) == (4000, 0)


def test_live_at_exit_and_frozen_after():
    with mem.track() as t:
        kept = torch.ones(100)
    assert t.current_bytes == 400
    del kept  # freed after exit: not seen
    assert t.current_bytes == 400


def test_preexisting_tensors_not_counted():
    x = torch.zeros(1000)
    with mem.track() as t:
        x.add_(1)  # in place on an outside tensor
        v = x[10:]
        v.mul_(2)
        del x  # freeing an outside tensor subtracts nothing
    assert (t.peak_bytes, t.current_bytes) == (0, 0)


def test_views_count_once():
    with mem.track() as t:
        a = torch.zeros(64, 64)
        views = [a.t(), a[3:], a.view(-1), a.reshape(16, 256), a.unsqueeze(0), a.detach()]
        assert t.current_bytes == 64 * 64 * 4
        del a
        assert t.current_bytes == 64 * 64 * 4  # the views keep the storage alive
        del views
    assert t.current_bytes == 0 and t.peak_bytes == 64 * 64 * 4


def test_resize_in_place_updates_size():
    with mem.track() as t:
        a = torch.zeros(10)
        a.resize_(100)
    assert t.current_bytes == 400


def test_storage_resize_frees_and_regrows():
    """FSDP's trick: a storage resized to 0 bytes is freed, and counted again when regrown."""
    resize = torch.ops.inductor.resize_storage_bytes_
    before = torch.zeros(256)  # made outside the block: counted only once it grows inside
    with mem.track() as t:
        a = torch.zeros(1000)
        alias = torch.empty(0).set_(a.untyped_storage(), 0, (1000,))
        resize(a, 0)
        mem.mark("freed")
        resize(a, 4000)
        resize(before, 0)
        resize(before, 1024)
    assert t.marks["freed"] == 0
    assert t.peak_bytes == t.current_bytes == 4000 + 1024
    del alias


def test_categories_innermost_wins_and_peak_breakdown():
    with mem.track() as t:
        with mem.category("params"):
            p = _bytes(1000)
            with mem.category("acts"):
                a = _bytes(300)
            q = _bytes(200)
        other = _bytes(50)
        assert t.current_by_category == {"params": 1200, "acts": 300, "other": 50}
        del p, q
        with mem.category("acts"):
            b = _bytes(100)
        del a, b, other
    assert t.peak_bytes == 1550
    assert t.peak_by_category == {"params": 1200, "acts": 300, "other": 50}
    assert sum(t.peak_by_category.values()) == t.peak_bytes
    assert t.max_by_category == {"params": 1200, "acts": 400, "other": 50}
    assert t.current_bytes == 0


def test_category_max_can_come_after_the_overall_peak():
    with mem.track() as t:
        big = _bytes(5000)
        del big
        with mem.category("late"):
            x, y = _bytes(100), _bytes(100)
        del x, y
    assert t.peak_bytes == 5000 and t.peak_by_category == {"other": 5000}
    assert t.max_by_category["late"] == 200


def test_marks_and_mark_without_tracker():
    mem.mark("nobody listens")  # no-op
    with mem.track() as t:
        a = _bytes(128)
        mem.mark("a")
        b = _bytes(64)
        mem.mark("ab")
        del a, b
        mem.mark("none")
    assert t.marks == {"a": 128, "ab": 192, "none": 0}


def test_nested_trackers_count_their_own_block():
    with mem.track() as outer:
        a = _bytes(1000)
        with mem.track() as inner:
            b = _bytes(500)
            mem.mark("m")
            del a
        del b
    assert (inner.peak_bytes, inner.current_bytes) == (500, 500)
    assert inner.marks == {"m": 500} and outer.marks == {"m": 1500}
    assert (outer.peak_bytes, outer.current_bytes) == (1500, 0)


def test_device_filter():
    with mem.track(device="cuda") as t:
        a = torch.zeros(1000)  # noqa: F841
    assert t.peak_bytes == 0
    with mem.track(device="cpu") as t:
        a = torch.zeros(1000)  # noqa: F841
    assert t.peak_bytes == 4000


A_ROWS, WIDTH = 2048, 64
ACT = A_ROWS * WIDTH * 4  # one activation
W = WIDTH * WIDTH * 4  # one weight / weight gradient


def _chain(layers):
    def f(w, x):
        for _ in range(layers):
            x = torch.tanh(x @ w)
        mem.mark("forward")
        return x.sum()

    return f


@given(layers=st.integers(1, 5))
@settings(max_examples=5)
def test_matmul_chain_under_torch_func_grad(layers):
    """Hand count: tanh saves its output (L activations at the end of forward).

    torch.func.grad differentiates with create_graph=True, so the backward's own
    results stay referenced by the (unused) double-backward graph until grad
    returns: L tanh_backward outputs and L-1 input gradients on top of the L
    saved activations, plus up to L weight gradients and their running sums.
    """
    w, x = torch.randn(WIDTH, WIDTH), torch.randn(A_ROWS, WIDTH)
    with mem.track() as t:
        g = torch.func.grad(_chain(layers))(w, x)
    assert t.marks["forward"] == layers * ACT
    activations = (3 * layers - 1) * ACT
    assert activations <= t.peak_bytes <= activations + 2 * layers * W + 64
    assert t.current_bytes == W and g.shape == w.shape


@given(layers=st.integers(1, 5))
@settings(max_examples=5)
def test_matmul_chain_under_autograd(layers):
    """Plain autograd frees each saved activation as its node runs: peak L + 1 activations."""
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(A_ROWS, WIDTH)
    with mem.track() as t:
        _chain(layers)(w, x).backward()
    assert t.marks["forward"] == layers * ACT
    assert (layers + 1) * ACT <= t.peak_bytes <= (layers + 1) * ACT + 3 * W + 64
    assert t.current_bytes == W  # w.grad


def test_autograd_function_forward_and_backward_counted():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return torch.cat([x, x])

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output)  # keeps the 8000-byte cat alive until backward

        @staticmethod
        def backward(ctx, grad):
            mem.mark("backward")
            a, b = grad.chunk(2)
            return a + b

    x = torch.randn(1000)
    with mem.track() as t:
        g = torch.func.grad(lambda x: Double.apply(x).sum())(x)
    assert 8000 <= t.marks["backward"] <= 8016  # the saved cat (+ the scalar loss and its grad)
    assert t.peak_bytes >= 8000 + 4000  # the saved cat and the returned gradient
    assert t.current_bytes == 4000  # the gradient
    torch.testing.assert_close(g, torch.full_like(x, 2.0))


def test_vmap_inside():
    x = torch.randn(8, 100)
    with mem.track() as t:
        y = torch.func.vmap(lambda r: r * 2)(x)
    assert t.current_bytes == 3200 and y.shape == x.shape


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 4096)), min_size=1, max_size=30))
@settings(max_examples=20)
def test_random_alloc_free_sequence_matches_model(ops):
    live: list[torch.Tensor] = []
    model_current = model_peak = 0
    with mem.track() as t:
        for alloc, size in ops:
            if alloc or not live:
                live.append(_bytes(size))
                model_current += size
            else:
                model_current -= live.pop(size % len(live)).numel()
            model_peak = max(model_peak, model_current)
            assert t.current_bytes == model_current
    assert (t.peak_bytes, t.current_bytes) == (model_peak, model_current)


def _gather_on_rank():
    import shardfn as sf

    mesh = sf.Mesh({"x": 2})
    shard = torch.randn(256)
    with mem.track() as t, mem.category("gathered"):
        full = sf.all_gather(shard, "x", mesh=mesh)
    return t.current_bytes, t.max_by_category, full.numel()


def test_collective_outputs_counted(worlds):
    for current, by_category, numel in worlds(2).run(_gather_on_rank):
        assert numel == 512
        assert current == 512 * 4  # the gathered tensor; the temporaries were freed
        assert by_category["gathered"] >= 512 * 4
