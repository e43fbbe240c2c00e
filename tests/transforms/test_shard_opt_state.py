"""shard_opt_state (ZeRO-1/2) and data_parallel equal single-process training (on sf.testing's
kit: parameters and gathered optimizer state compared leaf by leaf after every step)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn.testing import Trainer, assert_sharded_matches, loss_trainer
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


def _gathered(opt):
    return lambda v: {**v, "opt_state": opt.gather_state(v["opt_state"], v["params"])}


def _trainer(case, opt, donate=False, gather=None) -> Trainer:
    """``STEPS`` of accumulated gradients and ``opt``; records this rank's comm and state size."""
    params = _models.init_params(case["vocab"], case["d"], case["hidden"], case["seed"])
    grad_fn = sf.accumulate_grads(torch.func.grad_and_value(_models.loss_fn), case["accumulate"])

    def step(state, batch):
        sf.reset_comm_stats()
        grads, _ = grad_fn(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        params = sf.optim.apply_updates(state["params"], updates, donate=donate)
        stats, inner = sf.comm_stats(), getattr(opt_state, "inner", ())
        return {"params": params, "opt_state": opt_state}, {
            "rs": stats.op_calls("psum_scatter"), "ag": stats.op_calls("all_gather"),
            "bytes": stats.total_bytes,
            "numel": sum(t.numel() for t in sf.pytree.tree_leaves(inner) if t.dim())}
    return Trainer({"params": params, "opt_state": opt.init(params)}, step, gather)


def _sharded(case):
    def make(mesh):
        donate = bool(case.get("donate"))
        opt = sf.shard_opt_state(make_opt(case["opt"], case["clip"]), mesh, "dp",
                                 shard_grads=case["shard_grads"],
                                 bucket_bytes=case["bucket_bytes"], donate=donate)
        return _trainer(case, opt, donate, _gathered(opt))
    return make


def _check(case, world):
    """Every rank's records (init, then one per step) after comparing with one process."""
    size = case["per_rank"] * case["accumulate"] * case["n"]
    return assert_sharded_matches(
        _sharded(case), lambda: _trainer(case, make_opt(case["opt"], case["clip"])),
        n_ranks=case["n"], world=world, compare=("params", "opt_state"),
        inputs=[_models.make_batch(size, case["vocab"], case["seed"] + s) for s in range(STEPS)])


@given(case=cases())
def test_sharded_optimizer_matches_single_process(worlds, case):
    for records in _check(case, worlds):
        if case["n"] > 1:
            # one reduce-scatter and one all-gather per bucket per step, whatever the accumulation
            assert len({(r["rs"], r["ag"]) for r in records[1:]}) == 1
            assert records[1]["rs"] == records[1]["ag"] > 0


def test_comm_bytes_and_state_memory_follow_the_zero_formulas(worlds):
    case = dict(n=4, vocab=64, d=16, hidden=7, opt="adam", clip=None, accumulate=3, per_rank=2,
                shard_grads=True, bucket_bytes=2**12, seed=3)
    total = sum(p.numel() for p in _models.init_params(64, 16, 7, 3).values())
    psi, n = total * 4, case["n"]
    buckets = math.ceil(psi / case["bucket_bytes"])
    for records in _check(case, worlds):
        per_step = sum(r["bytes"] for r in records[1:]) / STEPS
        ideal = 2 * psi * (n - 1) / n
        padding = 2 * (n - 1) * 4 * buckets * (n - 1) / n  # < N elements of padding per bucket
        assert ideal <= per_step <= ideal + padding, (per_step, ideal)
        # one reduction per step although 3 micro-batches were accumulated
        assert [r["rs"] for r in records[1:]] == [buckets] * STEPS
        # Adam keeps two moments: at most ceil(total / N) + per-bucket padding elements each
        state_numel = records[-1]["numel"]
        assert 2 * (total // n - buckets * n) <= state_numel <= 2 * (math.ceil(total / n) + buckets)


def _dp_step(bucket_bytes):
    def make(mesh):
        dp = sf.data_parallel(mesh, "dp", bucket_bytes=bucket_bytes)

        def step(state, batch):
            sf.reset_comm_stats()
            pure = dp.reduce_grads(torch.func.grad(_models.loss_fn)(state["params"], batch))
            stats = sf.comm_stats()
            leaves = {k: v.clone().requires_grad_() for k, v in state["params"].items()}
            with dp.overlap(leaves) as sync:
                _models.loss_fn(leaves, batch).backward()
            return state, {"grads": {"pure": pure, "overlap": sync.grads()},
                           "bytes": stats.op_bytes("psum"), "calls": stats.op_calls("psum")}
        return Trainer({"params": _models.init_params(10, 3, 5, 7)}, step)
    return make


def _mean_gradient():
    def step(state, batch):
        grads = torch.func.grad(_models.loss_fn)(state["params"], batch)
        return state, {"grads": {"pure": grads, "overlap": grads}}
    return Trainer({"params": _models.init_params(10, 3, 5, 7)}, step)


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_equals_mean_gradient(worlds, n):
    psi = sum(p.numel() for p in _models.init_params(10, 3, 5, 7).values()) * 4
    for _, got in assert_sharded_matches(_dp_step(40), _mean_gradient, n_ranks=n, world=worlds,
                                         inputs=[_models.make_batch(2 * n, 10, 7)]):
        assert got["bytes"] == pytest.approx(2 * psi * (n - 1) / n, abs=n)
        assert got["calls"] == math.ceil(psi / 40)  # 40-byte buckets, whole leaves


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
    final = _check(case, worlds)[0][-1]  # equal to the single-process state (checked)

    def reshard(full_state, params):
        import shardfn as sf

        opt = sf.shard_opt_state(make_opt("adamw", None), sf.Mesh({"dp": 4}), "dp")
        return opt.gather_state(opt.shard_state(full_state, params), params)

    for state in worlds(4).run(reshard, final["opt_state"], final["params"]):
        torch.testing.assert_close(state, final["opt_state"])


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


def _autograd(shard_grads, bucket_bytes, seed):
    """ZeRO-1/2 with autograd: reduce-scatter during backward; ZeRO-2 frees .grad, ZeRO-1 keeps
    it as autograd wrote it."""
    def make(mesh):
        opt = sf.shard_opt_state(sf.optim.adamw(1e-2), mesh, "dp", shard_grads=shard_grads,
                                 bucket_bytes=bucket_bytes)

        def step(state, batch):
            params = state["params"]
            leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
            with opt.overlap(leaves) as sync:
                _models.loss_fn(leaves, batch).backward()
            during = sum(p.grad is not None for p in leaves.values())
            reduced = sync.grads()
            local = {} if shard_grads else torch.func.grad(_models.loss_fn)(params, batch)
            kept = all(torch.allclose(leaves[k].grad, local[k]) for k in local)
            updates, opt_state = opt.update(reduced, state["opt_state"], params)
            return {"params": sf.optim.apply_updates(params, updates), "opt_state": opt_state}, {
                "during": during, "after": sum(p.grad is not None for p in leaves.values()),
                "kept": kept}
        params = _models.init_params(11, 3, 5, seed)
        return Trainer({"params": params, "opt_state": opt.init(params)}, step, _gathered(opt))
    return make


@pytest.mark.parametrize(("shard_grads", "n", "bucket_bytes"),
                         [(True, 2, 24), (True, 2, 2**20), (False, 2, 24), (False, 3, 24)])
def test_overlap_with_autograd_matches_single_process(worlds, shard_grads, n, bucket_bytes):
    seed = 5
    reference = lambda: loss_trainer(_models.init_params(11, 3, 5, seed),  # noqa: E731
                                     _models.loss_fn, opt=sf.optim.adamw(1e-2))
    for records in assert_sharded_matches(
            _autograd(shard_grads, bucket_bytes, seed), reference, n_ranks=n, world=worlds,
            inputs=[_models.make_batch(2 * n, 11, seed + s) for s in range(3)]):
        steps = records[1:]
        if not shard_grads:  # ZeRO-1 leaves the local .grad in place
            assert [r["kept"] for r in steps] == [True] * 3
            continue
        # a .grad is the send buffer of its buckets: it is freed once they are reduced,
        # during backward for all but the last buckets in flight, and none outlives grads()
        assert [r["after"] for r in steps] == [0, 0, 0]
        if bucket_bytes == 24:  # many buckets: most gradients were freed during backward
            assert all(r["during"] < 5 for r in steps), steps
