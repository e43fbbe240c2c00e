"""The prefetch guess (the previous forward's unit order) never changes a gradient.

``ShardedModel`` carries one piece of state between calls, its ``PrefetchGuess``.
It may only decide which gathers are issued ahead and which deferred reduction a
unit call offers to wait for; this test forces wrong guesses (reversed, repeated,
too short, too long) and unit orders that differ from call to call, and checks
that every gradient is bitwise the same as with the model's own guess.
"""

from __future__ import annotations

import pytest


def _grads_under_guesses(remat_name: str | None) -> dict:
    import torch
    from torch import nn

    import shardfn as sf

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
            self.head = nn.Linear(6, 3)

        def forward(self, x, order):
            for i in order:
                x = torch.tanh(self.blocks[i](x))
            return self.head(x)

    mesh = sf.Mesh({"dp": torch.distributed.get_world_size()})
    remat = getattr(sf.checkpoint_policies, remat_name) if remat_name else None
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1 + mesh.index("dp")))
    out = {}
    for guess in (None, [3, 2, 1, 0], [0, 0, 0, 0], [1], list(range(4)) * 2):
        model = sf.shard_params(sf.functional(Net()), mesh, "dp", units=nn.Linear, prefetch=2,
                                remat=remat)
        shards = model.init(0)
        results = []
        for order in ([0, 1, 2, 3], [2, 0, 3, 1, 2], [3]):
            if guess is not None:
                model._guess.order = list(guess)
            results.append(torch.func.grad(
                lambda s, order=order, model=model: model.apply(s, x, order).square().sum())(
                shards))
        out[str(guess)] = results
    return out


@pytest.mark.parametrize("remat_name", [None, "nothing_saveable"])
def test_a_wrong_prefetch_guess_changes_no_gradient(worlds, remat_name):
    import torch

    for out in worlds(2).run(_grads_under_guesses, remat_name):
        reference = out["None"]
        for guess, results in out.items():
            for ref_grads, grads in zip(reference, results, strict=True):
                for name in ref_grads:
                    assert torch.equal(ref_grads[name], grads[name]), (guess, name)
