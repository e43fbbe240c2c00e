"""shard_params(offload=...): shards on a storage device, units computed on another.

On a CPU-only machine the storage and compute devices are both the CPU, but the
offload path still copies every shard to the compute device before its all-gather
and every gradient shard back after its reduce-scatter (the copies are real, only
the device is the same), so the path and its byte counters are exercised: training
equals the run without offload exactly, and the bytes moved per step are the
documented figures. A meta compute device cannot stand in for a GPU (it holds no
values and gloo cannot gather it), hence the CPU->CPU copies. With CUDA, one more
test checks that offloading lowers the peak GPU memory.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.shard_params import OffloadPolicy, shard_params
from tests.transforms.test_shard_params import (
    UNITS,
    Block,
    grads_and_loss,
    make_batch,
    make_lm,
)

STEPS = 3



def _train_on_rank(case):
    """STEPS AdamW steps with and without offload; the h2d/d2h bytes of each step."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import OffloadPolicy, shard_params

    rank, n = (dist.get_rank() if dist.is_initialized() else 0), case["n"]
    fmodel = sf.functional(make_lm(case))
    mesh = sf.Mesh({"dp": n})
    precision = sf.Precision(torch.bfloat16, output_dtype=torch.float32) \
        if case["bf16"] else None
    out = {}
    for label, offload in (("plain", None), ("offload", OffloadPolicy("cpu", "cpu"))):
        model = shard_params(fmodel, mesh, "dp", units=UNITS[case["units"]],
                             reshard_after_forward=case["reshard"], prefetch=case["prefetch"],
                             precision=precision, offload=offload)
        shards = model.init(case["seed"])
        train = {k: shards[k] for k in fmodel.trainable_names}
        rest = {k: shards[k] for k in shards if k not in train}
        opt = sf.optim.adamw(1e-2, weight_decay=0.1)
        state = opt.init(train)

        def loss_fn(train, tokens, targets, model=model, rest=rest):
            logits = model.apply({**rest, **train}, tokens)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        moved = []
        for step in range(STEPS):
            tokens, targets = (t.chunk(n)[rank] for t in make_batch(case, step))
            sf.reset_comm_stats()
            grads, _ = grads_and_loss(loss_fn, train, tokens, targets, how=case["how"])
            stats = sf.comm_stats()
            moved.append((stats.bytes.get("h2d", 0), stats.bytes.get("d2h", 0),
                          stats.calls.get("d2h", 0)))
            assert all(g.device.type == "cpu" and g.dtype == torch.float32
                       for g in grads.values())
            updates, state = opt.update(grads, state, train)
            train = sf.optim.apply_updates(train, updates)
        local = {**rest, **train}
        # the documented figures, from this rank's shard shapes
        sharded = sum(t.numel() * t.element_size() for k, t in local.items()
                      if model.specs[k].spec != sf.P())
        replicated = sum(t.numel() * t.element_size() for k, t in local.items()
                         if model.specs[k].spec == sf.P())
        trainable = sum(local[k].numel() * local[k].element_size() for k in train)
        gathers = 2 if case["reshard"] else 1
        expected = (gathers * sharded + replicated, trainable, len(train))
        out[label] = (sf.gather(local, model.specs, mesh), moved, expected)
    return out


@settings(max_examples=8)
@given(n=st.integers(1, 4), units=st.sampled_from(sorted(UNITS)), reshard=st.booleans(),
       prefetch=st.integers(0, 2), how=st.sampled_from(["func", "autograd"]),
       bf16=st.booleans(), d=st.integers(3, 7), seed=st.integers(0, 2**16))
def test_offload_equals_no_offload_and_counts_its_copies(worlds, n, units, reshard, prefetch,
                                                         how, bf16, d, seed):
    case = dict(n=n, units=units, reshard=reshard, prefetch=prefetch, how=how, bf16=bf16,
                vocab=9, d=d, hiddens=[4, 6], per_rank=2, seq=3, seed=seed)
    for out in worlds(n).run(_train_on_rank, case):
        (plain, moved_plain, _), (offloaded, moved, expected) = out["plain"], out["offload"]
        assert_close(offloaded, plain, rtol=0, atol=0)  # the same numbers, copied around
        assert all(m == (0, 0, 0) for m in moved_plain)
        # every step: each gather copies its unit's shards in (twice per step when
        # resharding), replicated leaves and buffers once; one gradient shard comes
        # back per trainable leaf
        assert all(m == expected for m in moved), (moved, expected)


def test_init_shard_and_devices():
    fmodel = sf.functional(make_lm(dict(vocab=7, d=4, hiddens=[3])))
    model = shard_params(fmodel, sf.Mesh({"dp": 1}), units=Block, offload=True)
    assert model.offload == OffloadPolicy(
        torch.device("cpu"), torch.device("cuda" if torch.cuda.is_available() else "cpu"),
        torch.cuda.is_available())
    shards = model.init(0)
    assert_close(shards, model.shard(fmodel.init(0)))
    for t in shards.values():
        assert t.device.type == "cpu"
        assert t.is_pinned() == torch.cuda.is_available()
    # the function carries the policy class too (sf.transforms.shard_params is the function)
    assert sf.transforms.shard_params.OffloadPolicy is OffloadPolicy
    with pytest.raises(TypeError, match="offload must be True or an OffloadPolicy"):
        shard_params(fmodel, sf.Mesh({"dp": 1}), offload="cpu")
    with pytest.raises(ValueError, match="meta device holds no values"):
        shard_params(fmodel, sf.Mesh({"dp": 1}), offload=OffloadPolicy("cpu", "meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_lowers_peak_gpu_memory():
    import shardfn.memory as mem

    d, blocks = 512, 8
    torch.manual_seed(0)
    fmodel = sf.functional(nn.Sequential(*[Block(d, 4 * d) for _ in range(blocks)]))
    x = torch.randn(16, d, device="cuda")
    mesh = sf.Mesh({"dp": 1})
    peaks, grads = {}, {}
    for label, offload in (("gpu", None), ("offload", OffloadPolicy("cpu", "cuda"))):
        model = shard_params(fmodel, mesh, units=Block, offload=offload)
        torch.cuda.synchronize()
        with mem.track("cuda") as t:
            shards = model.init(0, device=None if offload else "cuda")
            g = torch.func.grad(lambda p, model=model: model.apply(p, x).square().mean())(shards)
            torch.cuda.synchronize()
        peaks[label] = t.cuda_peak_bytes
        grads[label] = {k: v.cpu() for k, v in g.items()}
        assert all(v.device.type == ("cpu" if offload else "cuda") for v in g.values())
        del shards, g
    assert_close(grads["offload"], grads["gpu"])
    params = sum(p.numel() * 4 for p in fmodel.module.parameters())
    # on the GPU: parameters + gradients (2 x params) without offload; one or two units with
    assert peaks["gpu"] >= 2 * params
    assert peaks["offload"] < 0.5 * peaks["gpu"], peaks
