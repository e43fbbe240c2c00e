"""``shard_params(..., reshard_after_forward="units")``: FSDP2's root, kept for backward.

FSDP2 never reshards its root module after forward (its parameters would be gathered
again at once for backward); ``"units"`` does the same: the units reshard (ZeRO-3), the
root's full parameters stay gathered until its backward. Over random unit choices, remat
on or off, ``torch.func`` or autograd, 1-4 ranks: the gradients are those of ``True``
and of the unsharded model, and the step's all-gathers move exactly the root's bytes
once less than ``True`` (``sf.comm_stats``), the reduce-scatters the same.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.shard_params import shard_params
from tests.transforms.test_shard_params import Block


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), Block(6, 7), Block(6, 9), nn.Linear(6, 3))


def _x(n: int) -> torch.Tensor:
    return torch.randn(2 * n, 5, generator=torch.Generator().manual_seed(4))


def _step_on_rank(n: int, reshard, units: list[str], remat: bool, how: str):
    mesh = sf.Mesh({"dp": n})
    rank = mesh.index("dp")
    model = shard_params(sf.functional(_net()), mesh, "dp", units=units,
                         reshard_after_forward=reshard,
                         remat=sf.checkpoint_policies.nothing_saveable if remat else None)
    shards = model.init(0)
    x = _x(n).chunk(n)[rank]
    loss_fn = lambda t: model.apply(t, x).square().mean()  # noqa: E731

    def step():
        if how == "func":
            return torch.func.grad(loss_fn)(shards)
        leaves = {k: v.detach().requires_grad_() for k, v in shards.items()}
        loss_fn(leaves).backward()
        return {k: v.grad for k, v in leaves.items()}

    step()  # warm-up: the prefetch order
    sf.reset_comm_stats()
    grads = step()
    stats = sf.comm_stats()
    return (sf.gather(grads, model.specs, mesh), stats.op_bytes("all_gather"),
            stats.op_bytes("psum_scatter"))


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), units=st.sets(st.sampled_from(["1", "2"])),
       remat=st.booleans(), how=st.sampled_from(["func", "autograd"]))
def test_units_keep_the_root_and_equal_zero3(worlds, n, units, remat, how):
    units = sorted(units)
    fmodel = sf.functional(_net())
    params = fmodel.init(0)
    ref = torch.func.grad(lambda p: fmodel.apply(p, _x(n)).square().mean())(params)
    root = [k for k in params if k.split(".")[0] not in units]
    padded = lambda s: math.ceil(s[0] / n) * math.prod(s[1:]) * 4  # noqa: E731 bytes per rank
    root_bytes = sum(padded(params[k].shape) * (n - 1) for k in root)
    zero3 = worlds(n).run(_step_on_rank, n, True, units, remat, how)
    kept = worlds(n).run(_step_on_rank, n, "units", units, remat, how)
    for (g3, gather3, scatter3), (gk, gather_k, scatter_k) in zip(zero3, kept, strict=True):
        assert gather3 - gather_k == root_bytes, (gather3, gather_k, root_bytes)
        assert scatter3 == scatter_k
        for name in ref:
            assert_close(gk[name], ref[name], msg=lambda m, k=name: f"{k}: {m}")
            assert torch.equal(gk[name], g3[name]), name


def test_bad_reshard_after_forward_is_refused_naming_the_choices():
    fmodel = sf.functional(_net())
    for bad in ("root", 2, None):
        with pytest.raises(ValueError, match=r"reshard_after_forward must be one of "
                                             r"\(True, False, 'units'\)"):
            shard_params(fmodel, sf.Mesh({"dp": 1}), "dp", reshard_after_forward=bad)
    model = shard_params(fmodel, sf.Mesh({"dp": 1}), "dp", reshard_after_forward="units")
    assert model.train().reshard_after_forward == "units"
