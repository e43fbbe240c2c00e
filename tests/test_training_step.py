"""A whole pure training step on 2 and 4 ranks equals one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf

STEPS = 5


def _make_module() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.LayerNorm(10), nn.Linear(10, 3))


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _train(world: int):
    """The step of the docs: functional model, grad_and_value, pmean over "dp", adamw."""
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = sf.Mesh({"dp": world})
    model = sf.functional(_make_module())
    params = model.init(0)
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)

    def loss_fn(params, x, y):
        return ((model.apply(params, x) - y) ** 2).mean()

    @torch.no_grad()
    def step(params, state, x, y):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        grads = sf.pmean(grads, "dp", mesh=mesh)
        updates, state = opt.update(grads, state, params)
        return sf.optim.apply_updates(params, updates), state, sf.pmean(loss, "dp", mesh=mesh)

    losses = []
    for i in range(STEPS):
        x, y = _batch(i)
        params, state, loss = step(params, state, x.chunk(world)[rank], y.chunk(world)[rank])
        losses.append(loss)
    return torch.stack(losses), params


@pytest.mark.parametrize("world", [2, 4])
def test_pure_step_matches_single_process(worlds, world):
    ref_losses, ref_params = _train(1)
    for rank, (losses, params) in enumerate(worlds(world).run(_train, world)):
        assert_close(losses, ref_losses, msg=lambda m, r=rank: f"rank {r} losses: {m}")
        assert_close(params, ref_params, msg=lambda m, r=rank: f"rank {r} params: {m}")


def test_reference_is_not_trivially_equal():
    """Guard: training changes the parameters, so the comparison above means something."""
    _, trained = _train(1)
    initial = sf.functional(_make_module()).init(0)
    assert not torch.allclose(trained["0.weight"], initial["0.weight"])
