"""shard_params(remat=...) recomputes under the forward's autocast state.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the forward computes the
matmuls in bf16. A recompute in backward that ignores autocast runs them in
float32 and differentiates a different function (and, with a policy that saves
matmul outputs, replays values the recompute does not produce). Like
``torch.utils.checkpoint``, shard_params captures the autocast state in forward
and replays it in the recompute: the gradients with ``remat=nothing_saveable`` or
``dots_saveable`` equal those without remat (same autocast, float32 round-off), and
the unsharded autocast reference within bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.remat import checkpoint_policies
from tests.transforms.test_shard_params import Block

# bf16 keeps 8 mantissa bits (relative step 2**-8 = 0.0039); a gradient through a few
# bf16 matmuls of width <= 7 and a cross-rank mean stays within 2e-2 of the unsharded
# autocast reference (which rounds the same products, but sums the batch in another order)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
POLICIES = {"none": None, "nothing_saveable": checkpoint_policies.nothing_saveable,
            "dots_saveable": checkpoint_policies.dots_saveable}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), Block(6, 7), Block(6, 5), Block(6, 3),
                         nn.Linear(6, 2))


def _batch(n: int) -> torch.Tensor:
    return torch.randn(4 * n, 3, generator=torch.Generator().manual_seed(1))


def _loss(apply, params, x):
    """The loss with the forward under bf16 autocast; the backward runs after it, outside
    (as with ``with autocast: loss = ...`` then ``loss.backward()``)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return apply(params, x).float().square().mean()


def _autocast_on_rank(n: int, how: str):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank() if dist.is_initialized() else 0
    fmodel = sf.functional(_net())
    mesh = sf.Mesh({"dp": n})
    x = _batch(n).chunk(n)[rank]
    out = {}
    for label, policy in POLICIES.items():
        model = shard_params(fmodel, mesh, "dp", units=Block, remat=policy)
        shards = model.init(0)
        if how == "func":
            grads = torch.func.grad(lambda p, m=model: _loss(m.apply, p, x))(shards)
        else:
            leaves = {k: v.clone().requires_grad_() for k, v in shards.items()}
            _loss(model.apply, leaves, x).backward()
            grads = {k: v.grad for k, v in leaves.items()}
        grads = {k: g for k, g in grads.items() if g is not None}
        out[label] = {k: v for k, v in sf.gather({**shards, **grads}, model.specs, mesh).items()
                      if k in grads}
    return out


@pytest.mark.parametrize("how", ["func", "autograd"])
def test_remat_recomputes_under_the_forward_autocast(worlds, how):
    n = 2
    fmodel = sf.functional(_net())
    params = fmodel.init(0)
    reference = torch.func.grad(lambda p: _loss(fmodel.apply, p, _batch(n)))(params)
    # the reference differs from float32: autocast is really on
    float32 = torch.func.grad(lambda p: fmodel.apply(p, _batch(n)).square().mean())(params)
    assert any((reference[k] - float32[k]).abs().max() > 1e-4 for k in reference)
    for rank_grads in worlds(n).run(_autocast_on_rank, n, how):
        kept = rank_grads["none"]
        for label in ("nothing_saveable", "dots_saveable"):
            for name, grad in kept.items():
                # the recompute differentiates the forward's (bf16) function: float32
                # round-off of the no-remat gradients
                assert_close(rank_grads[label][name], grad,
                             msg=lambda m, k=name, lb=label: f"{lb}: {k}: {m}")
        for name, grad in kept.items():
            assert_close(grad, reference[name], **BF16_TOL)
