"""data_parallel: the averaged gradient equals the full-batch gradient, in place when donated
or under autograd overlap, with the inputs untouched otherwise."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from tests.transforms import _models


def _expected(shape, n, seed, steps=1):
    params = _models.init_params(*shape, seed)
    return [torch.func.grad(_models.loss_fn)(params, _models.make_batch(2 * n, shape[0], seed + s))
            for s in range(steps)]


def _pure(shape, bucket_bytes, donate, seed):
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    n, rank = dist.get_world_size(), dist.get_rank()
    dp = sf.data_parallel(sf.Mesh({"dp": n}), "dp", bucket_bytes=bucket_bytes, donate=donate)
    params = _models.init_params(*shape, seed)
    batch = _models.rank_slice(_models.make_batch(2 * n, shape[0], seed), rank, n)
    grads = torch.func.grad(_models.loss_fn)(params, batch)
    local = {k: v.clone() for k, v in grads.items()}
    sf.reset_comm_stats()
    out = dp.reduce_grads(grads)
    stats = sf.comm_stats()
    same_tensors = all(out[k] is grads[k] for k in grads)
    untouched = all(torch.equal(grads[k], local[k]) for k in grads)
    return out, same_tensors, untouched, stats.op_bytes("psum"), stats.op_calls("psum")


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([2, 3]), vocab=st.integers(3, 13), d=st.integers(1, 5),
       hidden=st.integers(1, 4), bucket_bytes=st.sampled_from([4, 24, 2**20]),
       donate=st.booleans(), seed=st.integers(0, 2**16))
def test_reduce_grads_is_the_full_batch_gradient(worlds, n, vocab, d, hidden, bucket_bytes,
                                                  donate, seed):
    shape = (vocab, d, hidden)
    (expected,) = _expected(shape, n, seed)
    psi = sum(g.numel() for g in expected.values()) * 4
    for out, same_tensors, untouched, psum_bytes, calls in worlds(n).run(
            _pure, shape, bucket_bytes, donate, seed):
        assert_close(out, expected)
        if donate:  # averaged in place in the tensors it was given
            assert same_tensors
        else:  # the inputs are left as they were
            assert untouched and not same_tensors
        assert calls == -(-psi // max(4, bucket_bytes))  # one reduction per bucket
        # 2 Psi (N-1)/N, counted per bucket in whole bytes
        assert psum_bytes == pytest.approx(2 * psi * (n - 1) / n, abs=calls)


def _overlap(shape, bucket_bytes, seed, steps):
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    n, rank = dist.get_world_size(), dist.get_rank()
    dp = sf.data_parallel(sf.Mesh({"dp": n}), "dp", bucket_bytes=bucket_bytes)
    leaves = {k: v.requires_grad_() for k, v in _models.init_params(*shape, seed).items()}
    sync_params = dp.overlap(leaves)  # one context object, entered every step
    results = []
    for step in range(steps):
        batch = _models.rank_slice(_models.make_batch(2 * n, shape[0], seed + step), rank, n)
        for p in leaves.values():
            p.grad = None
        with sync_params as sync:
            _models.loss_fn(leaves, batch).backward()
        grads = sync.grads()
        in_place = all(grads[k] is leaves[k].grad for k in leaves)
        results.append(({k: v.clone() for k, v in grads.items()}, in_place))
    return results


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bucket_bytes", [24, 2**20])
def test_overlap_averages_grad_in_place(worlds, n, bucket_bytes):
    shape, seed, steps = (9, 4, 3), 3, 2
    expected = _expected(shape, n, seed, steps)
    for per_step in worlds(n).run(_overlap, shape, bucket_bytes, seed, steps):
        for (grads, in_place), want in zip(per_step, expected, strict=True):
            assert in_place  # sync.grads() are the .grad tensors: no second copy
            assert_close(grads, want)


def test_overlap_rejects_a_second_backward_in_one_block(worlds):
    def on_rank():
        import torch.distributed as dist

        import shardfn as sf
        from tests.transforms import _models

        dp = sf.data_parallel(sf.Mesh({"dp": 2}), "dp")
        leaves = {k: v.requires_grad_() for k, v in _models.init_params(5, 2, 3, 0).items()}
        batch = _models.make_batch(2, 5, 0)
        message = "no error"
        try:
            with dp.overlap(leaves):
                _models.loss_fn(leaves, batch).backward()
                _models.loss_fn(leaves, batch).backward()
        except RuntimeError as err:
            message = str(err)
        # the exchanges the failed block had started are drained: the next reduction is right
        value = torch.full((7,), float(dist.get_rank()))
        return message, dp.reduce_grads({"v": value})["v"]

    for message, value in worlds(2).run(on_rank):
        assert "second gradient" in message and "leaf '" in message, message
        assert torch.equal(value, torch.full((7,), 0.5))
