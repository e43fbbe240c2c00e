"""shard_params computes in the dtypes of the shards it is given; fp16 reductions do not overflow.

* float64 shards of a float32 module compute (and reduce) in float64, as the
  unsharded ``functional.apply`` does: outputs and gradients equal the float64
  single-process reference to float64 tolerance (before the fix they were computed
  in float32, and a float64 input raised);
* a fp16 reduction divides before and after the sum (FSDP2's divide factors), so a
  mean that fits fp16 does not overflow on the way: ``Linear(1, 2)`` with input
  40000 on 2 ranks gives gradient 40000, not inf; on 4 ranks (and HSDP 2x2) 30000
  stays 30000. ``grad_reduce="sum"`` keeps the sum (inf when the sum itself does not
  fit fp16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.remat import checkpoint_policies
from tests.transforms.test_shard_params import Block, TinyLM

# ---------------------------------------------------------------- float64


class FloatNet(nn.Module):
    """Float inputs, two units, a 0-dim parameter, a buffer, a frozen layer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([Block(6, 5), Block(6, 3)])
        self.out = nn.Linear(6, 2)
        self.scale = nn.Parameter(torch.tensor(0.75))
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 6))

    def forward(self, x):
        h = self.frozen(self.inp(x)) + self.shift
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.scale


def _make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "lm":
        return TinyLM(11, 6, [5, 3])
    return FloatNet()


def _double(tree):
    return {k: v.double() if v.is_floating_point() else v for k, v in tree.items()}


def _batch(kind: str, n: int):
    gen = torch.Generator().manual_seed(3)
    if kind == "lm":
        return torch.randint(0, 11, (2 * n, 4), generator=gen), None
    return torch.randn(2 * n, 3, generator=gen, dtype=torch.float64), None


def _loss(kind, apply, params, x):
    out = apply(params, x)
    return out.square().mean() if kind != "lm" else F.log_softmax(out, -1).mean(), out


def _float64_on_rank(kind: str, n: int, options: dict, how: str):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank() if dist.is_initialized() else 0
    fmodel = sf.functional(_make(kind))
    mesh = sf.Mesh({"dp": n})
    model = shard_params(fmodel, mesh, "dp", units=Block, **options)
    shards = _double(model.init(0))
    x = _batch(kind, n)[0].chunk(n)[rank]
    train = {k: v for k, v in shards.items() if k in fmodel.trainable_names}
    rest = {k: v for k, v in shards.items() if k not in train}

    def loss_fn(train):
        return _loss(kind, model.apply, {**rest, **train}, x)

    if how == "func":
        grads, out = torch.func.grad(loss_fn, has_aux=True)(train)
    else:
        leaves = {k: v.clone().requires_grad_() for k, v in train.items()}
        loss, out = loss_fn(leaves)
        loss.backward()
        grads = {k: v.grad for k, v in leaves.items()}
    assert all(g.dtype == torch.float64 for g in grads.values())
    full = sf.gather({**rest, **grads}, model.specs, mesh)
    return {k: full[k] for k in grads}, out.detach()


OPTIONS = {
    "default": {},
    "keep params": dict(reshard_after_forward=False),
    "remat nothing_saveable": dict(remat=checkpoint_policies.nothing_saveable),
    "remat dots_saveable": dict(remat=checkpoint_policies.dots_saveable),
}


@pytest.mark.parametrize("kind", ["float", "lm"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("how", ["func", "autograd"])
def test_float64_shards_compute_in_float64(worlds, kind, option, how):
    n = 2
    fmodel = sf.functional(_make(kind))
    params = _double(fmodel.init(0))
    x = _batch(kind, n)[0]
    train, rest = fmodel.split_trainable(params)
    ref_grads, ref_out = torch.func.grad(
        lambda t: _loss(kind, fmodel.apply, {**rest, **t}, x), has_aux=True)(train)
    assert ref_out.dtype == torch.float64
    for rank, (grads, out) in enumerate(worlds(n).run(_float64_on_rank, kind, n,
                                                      OPTIONS[option], how)):
        assert out.dtype == torch.float64
        # float64 tolerance (assert_close's float64 defaults): float32 compute misses it
        assert_close(out, ref_out.chunk(n)[rank])
        for name, ref in ref_grads.items():
            assert_close(grads[name], ref, msg=lambda m, k=name: f"{k}: {m}")


def test_float64_mixed_dtype_module_and_module_dtype_still_float32():
    """A module with float32 and float64 leaves, given all-float64 shards (one process)."""
    from tests.transforms.test_shard_params import MixedBlock, _mixed

    fmodel = sf.functional(_mixed())
    mesh = sf.Mesh({"dp": 1})
    model = sf.shard_params(fmodel, mesh, "dp", units=MixedBlock)
    x = torch.randn(4, 5, dtype=torch.float64)
    for params in (fmodel.init(0), _double(fmodel.init(0))):
        xs = x.to(params["1.weight"].dtype)
        ref = torch.func.grad(lambda p, xs=xs: fmodel.apply(p, xs).sum())(params)
        got = torch.func.grad(lambda p, xs=xs: model.apply(p, xs).sum())(model.shard(params))
        for name in fmodel.trainable_names:
            assert got[name].dtype == params[name].dtype
            assert_close(got[name], ref[name])


# ---------------------------------------------------------------- fp16 reductions


class Tiny(nn.Module):
    """``Linear(1, 2)`` and a 0-dim parameter: output ``[lin(x), s * x]``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 2)
        self.s = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return torch.cat([self.lin(x), self.s * x], -1)


def _fp16_on_rank(mesh_shape: dict, value: float, precision, grad_reduce: str, master):
    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    torch.manual_seed(0)
    fmodel = sf.functional(Tiny())
    mesh = sf.Mesh(mesh_shape)
    replicate = "rep" if "rep" in mesh_shape else None
    model = shard_params(fmodel, mesh, "dp", replicate_axis=replicate, precision=precision,
                         grad_reduce=grad_reduce)
    shards = {k: v.to(master) for k, v in model.init(0).items()}
    x = torch.full((1, 1), value, dtype=master)
    grads = torch.func.grad(lambda p: model.apply(p, x).float().sum())(shards)
    return sf.gather(grads, model.specs, mesh)


FP16 = sf.Precision(param_dtype=torch.float16)  # reduce_dtype defaults to param_dtype


@pytest.mark.parametrize(("mesh_shape", "value"), [
    ({"dp": 2}, 40000.0),  # the case: 2 * 40000 > 65504
    ({"dp": 4}, 30000.0),  # pre = post = 2: partial sums of 15000 reach 60000
    ({"dp": 2, "rep": 2}, 30000.0),  # HSDP: pre-divided before the reduce-scatter
])
@pytest.mark.parametrize("setup", ["fp16 params", "fp16 precision"])
def test_fp16_mean_that_fits_does_not_overflow(worlds, mesh_shape, value, setup):
    n = 1
    for size in mesh_shape.values():
        n *= size
    master, precision = ((torch.float16, None) if setup == "fp16 params"
                         else (torch.float32, FP16))
    for grads in worlds(n).run(_fp16_on_rank, mesh_shape, value, precision, "mean", master):
        assert grads["lin.weight"].dtype == master
        # every rank's gradient is `value` (x): the mean is exactly `value`, not inf
        assert_close(grads["lin.weight"].float(), torch.full((2, 1), value))
        assert_close(grads["lin.bias"].float(), torch.ones(2))
        assert_close(grads["s"].float(), torch.tensor(value))  # the replicated 0-dim leaf


def test_fp16_sum_keeps_sum_semantics(worlds):
    n, value = 2, 40000.0
    # fp32 masters, fp16 reduction: pre-divided partial sums fit, the sum comes back exactly
    for grads in worlds(n).run(_fp16_on_rank, {"dp": n}, value, FP16, "sum", torch.float32):
        assert_close(grads["lin.weight"], torch.full((2, 1), n * value))
        assert_close(grads["s"], torch.tensor(n * value))
        assert_close(grads["lin.bias"], torch.full((2,), float(n)))
    # fp16 masters: the sum 80000 does not fit fp16, an honest inf (not a wrong finite value)
    for grads in worlds(n).run(_fp16_on_rank, {"dp": n}, value, None, "sum", torch.float16):
        assert torch.isinf(grads["lin.weight"]).all() and torch.isinf(grads["s"])
        assert_close(grads["lin.bias"].float(), torch.full((2,), float(n)))


def _accumulate_on_rank(n: int, mode: str):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank()
    fmodel = sf.functional(_make("float"))
    mesh = sf.Mesh({"dp": n})
    model = shard_params(fmodel, mesh, "dp", units=Block)
    shards = _double(model.init(0))
    train = {k: v for k, v in shards.items() if k in fmodel.trainable_names}
    rest = {k: v for k, v in shards.items() if k not in train}
    x = _batch("float", n)[0].chunk(n)[rank]

    def loss_fn(train, x):
        return model.apply({**rest, **train}, x).square().mean()

    grads, _ = model.accumulate_grads(loss_fn, 2, mode=mode)(train, x)
    assert all(g.dtype == torch.float64 for g in grads.values())
    full = sf.gather({**rest, **grads}, model.specs, mesh)
    return {k: full[k] for k in grads}


@pytest.mark.parametrize("mode", ["reduce_once", "reduce_each"])
def test_float64_gradient_accumulation(worlds, mode):
    n = 2
    fmodel = sf.functional(_make("float"))
    params = _double(fmodel.init(0))
    x = _batch("float", n)[0]
    train = {k: v for k, v in params.items() if k in fmodel.trainable_names}
    ref = torch.func.grad(lambda t: fmodel.apply({**params, **t}, x).square().mean())(train)
    for grads in worlds(n).run(_accumulate_on_rank, n, mode):
        for name, expected in ref.items():
            assert_close(grads[name], expected, msg=lambda m, k=name: f"{k}: {m}")
