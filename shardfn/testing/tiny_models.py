"""Small random models for property tests: MLP- and transformer-like, with the awkward parts.

A :class:`TinyModel` is a frozen, picklable description (what the hypothesis
strategy :func:`shardfn.testing.strategies.models` draws); calling it builds the
``nn.Module``. Options add what breaks sharded code: ``tied`` (one weight used
twice), ``buffer`` (a non-trainable tensor used in forward), ``frozen`` (a layer
with ``requires_grad=False``). :meth:`TinyModel.batch` makes an input and a
target for :meth:`TinyModel.loss`.

Example:
    >>> spec = TinyModel("mlp", d_model=8, hidden=12, n_layers=2, tied=True)
    >>> fmodel = sf.functional(spec())
    >>> x, y = spec.batch(4, seed=0)
    >>> loss = spec.loss(fmodel.apply, fmodel.init(0), (x, y))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["TinyMLP", "TinyModel", "TinyTransformer"]


class TinyMLP(nn.Module):
    """``n_layers`` blocks ``x + fc2(gelu(fc1(x)))`` between an input and an output projection.

    ``tied``: the output projection's weight is the input projection's; ``buffer``: a
    ``scale`` buffer multiplies the input; ``frozen``: the input projection is frozen.
    """

    def __init__(self, d_model: int, hidden: int, n_layers: int, *, tied: bool = False,
                 buffer: bool = False, frozen: bool = False):
        super().__init__()
        self.inp = nn.Linear(d_model, d_model)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
            for _ in range(n_layers))
        self.out = nn.Linear(d_model, d_model, bias=False)
        if tied:
            self.out.weight = self.inp.weight
        if buffer:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, d_model))
        if frozen:
            self.inp.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "scale"):
            x = x * self.scale
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class TinyTransformer(nn.Module):
    """Embedding, ``n_layers`` pre-norm attention + MLP blocks, a head (tied: the embedding)."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, seq: int, *,
                 tied: bool = False, buffer: bool = False, frozen: bool = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 2 * d_model, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if buffer:
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))
        if frozen:
            self.norm.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        mask = self.mask if hasattr(self, "mask") else None
        for block in self.blocks:
            h = block(h, src_mask=mask)
        return self.head(self.norm(h))


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """A picklable factory of a tiny model; ``spec()`` builds the ``nn.Module``.

    Attributes:
        kind: ``"mlp"`` or ``"transformer"``.
        d_model, hidden, n_layers: sizes (``hidden`` is the MLP width; a transformer's is
            ``2 * d_model``).
        vocab, n_heads, seq: transformer sizes.
        tied, buffer, frozen: the options of :class:`TinyMLP` / :class:`TinyTransformer`.
    """

    kind: str = "mlp"
    d_model: int = 8
    hidden: int = 16
    n_layers: int = 1
    vocab: int = 11
    n_heads: int = 2
    seq: int = 8
    tied: bool = False
    buffer: bool = False
    frozen: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "transformer"):
            raise ValueError(f"TinyModel kind must be 'mlp' or 'transformer', got {self.kind!r}")
        if self.kind == "transformer" and self.d_model % self.n_heads:
            raise ValueError(f"TinyModel: d_model {self.d_model} must divide by n_heads "
                             f"{self.n_heads}")

    def __call__(self) -> nn.Module:
        options = dict(tied=self.tied, buffer=self.buffer, frozen=self.frozen)
        if self.kind == "mlp":
            return TinyMLP(self.d_model, self.hidden, self.n_layers, **options)
        return TinyTransformer(self.vocab, self.d_model, self.n_heads, self.n_layers, self.seq,
                               **options)

    def batch(self, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of ``size`` rows from ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        if self.kind == "mlp":
            return (torch.randn(size, self.d_model, generator=gen),
                    torch.randn(size, self.d_model, generator=gen))
        tokens = torch.randint(0, self.vocab, (size, self.seq + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, apply: Callable[..., Any], params: Any, batch: Any) -> torch.Tensor:
        """Mean squared error (mlp) or token cross-entropy (transformer) of ``apply``."""
        x, y = batch
        out = apply(params, x)
        if self.kind == "mlp":
            return (out - y).square().mean()
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
