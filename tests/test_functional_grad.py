"""Tests for shardfn._functional_grad.grad_and_value: torch.func's results, on the engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn.memory as mem
from shardfn._functional_grad import grad_and_value
from shardfn.functional import functional

FAST = settings(max_examples=8, deadline=None)


def _mlp(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(n_in, n_out), nn.Tanh()]
    return nn.Sequential(*layers)


@FAST
@given(widths=st.lists(st.integers(1, 6), min_size=2, max_size=4), batch=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_equals_torch_func_on_a_functional_model(widths, batch, seed):
    fm = functional(_mlp(widths))
    params = fm.init(seed)
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(seed))

    def loss(p, x):
        return fm.apply(p, x).square().mean()

    grads, value = grad_and_value(loss)(params, x)
    want_grads, want_value = torch.func.grad_and_value(loss)(params, x)
    assert_close(value, want_value, rtol=0, atol=0)
    assert_close(grads, want_grads, rtol=0, atol=0)
    assert not value.requires_grad and not any(g.requires_grad for g in grads.values())
    assert all(not p.requires_grad for p in params.values())  # the caller's leaves untouched


def test_a_wrong_gradient_would_be_caught():
    w = torch.tensor([1.0, 2.0])
    grads, _ = grad_and_value(lambda w: (w * w).sum())(w)
    assert_close(grads, 2 * w)
    with pytest.raises(AssertionError):
        assert_close(grads, w)


def test_argnums_tuple_has_aux_and_unused_arguments():
    w, b, unused = torch.randn(3), torch.randn(()), torch.randn(2)

    def fn(w, b, unused, x):
        y = (w * x).sum() + b
        return y * y, {"y": y}

    x = torch.randn(3)
    got = grad_and_value(fn, argnums=(0, 1, 2), has_aux=True)(w, b, unused, x)
    want = torch.func.grad_and_value(fn, argnums=(0, 1, 2), has_aux=True)(w, b, unused, x)
    assert_close(got[0], want[0])
    assert_close(got[1][0], want[1][0])
    assert_close(got[1][1], want[1][1])
    assert not got[1][1]["y"].requires_grad
    assert_close(got[0][2], torch.zeros(2))  # unused: zeros, as torch.func gives


def test_a_value_that_does_not_depend_on_the_argument_has_zero_gradients():
    grads, value = grad_and_value(lambda w, x: x.sum())(torch.ones(3), torch.ones(2))
    assert_close(grads, torch.zeros(3))
    assert_close(value, torch.tensor(2.0))


def test_inside_vmap_it_is_torch_func_per_sample():
    w = torch.randn(4)
    xs = torch.randn(5, 4)

    def loss(w, x):
        return torch.tanh(w @ x)

    got = torch.func.vmap(grad_and_value(loss), in_dims=(None, 0))(w, xs)
    want = torch.func.vmap(torch.func.grad_and_value(loss), in_dims=(None, 0))(w, xs)
    assert_close(got, want)
    second = torch.func.grad(lambda w: grad_and_value(loss)(w, xs[0])[0].sum())(w)
    assert_close(second, torch.func.grad(lambda w: torch.func.grad(loss)(w, xs[0]).sum())(w))


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(TypeError, match="argnums"):
        grad_and_value(lambda w: w.sum(), argnums=())
    with pytest.raises(TypeError, match="argument 0 must be a pytree of floating"):
        grad_and_value(lambda w: w.sum())(torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="out of range"):
        grad_and_value(lambda w: w.sum(), argnums=1)(torch.ones(2))
    with pytest.raises(RuntimeError, match="scalar"):
        grad_and_value(lambda w: w * 2)(torch.ones(2))


def test_the_backward_frees_what_the_forward_saved():
    """The lever of #27: on a chain of blocks torch.func keeps every saved activation
    alive through the backward (create_graph=True); the engine frees each once used."""
    torch.manual_seed(0)
    n, d, hidden = 4, 64, 256
    ws = {f"w{i}": torch.randn(hidden, d) / d**0.5 for i in range(n)}
    x = torch.randn(32, d)

    def loss(ws, x):
        h = x
        for i in range(n):
            h = h + torch.nn.functional.linear(torch.nn.functional.gelu(
                torch.nn.functional.linear(h, ws[f"w{i}"])), ws[f"w{i}"].T)
        return h.square().mean()

    peaks = {}
    for name, make in (("engine", grad_and_value), ("torch.func", torch.func.grad_and_value)):
        with mem.track() as t:
            grads, _ = make(loss)(ws, x)
        peaks[name] = t.peak_bytes
        assert_close(grads, torch.func.grad(loss)(ws, x))
    assert peaks["engine"] < 0.75 * peaks["torch.func"], peaks


def _tp_gpt_grads_on_rank(seed: int):
    """The tensor-parallel GPT's loss (vocab-parallel cross entropy, Megatron's collectives)
    differentiated by both paths on this rank."""
    import shardfn as sf
    from shardfn.models import GPT, GPTConfig, gpt_tp_plan

    mesh = sf.Mesh({"tp": 2})
    config = GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, seq_len=8, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = GPT(config)
    tp = sf.tensor_split(sf.functional(module), mesh, "tp", gpt_tp_plan())
    params = tp.init(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, 32, (2, 8), generator=g) for _ in range(2))

    def loss(p, x, y):
        return sf.vocab_parallel_cross_entropy(tp.apply(p, x), y, "tp", mesh=mesh)

    return grad_and_value(loss)(params, x, y), torch.func.grad_and_value(loss)(params, x, y)


@pytest.mark.parametrize("seed", [0, 1])
def test_tensor_parallel_gradients_equal_torch_func_on_two_ranks(worlds, seed):
    for (grads, value), (want_grads, want_value) in worlds(2).run(_tp_gpt_grads_on_rank, seed):
        assert_close(value, want_value)
        assert_close(grads, want_grads)
        assert any(g.abs().sum() > 0 for g in grads.values())
