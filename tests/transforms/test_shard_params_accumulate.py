"""ShardedModel.accumulate_grads: K micro-batches, one optimizer step, both reduction modes.

* K micro-batches give the same gradients, loss and AdamW update as one batch K
  times the size on one process (float64, see ``make_lm``);
* ``reduce_once`` issues one reduce-scatter per unit (and dtype) per step whatever K
  is; ``reduce_each`` issues K; the all-gathers are those of K forward/backward passes;
* the memory trade-off: ``reduce_once`` holds one full gradient of the model.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.shard_params import shard_params
from tests.transforms.test_shard_params import UNITS, Block, TinyLM

STEPS = 2



def make_lm(case):
    # float64: the per-sample gradients of these tiny models (a LayerNorm over 3 features)
    # cancel ~50-fold in the batch mean, so float32 sums in another order differ by ~1e-4
    # relative; in float64 the default tolerances check the reduction order exactly enough
    torch.manual_seed(0)
    return TinyLM(case["vocab"], case["d"], case["hiddens"]).double()


def make_batch(case, step: int):
    gen = torch.Generator().manual_seed(case["seed"] * 100 + step)
    shape = (case["n"] * case["k"] * case["micro"], case["seq"])
    return (torch.randint(0, case["vocab"], shape, generator=gen),
            torch.randint(0, case["vocab"], shape, generator=gen))


def _train(case, sharded: bool):
    """STEPS AdamW steps: K micro-batches per step when sharded, else the whole batch at once."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank() if sharded and dist.is_initialized() else 0
    fmodel = sf.functional(make_lm(case))
    if sharded:
        mesh = sf.Mesh(case["mesh"])
        model = shard_params(fmodel, mesh, case["axis"], units=UNITS[case["units"]],
                             reshard_after_forward=case["reshard"],
                             replicate_axis=case["replicate"])
        params = model.init(case["seed"])
    else:
        model, params = fmodel, fmodel.init(case["seed"])
    train = {k: params[k] for k in fmodel.trainable_names}
    rest = {k: params[k] for k in params if k not in train}
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(train)

    def loss_fn(train, batch):
        tokens, targets = batch
        logits = model.apply({**rest, **train}, tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    if sharded:
        step_fn = model.accumulate_grads(loss_fn, case["k"], mode=case["mode"])
    else:
        step_fn = torch.func.grad_and_value(loss_fn)
    losses, first_grads, calls = [], None, []
    for step in range(STEPS):
        batch = make_batch(case, step)
        if sharded:
            batch = tuple(t.chunk(case["n"])[rank] for t in batch)
        sf.reset_comm_stats()
        grads, loss = step_fn(train, batch)
        stats = sf.comm_stats()
        calls.append((stats.op_calls("psum_scatter"), stats.op_calls("all_gather")))
        if first_grads is None:
            first_grads = grads if not sharded else sf.gather(
                grads, {k: model.specs[k] for k in grads}, mesh)
        updates, state = opt.update(grads, state, train)
        train = sf.optim.apply_updates(train, updates)
        losses.append(loss.detach())
    final = {**rest, **train}
    if sharded:
        final = sf.gather(final, model.specs, mesh)
        # units with trainable dim-0 leaves, and the root: one reduce-scatter each (1 dtype)
        scattering = sum(1 for u in (*model._units, model._root) if u.scatter)
        gathering = sum(1 for u in (*model._units, model._root) if u.gather)
        calls = (calls, scattering, gathering)
    return final, torch.stack(losses), first_grads, calls


MESHES = [({"dp": 1}, "dp", None), ({"dp": 2}, "dp", None), ({"dp": 3}, "dp", None),
          ({"dp": 4}, "dp", None), ({"replicate": 2, "shard": 2}, "shard", "replicate")]


@settings(max_examples=10)
@given(mesh=st.sampled_from(MESHES), k=st.integers(1, 3),
       mode=st.sampled_from(["reduce_once", "reduce_each"]),
       units=st.sampled_from(sorted(UNITS)), reshard=st.booleans(), d=st.integers(3, 6),
       micro=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_micro_batches_equal_one_big_batch(worlds, mesh, k, mode, units, reshard, d, micro,
                                           seed):
    shape, axis, replicate = mesh
    n = math.prod(shape.values())
    case = dict(n=n, mesh=shape, axis=axis, replicate=replicate, k=k, mode=mode, units=units,
                reshard=reshard, vocab=9, d=d, hiddens=[4, 3], micro=micro, seq=3, seed=seed)
    ref_params, ref_losses, ref_grads, _ = _train(case, sharded=False)
    results = worlds(n).run(_train, case, True)
    for rank, (params, _, grads, (calls, scattering, gathering)) in enumerate(results):
        assert_close(grads, ref_grads, msg=lambda m, r=rank: f"rank {r} grads: {m}")
        assert_close(params, ref_params, msg=lambda m, r=rank: f"rank {r} params: {m}")
        if shape[axis] > 1:
            per_step = scattering if mode == "reduce_once" else k * scattering
            all_gathers = (2 if reshard else 1) * k * gathering
            assert all(c == (per_step, all_gathers) for c in calls), (calls, per_step)
    assert_close(torch.stack([losses for _, losses, _, _ in results]).mean(0), ref_losses)


# ---------------------------------------------------------------- the memory trade-off


def _memory_on_rank(n: int, k: int):
    import shardfn as sf
    import shardfn.memory as mem
    from shardfn.transforms.shard_params import shard_params

    d, blocks = 48, 8
    torch.manual_seed(0)
    fmodel = sf.functional(nn.Sequential(*[Block(d, d) for _ in range(blocks)]))
    model = shard_params(fmodel, sf.Mesh({"dp": n}), units=Block)
    shards = model.init(0)
    x = torch.randn(k * 2, d)
    calls = []

    def loss_fn(p, x):
        mem.mark(f"micro-batch {len(calls)}")  # what the previous micro-batches left behind
        calls.append(None)
        return model.apply(p, x).square().mean()

    between, grads = {}, {}
    for mode in ("reduce_once", "reduce_each"):
        calls.clear()
        with mem.track() as t:
            grads[mode], _ = model.accumulate_grads(loss_fn, k, mode=mode)(shards, x)
        between[mode] = [t.marks[f"micro-batch {i}"] for i in range(k)]
    full = sum(p.numel() * 4 for p in fmodel.module.parameters())
    return between, full, grads


def test_reduce_once_holds_a_full_gradient(worlds):
    n, k = 4, 3
    for between, full, grads in worlds(n).run(_memory_on_rank, n, k):
        # gloo can release a finished collective's buffers (a unit's full parameters and
        # its shard) a little after the wait returns; under load that reached two
        unit = full // 8
        late = 2 * (unit + unit // n) + 64
        assert_close(grads["reduce_once"], grads["reduce_each"])
        assert between["reduce_once"][0] == between["reduce_each"][0] == 0
        for i in range(1, k):
            # reduce_once: every unit's full gradient (float32) waits for the final
            # reduction, next to the running sum of the (zero) shard gradients
            assert full + full / n <= between["reduce_once"][i] <= full + full / n + late
            # reduce_each: only the running sum of the shard gradients (and of the loss)
            assert full / n <= between["reduce_each"][i] <= full / n + late


def test_bad_arguments():
    fmodel = sf.functional(make_lm(dict(vocab=5, d=3, hiddens=[2])))
    model = shard_params(fmodel, sf.Mesh({"dp": 1}), units=Block)
    with pytest.raises(ValueError, match="mode must be"):
        model.accumulate_grads(lambda p, b: 0, 2, mode="once")
    with pytest.raises(ValueError, match="num_micro_batches"):
        model.accumulate_grads(lambda p, b: 0, 0)
    step = model.accumulate_grads(lambda p, b: model.apply(p, b).sum(), 2)
    with pytest.raises(ValueError, match="cannot be split into 2"):
        step(model.init(0), torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="mapping"):
        step([model.init(0)], torch.ones(2, 2, dtype=torch.long))
