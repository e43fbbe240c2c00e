"""vocab_parallel_cross_entropy: loss and gradients w.r.t. each rank's logit slice equal
``F.cross_entropy`` of the full logits (computed in the test process), under
torch.func.grad, grad_and_value, vjp and autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf


@st.composite
def cases(draw):
    n = draw(st.sampled_from([1, 2, 4]))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    seq = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 11))  # not divisible by n: padded, some ranks all padding
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    scale = draw(st.sampled_from([1.0, 30.0, 1e4]))
    ignore = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return n, batch + (seq,), vocab, reduction, scale, ignore, seed


def _on_rank(n, local_logits, targets, vocab, reduction, cotangent):
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = sf.Mesh({"tp": n})
    x = local_logits[rank]

    def loss_of(z):
        return sf.vocab_parallel_cross_entropy(z, targets, "tp", mesh=mesh, vocab_size=vocab,
                                               reduction=reduction)

    def scalar(z):
        return (loss_of(z) * cotangent).sum()

    out = loss_of(x)
    g_func = torch.func.grad(scalar)(x)
    g_gv, value = torch.func.grad_and_value(scalar)(x)
    _, vjp_fn = torch.func.vjp(loss_of, x)
    (g_vjp,) = vjp_fn(cotangent)
    leaf = x.clone().requires_grad_()
    scalar(leaf).backward()
    grads = {"grad": g_func, "grad_and_value": g_gv, "vjp": g_vjp, "autograd": leaf.grad}
    return out, value, grads


def _check(worlds, case):
    n, shape, vocab, reduction, scale, ignore, seed = case
    gen = torch.Generator().manual_seed(seed)
    local_vocab = math.ceil(vocab / n)
    full = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale
    targets = torch.randint(0, vocab, shape, generator=gen)
    if ignore:
        targets = torch.where(torch.rand(shape, generator=gen) < 0.4, -100, targets)
        targets.view(-1)[0] = 3 if vocab > 3 else 0  # at least one counted target
    padded = F.pad(full, (0, n * local_vocab - vocab), value=123.0)  # junk in the padding
    local_logits = list(padded.split(local_vocab, dim=-1))

    leaf = full.clone().requires_grad_()
    ref = F.cross_entropy(leaf.reshape(-1, vocab), targets.reshape(-1), reduction=reduction)
    ref = ref.reshape(shape) if reduction == "none" else ref
    cotangent = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * cotangent).sum().backward()
    ref_grad = F.pad(leaf.grad, (0, n * local_vocab - vocab)).split(local_vocab, dim=-1)

    results = worlds(n).run(_on_rank, n, local_logits, targets, vocab, reduction, cotangent)
    for rank, (out, value, grads) in enumerate(results):
        assert torch.isfinite(out).all()
        assert_close(out, ref.detach(), msg=lambda m, r=rank: f"rank {r} loss: {m}")
        assert_close(value, (ref * cotangent).sum().detach())
        for how, g in grads.items():
            assert_close(g, ref_grad[rank], msg=lambda m, r=rank, h=how: f"rank {r} {h}: {m}")


def test_matches_full_cross_entropy(worlds):
    @settings(max_examples=12, deadline=None)
    @given(case=cases())
    def check(case):
        _check(worlds, case)

    check()


@pytest.mark.parametrize("n,vocab", [(2, 7), (4, 10), (4, 5)])
def test_padded_vocab_and_large_logits(worlds, n, vocab):
    """Vocabularies not divisible by the axis (one rank all padding for (4, 5)), logits 1e4."""
    _check(worlds, (n, (2, 3), vocab, "mean", 1e4, True, 7))


def test_float32_and_bfloat16(worlds):
    def on_rank():
        mesh = sf.Mesh({"tp": 2})
        rank = sf.axis_index("tp", mesh=mesh)
        full = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)) * 1e4
        targets = torch.arange(6)
        local = full.chunk(2, dim=-1)[rank]
        ours = [sf.vocab_parallel_cross_entropy(local.to(d), targets, mesh=mesh)
                for d in (torch.float32, torch.bfloat16)]
        return ours, F.cross_entropy(full, targets)

    for (f32, bf16), ref in worlds(2).run(on_rank):
        assert torch.isfinite(f32) and bf16.dtype == torch.bfloat16
        assert_close(f32, ref)
        assert_close(bf16.float(), ref, rtol=1e-2, atol=0.0)  # bf16 rounding of the result


def test_a_missing_reduction_would_be_caught(worlds):
    """Each rank's local cross entropy alone (no psum) differs from the full one."""
    def on_rank():
        mesh = sf.Mesh({"tp": 2})
        rank = sf.axis_index("tp", mesh=mesh)
        full = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        targets = torch.tensor([0, 1, 4, 5])
        local = full.chunk(2, dim=-1)[rank]
        with mesh:
            return sf.vocab_parallel_cross_entropy(local, targets), F.cross_entropy(full, targets)

    for loss, ref in worlds(2).run(on_rank):
        assert_close(loss, ref)
    single = sf.vocab_parallel_cross_entropy  # the 1-rank call on a slice is not the full loss
    with sf.Mesh({"tp": 1}):
        full = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        sliced = single(full[:, :3], torch.tensor([0, 1, 2, 0]))
    assert not torch.allclose(sliced, F.cross_entropy(full, torch.tensor([0, 1, 2, 0])))


def test_errors():
    with sf.Mesh({"tp": 1}):
        logits, targets = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
        with pytest.raises(ValueError, match="reduction"):
            sf.vocab_parallel_cross_entropy(logits, targets, reduction="max")
        with pytest.raises(ValueError, match="targets must be integer ids of shape"):
            sf.vocab_parallel_cross_entropy(logits, targets[:, :2])
        with pytest.raises(ValueError, match="vocab_size=9"):
            sf.vocab_parallel_cross_entropy(logits, targets, vocab_size=9)
        with pytest.raises(ValueError, match="target 5 is outside"):
            sf.vocab_parallel_cross_entropy(logits, targets + 5)
        assert sf.vocab_parallel_cross_entropy(logits, targets - 100).isnan()  # all ignored


@pytest.mark.parametrize("n", [2, 4])
def test_tied_head_into_the_loss(worlds, n):
    """The GPT plan's head: pvary(h) @ tok_rows.T -> vocab-parallel logits -> this loss. The
    gradients w.r.t. the hidden state (psum-ed by pvary) and the rank's embedding rows equal
    the unsplit model's, under torch.func.grad and autograd."""
    vocab, d = 9, 4
    gen = torch.Generator().manual_seed(n)
    hidden = torch.randn(2, 3, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (2, 3), generator=gen)
    local_vocab = math.ceil(vocab / n)
    rows = list(F.pad(weight, (0, 0, 0, n * local_vocab - vocab)).split(local_vocab))

    def on_rank(rows, hidden, targets):
        mesh = sf.Mesh({"tp": n})
        local_rows = rows[sf.axis_index("tp", mesh=mesh)]

        def loss(h, w):
            logits = F.linear(sf.pvary(h, "tp", mesh=mesh), w)
            return sf.vocab_parallel_cross_entropy(logits, targets, "tp", mesh=mesh,
                                                   vocab_size=vocab)

        g_func = torch.func.grad(loss, argnums=(0, 1))(hidden, local_rows)
        h, w = hidden.clone().requires_grad_(), local_rows.clone().requires_grad_()
        loss(h, w).backward()
        return g_func, (h.grad, w.grad)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    F.cross_entropy(F.linear(h, w).reshape(-1, vocab), targets.reshape(-1)).backward()
    ref_rows = F.pad(w.grad, (0, 0, 0, n * local_vocab - vocab)).split(local_vocab)
    for rank, results in enumerate(worlds(n).run(on_rank, rows, hidden, targets)):
        for g_hidden, g_rows in results:
            assert_close(g_hidden, h.grad)
            assert_close(g_rows, ref_rows[rank])
