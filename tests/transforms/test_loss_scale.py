"""Loss scaling: overflow on one rank's shard skips the step everywhere and halves the scale."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from shardfn.transforms.loss_scale import (
    all_finite,
    dynamic_loss_scale,
    skip_nonfinite,
    static_loss_scale,
)


def _step_with_inf(bad_rank: int, bad_step: int, steps: int):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.loss_scale import all_finite, dynamic_loss_scale, skip_nonfinite

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = sf.Mesh({"dp": n})
    full = {"w": torch.arange(12.0).reshape(6, 2) / 10, "b": torch.ones(3)}
    specs = {"w": sf.P("dp"), "b": sf.P()}
    shards = sf.shard(full, specs, mesh)
    scaler = dynamic_loss_scale(init_scale=1024.0, growth_interval=100)
    opt = skip_nonfinite(sf.optim.adam(0.1))
    sstate, ostate = scaler.init(), opt.init(shards)
    history = []
    for step in range(steps):
        scale = sstate.scale
        grads = sf.pytree.tree_map(lambda p, s=scale: torch.ones_like(p) * s, shards)
        if rank == bad_rank and step == bad_step:
            grads["w"] = grads["w"].clone()
            grads["w"][0, 0] = float("inf")
        finite = all_finite(grads, "dp", mesh=mesh)
        grads = scaler.unscale(grads, sstate)
        before = (shards, ostate)
        updates, ostate = opt.update(grads, ostate, shards, finite=finite)
        shards = sf.optim.apply_updates(shards, updates)
        sstate = scaler.update(sstate, finite)
        history.append((finite, float(sstate.scale), int(ostate.inner.count),
                        all(torch.equal(a, b) for a, b in zip(
                            sf.pytree.tree_leaves(before[0]), sf.pytree.tree_leaves(shards),
                            strict=True))))
    return history


@given(n=st.integers(2, 4), bad_rank=st.integers(0, 3), bad_step=st.integers(0, 2))
def test_inf_on_one_rank_skips_the_step_on_every_rank(worlds, n, bad_rank, bad_step):
    bad_rank %= n
    results = worlds(n).run(_step_with_inf, bad_rank, bad_step, 3)
    for rank, history in enumerate(results):
        assert history == results[0], f"rank {rank} disagrees with rank 0"
        for step, (finite, scale, count, unchanged) in enumerate(history):
            skipped = step >= bad_step
            assert finite == (step != bad_step)
            assert scale == (512.0 if skipped else 1024.0)
            assert count == (step if skipped else step + 1)  # adam's count did not advance
            assert unchanged == (step == bad_step)  # no parameter changes on the skipped step


def test_scale_grows_after_the_interval_and_respects_min_scale():
    scaler = dynamic_loss_scale(init_scale=4.0, growth_interval=3, min_scale=1.0)
    state = scaler.init()
    scales = []
    for finite in [True, True, True, True, False, False, False, True]:
        state = scaler.update(state, finite)
        scales.append(float(state.scale))
    assert scales == [4.0, 4.0, 8.0, 8.0, 4.0, 2.0, 1.0, 1.0]
    assert float(static_loss_scale(8.0).update(static_loss_scale(8.0).init(), False).scale) == 8.0


def test_scaling_rescues_fp16_gradients_that_underflow():
    x = torch.full((4,), 1e-4, dtype=torch.float16)
    w = torch.full((4,), 1e-4, dtype=torch.float16)

    def loss(w, factor):
        return (w * x).sum().float() * factor  # fp16 compute, fp32 loss (as autocast)

    plain = torch.func.grad(loss)(w, 1e-4)  # 1e-8 per element underflows in fp16
    scaler = dynamic_loss_scale(init_scale=2.0**16)
    state = scaler.init()
    scaled = torch.func.grad(lambda w: scaler.scale(loss(w, 1e-4), state))(w)
    unscaled = scaler.unscale({"w": scaled}, state)["w"]
    assert torch.count_nonzero(plain) == 0
    assert_close(unscaled.float(), torch.full((4,), 1e-8), rtol=1e-2, atol=0)


def test_all_finite_local():
    assert all_finite({"a": torch.ones(2), "b": torch.zeros(1)})
    assert not all_finite({"a": torch.tensor([1.0, float("nan")])})
    opt = skip_nonfinite(torch_free_sgd())
    state = opt.init({"w": torch.ones(2)})
    bad = {"w": torch.tensor([float("inf"), 1.0])}
    updates, state = opt.update(bad, state, {"w": torch.ones(2)})
    assert torch.equal(updates["w"], torch.zeros(2)) and int(state.skipped) == 1


def torch_free_sgd():
    import shardfn as sf

    return sf.optim.sgd(0.1)


def _composed(order: str, bad_rank: int, steps: int, overlap: bool):
    """shard_opt_state and skip_nonfinite in either order, default ``finite``; an inf in one
    rank's local gradient at step 1."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.loss_scale import skip_nonfinite

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = sf.Mesh({"dp": n})
    params = {"w": torch.arange(10.0).reshape(5, 2) / 10, "b": torch.ones(3)}
    inner = sf.optim.chain(sf.optim.clip_by_global_norm(1.0), sf.optim.adamw(0.1))
    if order == "shard_outside":
        opt = sf.shard_opt_state(skip_nonfinite(inner), mesh, "dp", bucket_bytes=16)
    else:
        opt = skip_nonfinite(sf.shard_opt_state(inner, mesh, "dp", bucket_bytes=16))
    state = opt.init(params)
    history = []
    for step in range(steps):
        grads = {k: torch.full_like(v, 0.1 * (rank + 1)) for k, v in params.items()}
        if rank == bad_rank and step == 1:
            grads["w"][0, 0] = float("inf")
        if overlap and order == "shard_outside":
            leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
            with opt.overlap(leaves) as sync:
                sum((leaves[k] * grads[k]).sum() for k in leaves).backward()
            grads = sync.grads()
        before = [t.clone() for t in sf.pytree.tree_leaves((params, state))]
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        after = sf.pytree.tree_leaves((params, state))
        counts = [t for t in after if t.dtype == torch.int64 and t.dim() == 0]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True)
                        if a.dtype != torch.int64)
        history.append((unchanged, [int(c) for c in counts]))
    return params, history


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("order, overlap", [("shard_outside", False), ("shard_outside", True),
                                            ("skip_outside", False)])
def test_skip_nonfinite_and_shard_opt_state_skip_together_in_either_order(
        worlds, n, order, overlap):
    """The rank with the inf and every other rank skip step 1 together (params, moments and
    step counts unchanged everywhere); no partial step, no hang."""
    bad_rank = n - 1
    results = worlds(n).run(_composed, order, bad_rank, 3, overlap, timeout=60)
    for rank, (params, history) in enumerate(results):
        assert_close(params, results[0][0], msg=lambda m, r=rank: f"rank {r}: {m}")
        assert [unchanged for unchanged, _ in history] == [False, True, False], (rank, history)
        assert history == results[0][1], f"rank {rank} disagrees with rank 0"
        assert all(torch.isfinite(p).all() for p in params.values())
