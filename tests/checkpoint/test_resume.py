"""Exact resume: K steps, save, load, K more steps == 2K uninterrupted, bit for bit.

On 2 ranks, a model with dropout (each rank its own RNG stream, saved with
``PerRank``) trained with AdamW under ZeRO-3 (``shard_params``) and under ZeRO-1
(``shard_opt_state``). The resumed run starts from fresh processes' state:
``like`` is a newly initialised model with another seed, so nothing but the
checkpoint carries the training over. ``torch.equal`` on every parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

K = 3


class DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _train(kind: str, steps: int, load_from: str | None, save_to: str | None):
    import torch.distributed as dist

    import shardfn as sf
    import shardfn.checkpoint as ck

    rank = dist.get_rank()
    mesh = sf.Mesh({"dp": 2})
    torch.manual_seed(0)
    fmodel = sf.functional(DropMLP())
    adamw = sf.optim.adamw(1e-2, weight_decay=0.1)
    seed = 0 if load_from is None else 99  # a resumed run must not rely on its init
    if kind == "zero3":
        model = sf.shard_params(fmodel, mesh, "dp")
        params, opt, apply = model.init(seed), adamw, model.apply
        layouts = {"params": model, "opt": opt, "rng": ck.PerRank()}
    else:
        params = fmodel.init(seed)
        opt, apply = sf.shard_opt_state(adamw, mesh, "dp"), fmodel.apply
        layouts = {"opt": opt, "rng": ck.PerRank()}
    torch.manual_seed(100 + rank + seed)  # each rank its own dropout masks
    state = {"params": params, "opt": opt.init(params), "step": 0, "rng": torch.get_rng_state()}
    if load_from is not None:
        state = ck.load(load_from, state, mesh, layouts)
        torch.set_rng_state(state["rng"])

    def loss(p, x, y):
        return ((apply(p, x) - y) ** 2).mean()

    params, opt_state, step = state["params"], state["opt"], state["step"]
    for _ in range(steps):
        data = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 6, generator=data), torch.randn(4, 3, generator=data)
        grads = torch.func.grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = sf.optim.apply_updates(params, updates)
        step += 1
    if save_to is not None:
        ck.save(save_to, {"params": params, "opt": opt_state, "step": step,
                          "rng": torch.get_rng_state()}, mesh, layouts)
    full = sf.gather(params, model.specs, mesh) if kind == "zero3" else params
    return {k: v.clone() for k, v in full.items()}, step


@pytest.mark.parametrize("kind", ["zero3", "zero1"])
def test_resume_is_bit_identical(worlds, tmp_path, kind):
    world = worlds(2)
    straight = world.run(_train, kind, 2 * K, None, None)
    path = str(tmp_path / "ckpt")
    first = world.run(_train, kind, K, None, path)
    resumed = world.run(_train, kind, K, path, None)
    for (want, want_step), (got, got_step), (half, _) in zip(straight, resumed, first,
                                                             strict=True):
        assert got_step == want_step == 2 * K
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name
            assert not torch.equal(half[name], want[name]), name  # the last K steps did move
