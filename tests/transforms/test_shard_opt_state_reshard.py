"""shard_opt_state's gather_state / shard_state move a state between world sizes.

FairScale's OSS tests (state_dict consolidation, loading a consolidated state at
another world size) and DeepSpeed's ZeRO checkpoint resharding check the same
property: train on N ranks, consolidate the optimizer state, load it on M ranks
(or one process), and training goes on exactly as if it had never stopped. Here
for every optimizer combination the library offers, nested trees, a bare tensor
as params and an integer buffer in the tree; against one process that never
reshards.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

EXAMPLES = 12  # per step; every world size 1-4 divides it: equal per-rank batches
K1, K2 = 2, 2  # steps before and after resharding


def _odd_name(name: str) -> bool:
    """A mask/label rule by leaf name: the same for full leaves and 1-D pieces."""
    return len(name) % 2 == 1


def make_opt(name: str):
    import shardfn as sf
    from shardfn import optim
    from shardfn.transforms.loss_scale import skip_nonfinite

    by_name = lambda t: sf.pytree.tree_map_with_path(  # noqa: E731
        lambda n, x: _odd_name(n), t)
    labels = lambda t: sf.pytree.tree_map_with_path(  # noqa: E731
        lambda n, x: "fast" if _odd_name(n) else "slow", t)
    return {
        "sgd_momentum": lambda: optim.sgd(0.05, momentum=0.9, weight_decay=0.01),
        "sgd_nesterov": lambda: optim.sgd(0.05, momentum=0.5, nesterov=True),
        "adam": lambda: optim.adam(1e-2, weight_decay=0.01),
        "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1, mask=by_name),
        "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(0.3), optim.adamw(1e-2)),
        "masked": lambda: optim.chain(optim.masked(optim.sgd(0.1, momentum=0.9), by_name),
                                      optim.adam(1e-2)),
        "multi_transform": lambda: optim.multi_transform(
            {"fast": optim.adamw(3e-2), "slow": optim.chain(optim.clip_by_global_norm(0.2),
                                                            optim.sgd(0.05, momentum=0.8))},
            labels),
        "skip_nonfinite": lambda: skip_nonfinite(optim.adamw(1e-2)),
        "donating": lambda: optim.donating(optim.chain(optim.clip_by_global_norm(0.5),
                                                       optim.sgd(0.05, momentum=0.9))),
        "schedule": lambda: optim.chain(optim.scale_by_schedule(optim.linear_schedule(
            1.0, 0.5, 4)), optim.adam(1e-2)),
    }[name]()


OPTIMIZERS = ["adam", "adamw", "clip_adamw", "donating", "masked", "multi_transform",
              "schedule", "sgd_momentum", "sgd_nesterov", "skip_nonfinite"]
TREES = ["flat", "nested", "bare"]


def make_params(tree: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if tree == "bare":
        return r(6, 5)
    if tree == "flat":
        return {"a": r(3, 4), "bb": r(5), "s": r(())}
    return {"block": {"w": r(4, 3), "bias": r(3)}, "layers": [r(2, 2), r(7)],
            "num_batches_tracked": torch.tensor(4)}


def local_grads(params, step: int, rank: int, world: int, seed: int):
    """The mean over this rank's examples of g_e = p * a_e + b_e (frozen ints: zeros)."""
    import shardfn as sf

    lo, hi = rank * EXAMPLES // world, (rank + 1) * EXAMPLES // world

    def grad(name, p):
        if not p.is_floating_point():
            return torch.zeros_like(p)
        gen = torch.Generator().manual_seed(seed * 1000 + step * 37 + len(name))
        a = torch.rand(EXAMPLES, generator=gen)
        b = torch.randn(EXAMPLES, *p.shape, generator=gen)
        return p * a[lo:hi].mean() + b[lo:hi].mean(0)

    return sf.pytree.tree_map_with_path(grad, params)


def _phase(opt_name, params, full_state, steps, seed):
    """On one world: load (or init) the state, train ``steps``, consolidate."""
    import torch.distributed as dist

    import shardfn as sf

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    opt = sf.shard_opt_state(make_opt(opt_name), sf.Mesh({"dp": world}), "dp",
                             bucket_bytes=28)
    state = opt.init(params) if full_state is None else opt.shard_state(full_state, params)
    for step in steps:
        grads = local_grads(params, step, rank, world, seed)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    return params, opt.gather_state(state, params)


def _reference(opt_name, tree, seed, steps):
    import shardfn as sf

    params = make_params(tree, seed)
    opt = make_opt(opt_name)
    state = opt.init(params)
    out = []
    for step in range(steps):
        updates, state = opt.update(local_grads(params, step, 0, 1, seed), state, params)
        params = sf.optim.apply_updates(params, updates)
        out.append(sf.pytree.tree_map(torch.clone, (params, state)))  # donation reuses state
    return out


def _check_round_trip(worlds, opt_name, tree, n, m, seed):
    reference = _reference(opt_name, tree, seed, K1 + K2)
    first = worlds(n).run(_phase, opt_name, make_params(tree, seed), None, range(K1), seed)
    for rank, (params, state) in enumerate(first):
        ref_params, ref_state = reference[K1 - 1]
        assert_close(params, ref_params, msg=lambda e, r=rank: f"N={n} rank {r} params: {e}")
        assert_close(state, ref_state, msg=lambda e, r=rank: f"N={n} rank {r} state: {e}")
    params, full_state = first[0]
    second = worlds(m).run(_phase, opt_name, params, full_state, range(K1, K1 + K2), seed)
    for rank, (params, state) in enumerate(second):
        ref_params, ref_state = reference[-1]
        assert_close(params, ref_params,
                     msg=lambda e, r=rank: f"N={n} -> M={m} rank {r} params: {e}")
        assert_close(state, ref_state,
                     msg=lambda e, r=rank: f"N={n} -> M={m} rank {r} state: {e}")


@given(n=st.integers(1, 4), m=st.integers(1, 4), opt_name=st.sampled_from(OPTIMIZERS),
       tree=st.sampled_from(TREES), seed=st.integers(0, 2**10))
def test_state_moves_between_any_world_sizes(worlds, n, m, opt_name, tree, seed):
    _check_round_trip(worlds, opt_name, tree, n, m, seed)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("tree", TREES)
def test_every_optimizer_reshards_from_2_to_3_ranks(worlds, opt_name, tree):
    """Every combination at least once (the property test samples some of them)."""
    _check_round_trip(worlds, opt_name, tree, 2, 3, seed=5)


def test_consolidated_state_loads_in_one_process_without_shard_opt_state(worlds):
    """FairScale's consolidate_state_dict: the gathered state is the plain optimizer's."""
    import shardfn as sf

    reference = _reference("multi_transform", "nested", 3, K1 + K2)
    params, full_state = worlds(3).run(_phase, "multi_transform", make_params("nested", 3),
                                       None, range(K1), 3)[1]
    opt = make_opt("multi_transform")
    for step in range(K1, K1 + K2):
        updates, full_state = opt.update(local_grads(params, step, 0, 1, 3), full_state, params)
        params = sf.optim.apply_updates(params, updates)
    assert_close(params, reference[-1][0])
    assert_close(full_state, reference[-1][1])


def _unreshardable():
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.optim import GradientTransformation

    def init(params):  # a per-leaf statistic of this rank's piece: not elementwise
        return {"norms": sf.pytree.tree_map(lambda p: p.abs().sum(), params)}

    def update(updates, state, params=None):
        return updates, state

    n = dist.get_world_size()
    opt = sf.shard_opt_state(GradientTransformation(init, update), sf.Mesh({"dp": n}), "dp")
    params = {"w": torch.ones(4, 2), "b": torch.ones(3)}
    state = opt.init(params)
    errors = []
    for call in (lambda: opt.gather_state(state, params),
                 lambda: opt.shard_state({"norms": {"w": torch.tensor(8.0),
                                                    "b": torch.tensor(3.0)}}, params)):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_a_state_that_cannot_be_resharded_is_refused_naming_its_path(worlds):
    for errors in worlds(2).run(_unreshardable):
        assert len(errors) == 2
        assert all("norms.b" in e and "cannot be resharded" in e for e in errors), errors


def _wrong_full_state():
    import shardfn as sf

    opt = sf.shard_opt_state(sf.optim.adam(0.1), sf.Mesh({"dp": 2}), "dp")
    params = {"w": torch.ones(4, 2), "b": torch.ones(3)}
    full = sf.optim.adam(0.1).init({"w": torch.ones(8), "b": torch.ones(3)})
    try:
        opt.shard_state(full, params)
    except ValueError as err:
        return str(err)
    return None


def test_a_full_state_of_the_wrong_shape_is_refused_naming_its_path(worlds):
    for message in worlds(2).run(_wrong_full_state):
        assert message and "mu.w" in message and "(4, 2)" in message, message


def _rewind(opt_name: str, seed: int):
    """FairScale's test_reproducibility: consolidate, take two steps, load the consolidated
    state back (same world) and take the same two steps again: the same parameters."""
    import torch.distributed as dist

    import shardfn as sf

    n, rank = dist.get_world_size(), dist.get_rank()
    opt = sf.shard_opt_state(make_opt(opt_name), sf.Mesh({"dp": n}), "dp", bucket_bytes=28)
    params = make_params("nested", seed)
    state = opt.init(params)

    def steps(params, state, which):
        for step in which:
            updates, state = opt.update(local_grads(params, step, rank, n, seed), state, params)
            params = sf.optim.apply_updates(params, updates)
        return params, state

    params, state = steps(params, state, range(2))
    saved = sf.pytree.tree_map(torch.clone, (params, opt.gather_state(state, params)))
    first, _ = steps(params, state, range(2, 4))
    again, _ = steps(saved[0], opt.shard_state(saved[1], saved[0]), range(2, 4))
    return all(torch.equal(a, b) for a, b in zip(sf.pytree.tree_leaves(first),
                                                 sf.pytree.tree_leaves(again), strict=True))


@pytest.mark.parametrize("opt_name", ["adamw", "masked", "skip_nonfinite"])
def test_reloading_a_consolidated_state_reproduces_training_bitwise(worlds, opt_name):
    assert worlds(3).run(_rewind, opt_name, 2) == [True] * 3
