"""Activation checkpointing over tensor parallelism draws the forward's dropout masks.

``sf.remat`` around ``TensorSplitModel.apply``, and ``shard_params(tp_model, remat=...)``
(FSDP x TP with activation checkpointing), recompute in backward, outside the
``apply`` call whose per-rank dropout streams the split regions (``SplitRNG``,
``SequenceParallel``) draw from. The recomputation must replay those streams as
the forward left them, so loss and gradients equal the same step without remat,
with dropout in replicated and split regions, with and without sequence
parallel, under ``torch.func.grad_and_value`` and autograd; without dropout they
also equal the unsplit model.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import GPT, GPTConfig, gpt_tp_plan
from shardfn.models.gpt import Block as GPTBlock

POLICIES = ("nothing_saveable", "dots_saveable")


def _config(dropout: float) -> GPTConfig:
    return GPTConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=4, seq_len=8,
                     dropout=dropout)


def _batch(b: int, dp_index: int = 0):
    generator = torch.Generator().manual_seed(10 + dp_index)
    return (torch.randint(0, 16, (b, 8), generator=generator),
            torch.randint(0, 16, (b, 8), generator=generator))


def _remat_tp_on_rank(dropout: float, sp: bool, policy: str, b: int):
    mesh = sf.Mesh({"tp": 2})
    model = sf.tensor_split(sf.functional(GPT(_config(dropout))), mesh, "tp",
                            gpt_tp_plan(sequence_parallel=sp))
    params = model.init(3)
    tokens, targets = _batch(b)

    def loss_fn(p, apply):
        return sf.vocab_parallel_cross_entropy(apply(p, tokens), targets, "tp", mesh=mesh)

    rematted = sf.remat(model.apply, policy=getattr(sf.checkpoint_policies, policy))
    torch.manual_seed(5)
    plain = torch.func.grad_and_value(loss_fn)(params, model.apply)
    torch.manual_seed(5)
    remat = torch.func.grad_and_value(loss_fn)(params, rematted)
    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    torch.manual_seed(5)
    autograd_loss = loss_fn(leaves, rematted)
    autograd_loss.backward()
    return (plain, remat, ({n: t.grad for n, t in leaves.items()}, autograd_loss.detach()),
            model.gather_params(plain[0]))


@settings(max_examples=4, deadline=None)
@given(dropout=st.sampled_from([0.0, 0.3]), sp=st.booleans(), policy=st.sampled_from(POLICIES),
       b=st.integers(1, 2))
def test_remat_around_tensor_split_apply_equals_no_remat(worlds, dropout, sp, policy, b):
    results = worlds(2).run(_remat_tp_on_rank, dropout, sp, policy, b)
    if dropout == 0.0:  # then also the unsplit model's
        fmodel = sf.functional(GPT(_config(0.0)))
        tokens, targets = _batch(b)
        grads, loss = torch.func.grad_and_value(
            lambda p: torch.nn.functional.cross_entropy(
                fmodel.apply(p, tokens).flatten(0, 1), targets.flatten()))(fmodel.init(3))
    for (plain_grads, plain_loss), remat, autograd, full_grads in results:
        for grads_, loss_ in (remat, autograd):
            assert_close(loss_, plain_loss, rtol=0, atol=0)
            assert_close(grads_, plain_grads)
        if dropout == 0.0:
            assert_close(plain_loss, loss)
            assert_close(full_grads, grads)


class _SplitDropoutBlock(nn.Module):
    """An MLP block whose hidden dropout is a split region (SplitRNG)."""

    def __init__(self, d: int, hidden: int, p: float):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


class _Net(nn.Module):
    """Units (the blocks), with split-region dropout in the root both before and after them,
    so the root's recomputation must skip past the units' draws of the per-rank stream."""

    def __init__(self, d: int = 8, hidden: int = 16, p: float = 0.4):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.drop_in = nn.Dropout(p)
        self.back = nn.Linear(hidden, d)
        self.blocks = nn.ModuleList(_SplitDropoutBlock(d, hidden, p) for _ in range(2))
        self.up = nn.Linear(d, hidden)
        self.drop_out = nn.Dropout(p)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        x = self.back(self.drop_in(self.inp(x)))
        for block in self.blocks:
            x = block(x)
        return self.down(self.drop_out(self.up(x)))


NET_PLAN = {"inp": "colwise", "drop_in": "split_rng", "back": "rowwise",
            "blocks.*.fc1": "colwise", "blocks.*.drop": "split_rng", "blocks.*.fc2": "rowwise",
            "up": "colwise", "drop_out": "split_rng", "down": "rowwise"}


def _fsdp_tp_on_rank(kind: str, sp: bool, dropout: float, use_autograd: bool):
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    if kind == "gpt":
        fmodel, plan, unit = (sf.functional(GPT(_config(dropout))),
                              gpt_tp_plan(sequence_parallel=sp), GPTBlock)
        tokens, targets = _batch(2, mesh.index("dp"))
    else:
        fmodel, plan, unit = sf.functional(_Net()), NET_PLAN, _SplitDropoutBlock
        generator = torch.Generator().manual_seed(7 + mesh.index("dp"))
        tokens = torch.randn(3, 4, 8, generator=generator)
    tp = sf.tensor_split(fmodel, mesh, "tp", plan)
    results = []
    for policy in (None, *POLICIES):
        remat = None if policy is None else getattr(sf.checkpoint_policies, policy)
        model = sf.shard_params(tp, mesh, "dp", units=unit, remat=remat)
        shards = model.init(0)

        def loss_fn(p, model=model):
            out = model.apply(p, tokens)
            if kind == "gpt":
                return sf.vocab_parallel_cross_entropy(out.flatten(0, 1), targets.flatten(),
                                                       "tp", mesh=mesh)
            return out.square().mean()

        torch.manual_seed(5)
        if use_autograd:
            leaves = {n: t.clone().requires_grad_(True) for n, t in shards.items()}
            loss = loss_fn(leaves)
            loss.backward()
            results.append((loss.detach(), {n: t.grad for n, t in leaves.items()}))
        else:
            grads, loss = torch.func.grad_and_value(loss_fn)(shards)
            results.append((loss, grads))
    return results


@pytest.mark.parametrize("kind, sp, dropout, use_autograd", [
    ("gpt", False, 0.3, False), ("gpt", True, 0.3, False), ("gpt", True, 0.3, True),
    ("net", False, 0.4, False), ("net", False, 0.4, True)])
def test_fsdp_x_tp_with_remat_equals_no_remat(worlds, kind, sp, dropout, use_autograd):
    """shard_params(remat=...) over a TensorSplitModel: the recomputed units and root draw the
    forward's split-region masks (it raised before: the recompute ran outside apply)."""
    for rank, per_policy in enumerate(worlds(4).run(_fsdp_tp_on_rank, kind, sp, dropout,
                                                    use_autograd)):
        (loss, grads), rest = per_policy[0], per_policy[1:]
        for policy, (loss_, grads_) in zip(POLICIES, rest, strict=True):
            assert_close(loss_, loss, rtol=0, atol=0, msg=f"rank {rank}, {policy}")
            assert_close(grads_, grads, msg=lambda m, p=policy, r=rank: f"rank {r}, {p}: {m}")
