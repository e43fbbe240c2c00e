"""shard_opt_state (ZeRO-1/2) and data_parallel equal single-process training."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from tests.transforms import _models

OPTIMIZERS = {
    "sgd_momentum": lambda: sf.optim.sgd(0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda: sf.optim.adam(1e-2),
    "adamw": lambda: sf.optim.adamw(1e-2, weight_decay=0.1),
    "adamw_masked": lambda: sf.optim.adamw(
        1e-2, weight_decay=0.1,
        mask={"emb": True, "w1": True, "b1": False, "w2": True, "scale": False}),
}


def make_opt(name: str, clip: float | None):
    opt = OPTIMIZERS[name]()
    return sf.optim.chain(sf.optim.clip_by_global_norm(clip), opt) if clip else opt


@st.composite
def cases(draw):
    return dict(
        n=draw(st.integers(1, 4)),
        vocab=draw(st.integers(8, 24)),
        d=draw(st.integers(2, 7)),
        hidden=draw(st.integers(1, 5)),
        opt=draw(st.sampled_from(sorted(OPTIMIZERS))),
        clip=draw(st.sampled_from([None, 0.05, 10.0])),
        accumulate=draw(st.sampled_from([1, 2])),
        per_rank=draw(st.integers(1, 3)),
        shard_grads=draw(st.booleans()),
        bucket_bytes=draw(st.sampled_from([64, 2**20])),
        donate=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


STEPS = 5


def _train(case, sharded: bool):
    """5 steps; on the local world when sharded, else one process on the whole batch."""
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    n = case["n"] if sharded else 1
    rank = dist.get_rank() if sharded and dist.is_initialized() else 0
    params = _models.init_params(case["vocab"], case["d"], case["hidden"], case["seed"])
    opt = make_opt(case["opt"], case["clip"])
    mesh = sf.Mesh({"dp": n}) if sharded else None
    donate = sharded and case.get("donate", False)
    if sharded:
        opt = sf.shard_opt_state(opt, mesh, "dp", shard_grads=case["shard_grads"],
                                 bucket_bytes=case["bucket_bytes"], donate=donate)
    state = opt.init(params)
    grad_fn = sf.accumulate_grads(torch.func.grad_and_value(_models.loss_fn), case["accumulate"])
    sf.reset_comm_stats()
    losses = []
    for step in range(STEPS):
        size = case["per_rank"] * case["accumulate"] * case["n"]
        batch = _models.make_batch(size, case["vocab"], case["seed"] + step)
        if sharded:
            batch = _models.rank_slice(batch, rank, n)
        grads, loss = grad_fn(params, batch)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates, donate=donate)
        losses.append(loss)
    stats = sf.comm_stats()
    full_state = opt.gather_state(state, params) if sharded else state
    local_state_numel = (sum(t.numel() for t in sf.pytree.tree_leaves(state.inner) if t.dim())
                         if sharded else None)
    return params, full_state, stats, local_state_numel


@given(case=cases())
def test_sharded_optimizer_matches_single_process(worlds, case):
    ref_params, ref_state, _, _ = _train(case, sharded=False)
    results = worlds(case["n"]).run(_train, case, True)
    for rank, (params, state, stats, _) in enumerate(results):
        assert_close(params, ref_params, msg=lambda m, r=rank: f"rank {r} params: {m}")
        assert_close(state, ref_state, msg=lambda m, r=rank: f"rank {r} optimizer state: {m}")
        if case["n"] > 1:
            # one reduce-scatter and one all-gather per bucket per step, whatever the accumulation
            calls = stats.op_calls("psum_scatter")
            assert calls == stats.op_calls("all_gather") and calls % STEPS == 0


def test_comm_bytes_and_state_memory_follow_the_zero_formulas(worlds):
    case = dict(n=4, vocab=64, d=16, hidden=7, opt="adam", clip=None, accumulate=3, per_rank=2,
                shard_grads=True, bucket_bytes=2**12, seed=3)
    params = _models.init_params(case["vocab"], case["d"], case["hidden"], case["seed"])
    total = sum(p.numel() for p in params.values())
    psi = total * 4
    results = worlds(4).run(_train, case, True)
    n = case["n"]
    buckets = math.ceil(psi / case["bucket_bytes"])
    for stats, state_numel in [(r[2], r[3]) for r in results]:
        per_step = stats.total_bytes / STEPS
        ideal = 2 * psi * (n - 1) / n
        padding = 2 * (n - 1) * 4 * buckets * (n - 1) / n  # < N elements of padding per bucket
        assert ideal <= per_step <= ideal + padding, (per_step, ideal)
        # one reduction per step although 3 micro-batches were accumulated
        assert stats.op_calls("psum_scatter") == STEPS * buckets
        # Adam keeps two moments: at most ceil(total / N) + per-bucket padding elements each
        assert state_numel <= 2 * (math.ceil(total / n) + buckets)
        assert state_numel >= 2 * (total // n - buckets * n)


def _dp_step(shape, bucket_bytes, seed):
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = sf.Mesh({"dp": n})
    dp = sf.data_parallel(mesh, "dp", bucket_bytes=bucket_bytes)
    params = _models.init_params(*shape, seed)
    batch = _models.rank_slice(_models.make_batch(2 * n, shape[0], seed), rank, n)
    sf.reset_comm_stats()
    pure = dp.reduce_grads(torch.func.grad(_models.loss_fn)(params, batch))
    pure_stats = sf.comm_stats()
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    with dp.overlap(leaves) as sync:
        _models.loss_fn(leaves, batch).backward()
    return pure, sync.grads(), pure_stats


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_equals_mean_gradient(worlds, n):
    shape, seed = (10, 3, 5), 7
    params = _models.init_params(*shape, seed)
    expected = torch.func.grad(_models.loss_fn)(params, _models.make_batch(2 * n, shape[0], seed))
    psi = sum(p.numel() for p in params.values()) * 4
    for pure, overlapped, stats in worlds(n).run(_dp_step, shape, 40, seed):
        assert_close(pure, expected)
        assert_close(overlapped, expected)
        assert stats.op_bytes("psum") == pytest.approx(2 * psi * (n - 1) / n, abs=n)
        assert stats.op_calls("psum") == math.ceil(psi / 40)  # 40-byte buckets, whole leaves


def test_bad_input_gives_clear_errors(worlds):
    def on_rank():
        import torch.distributed as dist

        import shardfn as sf

        mesh = sf.Mesh({"dp": 2})
        rank = dist.get_rank()
        opt = sf.shard_opt_state(sf.optim.adam(0.1), mesh, "dp")
        errors = []
        # a parameter tree that differs between ranks
        params = {"w": torch.zeros(3 + rank), "b": torch.zeros(2)}
        try:
            opt.init(params)
        except ValueError as err:
            errors.append(str(err))
        # an optimizer state from another partitioning (the other rank's)
        params = {"w": torch.zeros(5), "b": torch.zeros(2)}
        state = opt.init(params)
        states = [None, None]
        dist.all_gather_object(states, state)
        try:
            opt.update(params, states[1 - rank], params)
        except ValueError as err:
            errors.append(str(err))
        return errors

    for rank, errors in enumerate(worlds(2).run(on_rank)):
        assert "differs between ranks" in errors[0] and "leaf 'w'" in errors[0]
        assert "another partitioning" in errors[1] and f"index {1 - rank}" in errors[1]


def test_state_round_trips_between_world_sizes(worlds):
    """gather_state at N=2, shard_state at N=4: training continues identically."""
    case = dict(n=2, vocab=12, d=3, hidden=5, opt="adamw", clip=None, accumulate=1, per_rank=2,
                shard_grads=False, bucket_bytes=2**20, seed=11)
    _, full_state_2, _, _ = worlds(2).run(_train, case, True)[0]
    ref_params, ref_state, _, _ = _train(case, sharded=False)

    def reshard(full_state, params):
        import shardfn as sf

        opt = sf.shard_opt_state(make_opt("adamw", None), sf.Mesh({"dp": 4}), "dp")
        return opt.gather_state(opt.shard_state(full_state, params), params)

    for state in worlds(4).run(reshard, full_state_2, ref_params):
        assert_close(state, ref_state)


def _zero2_autograd(n_steps, bucket_bytes, seed):
    """ZeRO-2 with autograd: gradients reduce-scattered during backward, .grad freed."""
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = sf.Mesh({"dp": n})
    params = _models.init_params(11, 3, 5, seed)
    opt = sf.shard_opt_state(sf.optim.adamw(1e-2), mesh, "dp", shard_grads=True,
                             bucket_bytes=bucket_bytes)
    state = opt.init(params)
    grads_left = []
    for step in range(n_steps):
        batch = _models.rank_slice(_models.make_batch(2 * n, 11, seed + step), rank, n)
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        with opt.overlap(leaves) as sync:
            _models.loss_fn(leaves, batch).backward()
        after_backward = sum(p.grad is not None for p in leaves.values())
        reduced = sync.grads()
        grads_left.append((after_backward, sum(p.grad is not None for p in leaves.values())))
        updates, state = opt.update(reduced, state, params)
        params = sf.optim.apply_updates(params, updates)
    return params, grads_left


@pytest.mark.parametrize("bucket_bytes", [24, 2**20])
def test_zero2_overlap_with_autograd_matches_single_process(worlds, bucket_bytes):
    seed, n = 5, 2
    params = _models.init_params(11, 3, 5, seed)
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)
    for step in range(3):
        grads = torch.func.grad(_models.loss_fn)(params, _models.make_batch(2 * n, 11, seed + step))
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    for got, grads_left in worlds(n).run(_zero2_autograd, 3, bucket_bytes, seed):
        assert_close(got, params)
        # a .grad is the send buffer of its buckets: it is freed once they are reduced,
        # during backward for all but the last buckets in flight, and none outlives grads()
        assert [after for _, after in grads_left] == [0, 0, 0]
        if bucket_bytes == 24:  # many buckets: most gradients were freed during backward
            assert all(during < len(params) for during, _ in grads_left), grads_left


def _donation(bucket_bytes, steps):
    """The same ZeRO-1 steps with and without donation (bitwise), and what each one touches."""
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = sf.Mesh({"dp": n})
    make = lambda donate: sf.shard_opt_state(  # noqa: E731
        sf.optim.adamw(1e-2, weight_decay=0.1), mesh, "dp", bucket_bytes=bucket_bytes,
        donate=donate)
    pure, donating = make(False), make(True)
    params = _models.init_params(11, 3, 5, 1)
    params_d = {k: v.clone() for k, v in params.items()}
    state, state_d = pure.init(params), donating.init(params_d)
    report = {"untouched": True, "bitwise": True, "in_place": True}
    for step in range(steps):
        batch = _models.rank_slice(_models.make_batch(2 * n, 11, 9 + step), rank, n)
        grads = torch.func.grad(_models.loss_fn)(params, batch)
        kept = [t.clone() for t in sf.pytree.tree_leaves((grads, state, params))]
        updates, new_state = pure.update(grads, state, params)
        report["untouched"] &= all(torch.equal(a, b) for a, b in zip(
            sf.pytree.tree_leaves((grads, state, params)), kept, strict=True))
        grads_d = {k: v.clone() for k, v in grads.items()}
        mu_d = sf.pytree.tree_leaves(state_d.inner.mu)
        updates_d, state_d = donating.update(grads_d, state_d, params_d)
        report["in_place"] &= all(updates_d[k] is grads_d[k] for k in grads_d) and all(
            a is b for a, b in zip(mu_d, sf.pytree.tree_leaves(state_d.inner.mu), strict=True))
        params = sf.optim.apply_updates(params, updates)
        params_d = sf.optim.apply_updates(params_d, updates_d, donate=True)
        state = new_state
        report["bitwise"] &= all(torch.equal(params[k], params_d[k]) for k in params) and all(
            torch.equal(a, b) for a, b in zip(sf.pytree.tree_leaves(state),
                                              sf.pytree.tree_leaves(state_d), strict=True))
    return report


@pytest.mark.parametrize("bucket_bytes", [24, 2**20])
def test_donation_is_bitwise_the_same_and_in_place(worlds, bucket_bytes):
    for report in worlds(3).run(_donation, bucket_bytes, 3):
        assert report == {"untouched": True, "bitwise": True, "in_place": True}


def _zero1_autograd(n_steps, bucket_bytes, seed):
    """ZeRO-1 with autograd: reduce-scatter during backward, .grad kept as autograd wrote it."""
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    n, rank = dist.get_world_size(), dist.get_rank()
    params = _models.init_params(11, 3, 5, seed)
    opt = sf.shard_opt_state(sf.optim.adamw(1e-2), sf.Mesh({"dp": n}), "dp",
                             bucket_bytes=bucket_bytes)
    state = opt.init(params)
    kept = []
    for step in range(n_steps):
        batch = _models.rank_slice(_models.make_batch(2 * n, 11, seed + step), rank, n)
        local = torch.func.grad(_models.loss_fn)(params, batch)
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        with opt.overlap(leaves) as sync:
            _models.loss_fn(leaves, batch).backward()
        reduced = sync.grads()
        kept.append(all(torch.allclose(leaves[k].grad, local[k]) for k in local))
        updates, state = opt.update(reduced, state, params)
        params = sf.optim.apply_updates(params, updates)
    return params, kept


@pytest.mark.parametrize("n", [2, 3])
def test_zero1_overlap_with_autograd_matches_single_process(worlds, n):
    seed = 5
    params = _models.init_params(11, 3, 5, seed)
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)
    for step in range(3):
        grads = torch.func.grad(_models.loss_fn)(params, _models.make_batch(2 * n, 11, seed + step))
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    for got, kept in worlds(n).run(_zero1_autograd, 3, 24, seed):
        assert_close(got, params)
        assert kept == [True, True, True]  # ZeRO-1 leaves the local .grad in place
