"""Dropout RNG under tensor_split: a shared stream in replicated regions, per-rank in split ones.

The rule (``shardfn/transforms/_tp_rng.py``, docs/tensor_parallel.md): replicated
regions draw from the global generator as the unsplit model does; ``SplitRNG`` /
``SequenceParallel`` modules draw from a per-rank stream seeded from a peek of the
global generator and the tp rank, which they never consume; a call that used the
per-rank stream advances the global generator by one draw at the end. Checked:

* masks equal across ranks in replicated regions and equal to the unsplit model's;
  different across ranks in split regions (local heads, sequence chunks);
* the same global seed gives the same masks twice; the next call gets new ones;
* a plan without split-region modules consumes the global generator exactly as the
  unsplit model (its RNG state after a call is the unsplit model's);
* the reference GPT with dropout on only in replicated regions equals the unsplit
  GPT with dropout on (loss and gradients, under torch.func.grad and autograd);
  with attention dropout too, and with sequence parallelism, the loss is equal on
  every rank and reproducible.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import GPT, GPTConfig, gpt_tp_plan
from shardfn.transforms._tp_rng import rank_seed, rank_stream
from shardfn.transforms.tensor_split import Colwise, tensor_split


class Mask(nn.Module):
    """Dropout of ones: its output is the mask (0 or 1 / (1 - p))."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(torch.ones_like(x))


class Probe(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 32):
        super().__init__()
        self.rep, self.fc1, self.split, self.fc2 = Mask(), nn.Linear(d, hidden), Mask(), \
            nn.Linear(hidden, d)
        self.chunk = Mask()

    def forward(self, x):
        m_rep = self.rep(x)
        h = self.fc1(x * m_rep)
        m_split = self.split(h)
        y = self.fc2(h * m_split)
        m_chunk = self.chunk(y)  # as on a sequence chunk: a SequenceParallel dropout
        return y * m_chunk, m_rep, m_split, m_chunk


class ReplicatedOnly(nn.Module):
    """Random ops only in the replicated region (before fc1 and after fc2)."""

    def __init__(self, d: int = 4, hidden: int = 32):
        super().__init__()
        self.rep, self.fc1, self.fc2, self.after = Mask(), nn.Linear(d, hidden), \
            nn.Linear(hidden, d), Mask(0.25)

    def forward(self, x):
        return self.after(self.fc2(self.fc1(x * self.rep(x))))


PROBE_PLAN = {"fc1": "colwise", "split": "split_rng", "fc2": "rowwise",
              "chunk": "sequence_parallel"}
X = torch.ones(2, 8, 4)


def _probe_on_rank(n: int, seed: int):
    model = tensor_split(sf.functional(Probe()), sf.Mesh({"tp": n}), "tp", PROBE_PLAN)
    params = model.init(0)
    torch.manual_seed(seed)
    first = model.apply(params, X)
    second = model.apply(params, X)  # no reseed: the next call
    torch.manual_seed(seed)
    again = model.apply(params, X)
    plain = tensor_split(sf.functional(ReplicatedOnly()), model.mesh, "tp",
                         {"fc1": "colwise", "fc2": "rowwise"})
    torch.manual_seed(seed)
    plain.apply(plain.init(0), X)
    return first, second, again, torch.get_rng_state()


@pytest.mark.parametrize("n", [2, 4])
def test_masks_shared_in_replicated_regions_per_rank_in_split_ones(worlds, n):
    seed = 11
    fmodel = sf.functional(Probe())
    torch.manual_seed(seed)
    _, unsplit_rep, _, _ = fmodel.apply(fmodel.init(0), X)
    replicated_only = sf.functional(ReplicatedOnly())
    torch.manual_seed(seed)
    replicated_only.apply(replicated_only.init(0), X)
    unsplit_state = torch.get_rng_state()
    runs = worlds(n).run(_probe_on_rank, n, seed)
    for first, second, again, state_after_plain in runs:
        _, m_rep, m_split, m_chunk = first
        assert_close(m_rep, unsplit_rep)  # replicated: the unsplit model's mask
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)  # the same seed: the same masks
        assert not torch.equal(second[2], m_split)  # the next call: new per-rank masks
        assert not torch.equal(second[3], m_chunk)
        assert m_split.shape == (2, 8, 32 // n)
        # no split-region module: the global generator moved exactly as the unsplit model's
        assert torch.equal(state_after_plain, unsplit_state)
    for rank in range(1, n):
        for k in (2, 3):  # split and chunk masks differ between ranks
            assert not torch.equal(runs[rank][0][k], runs[0][0][k])
        assert torch.equal(runs[rank][0][1], runs[0][0][1])
    assert len({rank_seed(5, r) for r in range(n)}) == n


def _gpt(dropout: float, attention_dropout: bool):
    config = GPTConfig(vocab_size=8, d_model=8, n_layers=2, n_heads=4, seq_len=8, dropout=dropout)
    torch.manual_seed(0)
    module = GPT(config)
    if not attention_dropout:
        for block in module.blocks:
            block.attn.core.dropout = 0.0
    tokens = torch.randint(0, 8, (2, 8))
    targets = torch.randint(0, 8, (2, 8))
    return sf.functional(module), tokens, targets


def _gpt_on_rank(n: int, sp: bool, attention_dropout: bool, seed: int):
    fmodel, tokens, targets = _gpt(0.3, attention_dropout)
    model = tensor_split(fmodel, sf.Mesh({"tp": n}), "tp", gpt_tp_plan(sequence_parallel=sp))
    params = model.init(0)

    def loss_fn(p):
        return sf.vocab_parallel_cross_entropy(model.apply(p, tokens), targets, "tp",
                                               mesh=model.mesh)

    torch.manual_seed(seed)
    grads, loss = torch.func.grad_and_value(loss_fn)(params)
    torch.manual_seed(seed)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    again = loss_fn(leaves)
    again.backward()
    torch.manual_seed(seed + 1)
    other = loss_fn(params)
    return (loss, again.detach(), other, model.gather_params(grads),
            model.gather_params({k: v.grad for k, v in leaves.items()}))


def _unsplit_gpt(attention_dropout: bool, seed: int, dropout: float = 0.3):
    fmodel, tokens, targets = _gpt(dropout, attention_dropout)
    torch.manual_seed(seed)
    return torch.func.grad_and_value(
        lambda p: F.cross_entropy(fmodel.apply(p, tokens).flatten(0, 1), targets.flatten()))(
        fmodel.init(0))


@pytest.mark.parametrize("n", [2, 4])
def test_gpt_with_replicated_dropout_equals_unsplit_with_dropout(worlds, n):
    seed = 5
    grads, loss = _unsplit_gpt(False, seed)
    _, no_dropout = _unsplit_gpt(False, seed, dropout=0.0)
    assert not torch.allclose(loss, no_dropout)  # dropout is on: the test can fail
    for got_loss, again, _, got_grads, got_autograd in worlds(n).run(
            _gpt_on_rank, n, False, False, seed):
        assert_close(got_loss, loss)
        assert_close(again, loss)
        assert_close(got_grads, grads)
        assert_close(got_autograd, grads)


@pytest.mark.parametrize("sp", [False, True])
def test_gpt_with_split_dropout_is_replicated_and_reproducible(worlds, sp):
    n, seed = 2, 5
    _, unsplit = _unsplit_gpt(True, seed)
    runs = worlds(n).run(_gpt_on_rank, n, sp, True, seed)
    for loss, again, other, grads, autograd in runs:
        assert_close(loss, runs[0][0])  # the loss is replicated: shared masks agree
        assert_close(again, loss)  # the same seed, the same masks
        assert not torch.allclose(other, loss)  # another seed, other masks
        assert_close(autograd, grads)
        assert_close(grads, runs[0][3])
        # per-rank masks in split regions: not the unsplit model's draws
        assert not torch.allclose(loss, unsplit)


def test_rank_stream_outside_apply_raises():
    with pytest.raises(RuntimeError, match="outside TensorSplitModel.apply"):
        with rank_stream(torch.device("cpu")):
            pass


def _gathered_net():
    torch.manual_seed(0)
    return sf.functional(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4)))


def _gathered_on_rank(n: int):
    model = tensor_split(_gathered_net(), sf.Mesh({"tp": n}), "tp",
                         {"0": Colwise(gather_output=True)})
    torch.manual_seed(3)
    return model.apply(model.init(0), X)


@pytest.mark.parametrize("n", [2, 4])
def test_dropout_after_a_gathered_colwise_output_is_the_unsplit_mask(worlds, n):
    """The gathered output is replicated: its dropout mask is the unsplit model's, drawn in
    index order (the gather's result is made contiguous, so its layout cannot change it)."""
    fmodel = _gathered_net()
    torch.manual_seed(3)
    expected = fmodel.apply(fmodel.init(0), X)
    for got in worlds(n).run(_gathered_on_rank, n):
        assert_close(got, expected)


def _no_dropout_on_rank(sp: bool):
    fmodel, tokens, _ = _gpt(0.0, True)  # training mode, p = 0: no random op runs
    model = tensor_split(fmodel, sf.Mesh({"tp": 2}), "tp", gpt_tp_plan(sequence_parallel=sp))
    params = model.init(0)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    out = model.apply(params, tokens)
    untouched = torch.equal(before, torch.get_rng_state())
    batched = torch.func.vmap(lambda t: model.apply(params, t))(tokens.unsqueeze(1))
    return untouched, out, batched.squeeze(1)


@pytest.mark.parametrize("sp", [False, True])
def test_split_regions_that_draw_nothing_leave_the_rng_alone(worlds, sp):
    """The per-rank stream's seed is read from the generator's state, not drawn: with
    dropout off, the global generator is untouched (as in the unsplit model) and vmap
    (randomness="error") runs."""
    for untouched, out, batched in worlds(2).run(_no_dropout_on_rank, sp):
        assert untouched
        assert_close(batched, out)
