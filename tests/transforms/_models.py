"""A small pure model with deliberately uneven parameter sizes, for optimizer-sharding tests.

``emb`` is larger than all other parameters together; ``scale`` is a 0-dim
parameter; ``b1`` has a size that rarely divides by the world size.
"""

from __future__ import annotations

import torch


def init_params(vocab: int, d: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(vocab, d, generator=gen) / d**0.5,
        "w1": torch.randn(d, hidden, generator=gen) / d**0.5,
        "b1": torch.randn(hidden, generator=gen) * 0.1,
        "w2": torch.randn(hidden, 1, generator=gen) / hidden**0.5,
        "scale": torch.tensor(1.5),
    }


def loss_fn(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]):
    x, y = batch
    h = torch.tanh(x @ params["emb"])
    h = torch.relu(h @ params["w1"] + params["b1"])
    pred = (h @ params["w2"]).squeeze(-1) * params["scale"]
    return ((pred - y) ** 2).mean()


def make_batch(size: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, vocab, generator=gen), torch.randn(size, generator=gen)


def rank_slice(batch, rank: int, world: int):
    """This rank's equal share of a global batch."""
    return tuple(t.chunk(world)[rank] for t in batch)
