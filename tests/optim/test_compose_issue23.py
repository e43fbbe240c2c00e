"""Issue #23 (optimizer side): chain/masked/multi_transform over shard_opt_state, refusals of
orders that mean nothing, and hyper-parameters as optimizer state (inject_hyperparams).

The sharded runs (1-2 ranks, each on its slice of the batch) are compared with the unsharded
composition fed the full-batch gradient (= the dp average of the per-rank gradients).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from shardfn import optim

STEPS = 3
LABELS = {"emb": "a", "w1": "a", "b1": "b", "w2": "a", "scale": "b"}


def _matrices(ps):
    return sf.pytree.tree_map(lambda p: p.ndim >= 2, ps)  # reads shapes: needs full leaves


def _labels(ps):
    return sf.pytree.tree_map(lambda p: "a" if p.ndim >= 2 else "b", ps)


def build(order: str, clip: float, shard):
    """The composition ``order`` with ``shard(opt)`` where a shard_opt_state goes (identity
    for the unsharded reference)."""
    adamw = optim.adamw(3e-2, weight_decay=0.1)
    clip_t = optim.clip_by_global_norm(clip)
    if order == "clip_first":
        return optim.chain(clip_t, shard(adamw))
    if order == "middle":
        return optim.chain(clip_t, shard(adamw), optim.scale(0.5))
    if order == "clip_after":
        return optim.chain(shard(optim.sgd(0.1, momentum=0.9)), clip_t)
    if order == "both_sharded":
        return optim.chain(shard(clip_t), shard(adamw))
    if order == "masked":
        return optim.chain(clip_t, optim.masked(shard(adamw), _matrices))
    if order == "multi":
        return optim.multi_transform({"a": shard(adamw), "b": optim.sgd(0.1)}, _labels)
    if order == "multi_dict":
        return optim.chain(clip_t, optim.multi_transform(
            {"a": shard(adamw), "b": shard(optim.sgd(0.1, momentum=0.5))}, LABELS))
    if order == "injected":
        injected = optim.inject_hyperparams(optim.adamw)(learning_rate=3e-2, weight_decay=0.1)
        return optim.chain(clip_t, shard(injected))
    if order == "skip_in_chain":  # skip_nonfinite over a sharded optimizer is one too
        from shardfn.transforms.loss_scale import skip_nonfinite

        return optim.chain(clip_t, skip_nonfinite(shard(adamw)))
    raise AssertionError(order)


ORDERS = ["clip_first", "middle", "clip_after", "both_sharded", "masked", "multi", "multi_dict",
          "injected", "skip_in_chain"]


def _train(order: str, clip: float, n: int, shape, seed: int, sharded: bool):
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    rank = dist.get_rank() if sharded and dist.is_initialized() else 0
    mesh = sf.Mesh({"dp": n}) if sharded else None
    opt = build(order, clip, (lambda o: sf.shard_opt_state(o, mesh, "dp", bucket_bytes=40))
                if sharded else (lambda o: o))
    if sharded:
        assert isinstance(opt, sf.ShardedOptimizer), type(opt)
    params = _models.init_params(*shape, seed)
    state = opt.init(params)
    for step in range(STEPS):
        if order == "injected" and step == STEPS - 1:  # the user lowers the lr between steps
            state = sf.optim.set_hyperparams(state, learning_rate=1e-3)
        batch = _models.make_batch(2 * n, shape[0], seed + step)
        if sharded:
            batch = _models.rank_slice(batch, rank, n)
        grads = torch.func.grad(_models.loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    full_state = opt.gather_state(state, params) if sharded else state
    return params, full_state


@settings(max_examples=12, deadline=None)
@given(order=st.sampled_from(ORDERS), n=st.integers(1, 2), vocab=st.integers(3, 11),
       d=st.integers(1, 5), hidden=st.integers(1, 4), clip=st.sampled_from([0.05, 100.0]),
       seed=st.integers(0, 1000))
def test_compositions_over_a_sharded_optimizer_equal_the_unsharded(worlds, order, n, vocab, d,
                                                                   hidden, clip, seed):
    shape = (vocab, d, hidden)
    expected, expected_state = _train(order, clip, n, shape, seed, sharded=False)
    results = worlds(n).run(_train, order, clip, n, shape, seed, True)
    for rank, (params, state) in enumerate(results):
        where = f"{order}, rank {rank} of {n}"
        assert_close(params, expected, msg=lambda m, w=where: f"{w}: {m}")
        # the gathered state has the unsharded composition's structure and values
        assert sf.pytree.tree_structure(state) == sf.pytree.tree_structure(expected_state)
        assert_close(state, expected_state, msg=lambda m, w=where: f"{w} state: {m}")


def test_clip_over_skip_nonfinite_of_a_sharded_optimizer_sees_the_reduced_gradient(worlds):
    """``chain(clip, skip_nonfinite(shard_opt_state(adamw)))``: the skip wrapper keeps the
    sharded optimizer visible to ``chain`` (it is ``shard_opt_state(skip_nonfinite(adamw))``),
    so the clip sees the averaged gradient, not each rank's own (the clip is tight)."""
    shape = (7, 3, 2)
    expected, expected_state = _train("skip_in_chain", 0.05, 2, shape, 4, sharded=False)
    for params, state in worlds(2).run(_train, "skip_in_chain", 0.05, 2, shape, 4, True):
        assert_close(params, expected)
        assert_close(state, expected_state)


def test_clip_must_see_the_averaged_gradient():
    """Guard: clipping each rank's own gradient before averaging gives other parameters, so the
    comparison above fails for a chain that clips before the reduction."""
    from tests.transforms import _models

    shape, seed, n = (7, 3, 2), 3, 2
    params = _models.init_params(*shape, seed)
    batch = _models.make_batch(2 * n, shape[0], seed)
    per_rank = [torch.func.grad(_models.loss_fn)(params, _models.rank_slice(batch, r, n))
                for r in range(n)]
    averaged = sf.pytree.tree_map(lambda *g: sum(g) / n, *per_rank)
    clip = optim.clip_by_global_norm(0.05)
    right, _ = clip.update(averaged, clip.init(params))
    clipped = [clip.update(g, clip.init(params))[0] for g in per_rank]
    wrong = sf.pytree.tree_map(lambda *g: sum(g) / n, *clipped)
    assert not torch.allclose(right["emb"], wrong["emb"])


def test_masked_callable_sees_full_shapes_under_shard_opt_state():
    """Guard for "masked": a shape-reading mask on the 1-D pieces would select nothing."""
    from tests.transforms import _models

    params = _models.init_params(5, 3, 2, 0)
    grads = sf.pytree.tree_map(torch.ones_like, params)
    mesh = sf.Mesh({"dp": 1})
    opt = sf.shard_opt_state(optim.masked(optim.scale(0.0), _matrices), mesh, "dp")
    updates, _ = opt.update(grads, opt.init(params), params)
    assert torch.equal(updates["emb"], torch.zeros_like(params["emb"]))  # selected: scaled
    assert torch.equal(updates["b1"], torch.ones_like(params["b1"]))  # not selected: passed


def _nested(axes: tuple[tuple[str, int], ...], seed: int):
    """shard_opt_state over "a" around shard_opt_state over "b" = one sharding over both."""
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    mesh = sf.Mesh(dict(axes))
    opt = sf.shard_opt_state(sf.shard_opt_state(sf.optim.adam(1e-2), mesh, "b"), mesh, "a")
    assert opt.axes == ("a", "b")
    params = _models.init_params(6, 3, 2, seed)
    state = opt.init(params)
    n, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        batch = _models.rank_slice(_models.make_batch(2 * n, 6, seed + step), rank, n)
        updates, state = opt.update(torch.func.grad(_models.loss_fn)(params, batch), state,
                                    params)
        params = sf.optim.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("axes", [(("a", 2), ("b", 1)), (("a", 1), ("b", 2))])
def test_nested_shardings_over_other_axes_shard_over_both(worlds, axes):
    from tests.transforms import _models

    params = _models.init_params(6, 3, 2, 5)
    opt = optim.adam(1e-2)
    state = opt.init(params)
    for step in range(2):
        grads = torch.func.grad(_models.loss_fn)(params, _models.make_batch(4, 6, 5 + step))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    for got in worlds(2).run(_nested, axes, 5):
        assert_close(got, params)


# ---- orders that cannot mean anything: refused when built, naming the valid order ----

def _custom():
    return optim.needs_full_leaves(optim.GradientTransformation(
        lambda params: optim.EmptyState(), lambda u, s, p=None: (u, s)))


def test_refusals_name_the_valid_order():
    mesh = sf.Mesh({"dp": 1})
    zero = sf.shard_opt_state(optim.adamw(1e-3), mesh, "dp")
    with pytest.raises(ValueError, match=r"sharded twice.*shard once.*shard_opt_state\(opt"):
        sf.shard_opt_state(zero, mesh, "dp")
    with pytest.raises(ValueError, match="sharded twice"):  # hidden inside a chain
        sf.shard_opt_state(optim.chain(optim.clip_by_global_norm(1.0), zero), mesh, "dp")
    other = sf.shard_opt_state(optim.sgd(0.1), mesh, "dp", bucket_bytes=64)
    with pytest.raises(ValueError, match=r"one way only.*shard_opt_state\(chain\("):
        optim.chain(zero, other)
    with pytest.raises(ValueError, match=r"multi_transform: .*one way only"):
        optim.multi_transform({"x": zero, "y": other}, {"w": "x"})
    for where, composed in [("argument 1", lambda: optim.chain(zero, _custom())),
                            ("argument 0", lambda: optim.chain(_custom(), zero)),
                            ("argument 0", lambda: optim.chain(
                                optim.masked(_custom(), {"w": True}), zero))]:
        with pytest.raises(ValueError, match=rf"chain: {where} needs whole leaves.*Valid order"):
            composed()
    with pytest.raises(ValueError, match="needs whole leaves"):
        sf.shard_opt_state(optim.chain(optim.scale(1.0), _custom()), mesh, "dp")
    with pytest.raises(TypeError, match=r"Valid order: shard_opt_state\(inject_hyperparams"):
        optim.inject_hyperparams(
            lambda learning_rate: sf.shard_opt_state(optim.sgd(learning_rate), mesh, "dp")
        )(learning_rate=0.1)
    with pytest.raises(TypeError, match="argument 1 is a str"):
        optim.chain(optim.scale(1.0), "adam")
    with pytest.raises(TypeError, match="expects a GradientTransformation"):
        sf.shard_opt_state("adam", mesh, "dp")


def test_a_marked_transform_alone_still_composes_unsharded():
    opt = optim.chain(_custom(), optim.sgd(0.1))  # nothing sharded: nothing to refuse
    params = {"w": torch.ones(2)}
    updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    assert_close(updates["w"], torch.full((2,), -0.1))


# ---- inject_hyperparams ----

def _steps(opt, params, state, grads_seq):
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _problem(seed=0, steps=3):
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
             for _ in range(steps)]
    return params, grads


def test_injected_equals_plain_and_a_changed_lr_is_used():
    params, grads = _problem()
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, weight_decay=0.1)
    state = opt.init(params)
    hp = state.hyperparams
    assert hp["learning_rate"].dtype == torch.float64 and float(hp["learning_rate"]) == 1e-3
    assert float(hp["weight_decay"]) == 0.1 and float(hp["b2"]) == 0.999  # defaults too
    got, state = _steps(opt, params, state, grads[:2])
    plain = optim.adamw(1e-3, weight_decay=0.1)
    want, plain_state = _steps(plain, params, plain.init(params), grads[:2])
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    state = optim.set_hyperparams(state, learning_rate=4e-3)
    got, state = _steps(opt, got, state, grads[2:])
    want, _ = _steps(optim.adamw(4e-3, weight_decay=0.1), want, plain_state, grads[2:])
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert float(state.hyperparams["learning_rate"]) == 4e-3
    # replacing the dict by hand works the same way; a wrong name is refused
    state = state._replace(hyperparams={**state.hyperparams, "learning_rate": torch.tensor(0.0)})
    same, _ = _steps(optim.chain(opt), got, (state,), grads[:1])
    assert torch.equal(same["b"], got["b"] * (1 - 0.0))
    with pytest.raises(ValueError, match="no inject_hyperparams state holds"):
        optim.set_hyperparams(state, lr=1.0)


def test_schedules_are_evaluated_from_the_count_and_stored():
    params, grads = _problem(1, steps=4)
    schedule = optim.linear_schedule(1e-2, 1e-3, 3)
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=schedule)
    state = opt.init(params)
    assert float(state.hyperparams["learning_rate"]) == float(schedule(torch.tensor(0)))
    plain = optim.adamw(schedule)
    plain_params, plain_state = params, plain.init(params)
    for step, g in enumerate(grads):
        params, state = _steps(opt, params, state, [g])
        plain_params, plain_state = _steps(plain, plain_params, plain_state, [g])
        assert float(state.hyperparams["learning_rate"]) == float(schedule(torch.tensor(step)))
        assert all(torch.equal(params[k], plain_params[k]) for k in params)


def test_inject_rejects_bad_arguments_when_built():
    with pytest.raises(ValueError, match="learning_rate"):
        optim.inject_hyperparams(optim.adamw)(learning_rate=-1.0)
    with pytest.raises(TypeError):
        optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, momentum=0.9)
    with pytest.raises(TypeError, match="static_args"):
        optim.inject_hyperparams(optim.adamw, static_args=("nope",))


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_restores_changed_hyperparams(tmp_path, sharded):
    """FairScale OSS's param_groups test: change the lr, save, load into a fresh optimizer."""
    import shardfn.checkpoint as ck

    mesh = sf.Mesh({"dp": 1})

    def make():
        opt = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, weight_decay=0.1)
        return sf.shard_opt_state(opt, mesh, "dp") if sharded else opt

    params, grads = _problem(2)
    opt = make()
    params, state = _steps(opt, params, opt.init(params), grads[:1])
    state = optim.set_hyperparams(state, learning_rate=2.5e-4, weight_decay=0.5)
    ck.save(str(tmp_path / "c"), {"params": params, "opt": state}, mesh, {"opt": opt})
    fresh = make()
    like = {"params": sf.pytree.tree_map(torch.zeros_like, params), "opt": fresh.init(params)}
    loaded = ck.load(str(tmp_path / "c"), like, mesh, {"opt": fresh})
    hp = (loaded["opt"].inner if sharded else loaded["opt"]).hyperparams
    assert float(hp["learning_rate"]) == 2.5e-4 and float(hp["weight_decay"]) == 0.5
    want, _ = _steps(opt, params, state, grads[1:])
    got, _ = _steps(fresh, loaded["params"], loaded["opt"], grads[1:])
    assert all(torch.equal(got[k], want[k]) for k in want)


def _injected_replicated(n: int):
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    mesh = sf.Mesh({"dp": n})
    opt = sf.optim.chain(sf.optim.clip_by_global_norm(1.0), sf.shard_opt_state(
        sf.optim.inject_hyperparams(sf.optim.adamw)(learning_rate=1e-2), mesh, "dp"))
    params = _models.init_params(9, 3, 2, 0)
    state = sf.optim.set_hyperparams(opt.init(params), learning_rate=2e-3)
    batch = _models.rank_slice(_models.make_batch(2 * n, 9, 0), dist.get_rank(), n)
    _, state = opt.update(torch.func.grad(_models.loss_fn)(params, batch), state, params)
    return state.inner[1].hyperparams, state.inner[1].inner_state.mu["emb"].shape


def test_hyperparams_are_replicated_under_shard_opt_state(worlds):
    results = worlds(2).run(_injected_replicated, 2)
    for hyperparams, mu_shape in results:
        assert float(hyperparams["learning_rate"]) == 2e-3
        assert all(v.shape == () for v in hyperparams.values())
        assert mu_shape[0] < 9 * 3  # the moments are this rank's piece
        assert_close(hyperparams, results[0][0], rtol=0, atol=0)


def test_a_callable_that_is_no_schedule_needs_static_args():
    params, grads = _problem(3, steps=1)
    with pytest.raises(TypeError, match=r"static_args=\('mask',\)"):
        optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, mask=_matrices)
    opt = optim.inject_hyperparams(optim.adamw, static_args="mask")(
        learning_rate=1e-3, weight_decay=0.5, mask=_matrices)
    assert set(opt.init(params).hyperparams) == {"learning_rate", "b1", "b2", "eps",
                                                  "weight_decay"}
    got, _ = _steps(opt, params, opt.init(params), grads)
    plain = optim.adamw(1e-3, weight_decay=0.5, mask=_matrices)
    want, _ = _steps(plain, params, plain.init(params), grads)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_donating_a_sharded_optimizer_points_to_donate_true():
    zero = sf.shard_opt_state(optim.sgd(0.1), sf.Mesh({"dp": 1}), "dp")
    with pytest.raises(TypeError, match=r"donate=True"):
        optim.donating(zero)
