"""data_parallel: the averaged gradient equals the full-batch gradient, in place when donated
or under autograd overlap, with the inputs untouched otherwise (on sf.testing's kit)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.testing import Trainer, assert_sharded_matches, loss_trainer
from tests.transforms import _models


def _reference(shape, seed):
    return lambda: loss_trainer(_models.init_params(*shape, seed), _models.loss_fn)


def _inputs(shape, n, seed, steps=1):
    return [_models.make_batch(2 * n, shape[0], seed + s) for s in range(steps)]


def _pure(shape, bucket_bytes, donate, seed):
    def make(mesh):
        import shardfn as sf

        dp = sf.data_parallel(mesh, "dp", bucket_bytes=bucket_bytes, donate=donate)

        def step(state, batch):
            grads = torch.func.grad(_models.loss_fn)(state["params"], batch)
            local = {k: v.clone() for k, v in grads.items()}
            sf.reset_comm_stats()
            out = dp.reduce_grads(grads)
            stats = sf.comm_stats()
            return state, {"grads": out, "same": all(out[k] is grads[k] for k in grads),
                           "untouched": all(torch.equal(grads[k], local[k]) for k in grads),
                           "bytes": stats.op_bytes("psum"), "calls": stats.op_calls("psum")}
        return Trainer({"params": _models.init_params(*shape, seed)}, step)
    return make


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([2, 3]), vocab=st.integers(3, 13), d=st.integers(1, 5),
       hidden=st.integers(1, 4), bucket_bytes=st.sampled_from([4, 24, 2**20]),
       donate=st.booleans(), seed=st.integers(0, 2**16))
def test_reduce_grads_is_the_full_batch_gradient(worlds, n, vocab, d, hidden, bucket_bytes,
                                                  donate, seed):
    shape = (vocab, d, hidden)
    psi = sum(p.numel() for p in _models.init_params(*shape, seed).values()) * 4
    for (_, got) in assert_sharded_matches(
            _pure(shape, bucket_bytes, donate, seed), _reference(shape, seed), n_ranks=n,
            inputs=_inputs(shape, n, seed), world=worlds, compare=("grads",)):
        # donated: averaged in place in the tensors it was given; else the inputs untouched
        assert got["same"] if donate else (got["untouched"] and not got["same"])
        assert got["calls"] == -(-psi // max(4, bucket_bytes))  # one reduction per bucket
        # 2 Psi (N-1)/N, counted per bucket in whole bytes
        assert got["bytes"] == pytest.approx(2 * psi * (n - 1) / n, abs=got["calls"])


def _overlap(shape, bucket_bytes, seed):
    def make(mesh):
        import shardfn as sf

        dp = sf.data_parallel(mesh, "dp", bucket_bytes=bucket_bytes)
        leaves = {k: v.requires_grad_() for k, v in _models.init_params(*shape, seed).items()}
        sync_params = dp.overlap(leaves)  # one context object, entered every step

        def step(state, batch):
            for p in leaves.values():
                p.grad = None
            with sync_params as sync:
                _models.loss_fn(leaves, batch).backward()
            grads = sync.grads()
            return state, {"grads": grads, "in_place": all(grads[k] is leaves[k].grad
                                                           for k in leaves)}
        return Trainer({"params": leaves}, step)
    return make


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bucket_bytes", [24, 2**20])
def test_overlap_averages_grad_in_place(worlds, n, bucket_bytes):
    shape, seed = (9, 4, 3), 3
    for records in assert_sharded_matches(_overlap(shape, bucket_bytes, seed),
                                          _reference(shape, seed), n_ranks=n, world=worlds,
                                          inputs=_inputs(shape, n, seed, steps=2)):
        # sync.grads() are the .grad tensors: no second copy
        assert [r["in_place"] for r in records[1:]] == [True, True]


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
