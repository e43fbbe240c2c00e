"""remat in low precision, remat of unusual functions, and Hugging Face's own checkpointing.

* Under plain autograd ``sf.remat`` gives autograd's gradients bit for bit (as
  ``torch.utils.checkpoint`` does), in fp16 and bf16, with and without autocast: its
  backward recomputes under ``enable_grad`` and runs ``torch.autograd.grad``.
* Under ``torch.func.grad`` it gives the same first-order gradients, bit for bit: the
  recomputation's vjp runs with ``create_graph=False`` unless a higher derivative may
  be taken. (``torch.func.grad`` of the plain function differs from both in low
  precision: it differentiates with ``create_graph=True``, where torch picks
  double-differentiable formulas, e.g. for ``silu``, that round differently; fp32 keeps
  it within ``assert_close``'s defaults.) So ``shard_params`` with and without
  ``remat=`` agree bit for bit under both.
* ``remat`` of a function returning an argument as it is, of an ``autograd.Function``
  without ``setup_context``, and of ``F.linear`` under autocast work like
  ``torch.utils.checkpoint``; a saved op output that is also the function's output keeps
  its history through a backward (``retain_graph``).
* ``gradient_checkpointing_enable()`` on a Hugging Face model runs as ``sf.remat``
  inside ``sf.functional`` / ``shard_params`` calls, under autograd and torch.func.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import shardfn as sf
from shardfn.transforms.remat import checkpoint_policies as cp
from shardfn.transforms.remat import remat

LOW = [torch.float16, torch.bfloat16]
POLICIES = {"nothing": cp.nothing_saveable, "dots": cp.dots_saveable,
            "everything": cp.everything_saveable}


def linear(p, x):
    return F.linear(x, p["w1"], p["b1"])


def silu(p, x):
    return F.silu(x) * p["s"]


def mlp(p, x):
    return F.linear(F.silu(F.linear(x, p["w1"], p["b1"])), p["w2"]) + x


FUNCTIONS = {"linear": linear, "silu": silu, "mlp": mlp}


def make(d: int, hidden: int, rows: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    p = {"w1": torch.randn(hidden, d, generator=gen) / d**0.5,
         "b1": torch.randn(hidden, generator=gen),
         "w2": torch.randn(d, hidden, generator=gen) / hidden**0.5,
         "s": torch.randn(d, generator=gen)}
    x = torch.randn(rows, d, generator=gen) * 3
    return {k: v.to(dtype) for k, v in p.items()}, x.to(dtype)


def autograd_grads(fn, p, x, cotangent_seed: int = 0):
    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
    xs = x.detach().requires_grad_()
    out = fn(leaves, xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(cotangent_seed))
    out.backward(g.to(out.dtype))
    return {**{k: v.grad for k, v in leaves.items()}, "x": xs.grad}


def func_grads(fn, p, x):
    grads = torch.func.grad(lambda p, x: fn(p, x).float().square().sum(), argnums=(0, 1))(p, x)
    return {**grads[0], "x": grads[1]}


def autograd_loss_grads(fn, p, x):
    leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
    xs = x.detach().requires_grad_()
    fn(leaves, xs).float().square().sum().backward()
    return {**{k: v.grad for k, v in leaves.items()}, "x": xs.grad}


def assert_equal(got: dict, want: dict):
    for k in want:
        if want[k] is None:  # unused; torch.func gives zeros
            assert got[k] is None or not got[k].any(), k
            continue
        assert torch.equal(got[k], want[k]), (k, (got[k].float() - want[k].float()).abs().max())


# ---------------------------------------------------------------- bit for bit in fp16 / bf16


@settings(max_examples=6, deadline=None)
@given(dtype=st.sampled_from(LOW), name=st.sampled_from(sorted(FUNCTIONS)),
       policy=st.sampled_from(sorted(POLICIES)), d=st.integers(1, 40),
       hidden=st.integers(1, 70), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_autograd_gradients_are_bit_for_bit(dtype, name, policy, d, hidden, rows, seed):
    fn = FUNCTIONS[name]
    p, x = make(d, hidden, rows, seed, dtype)
    want = autograd_grads(fn, p, x, seed)
    assert_equal(autograd_grads(remat(fn, POLICIES[policy]), p, x, seed), want)
    assert_equal(autograd_grads(lambda p, x: checkpoint(fn, p, x, use_reentrant=False),
                                p, x, seed), want)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_autograd_gradients_are_bit_for_bit_at_size(dtype, name):
    fn = FUNCTIONS[name]
    p, x = make(256, 512, 64, 0, dtype)
    want = autograd_grads(fn, p, x)
    for policy in POLICIES.values():
        assert_equal(autograd_grads(remat(fn, policy), p, x), want)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_torch_func_gradients_are_autograds_bit_for_bit(dtype, name):
    """torch.func.grad over remat: autograd's first-order gradients, bit for bit. (The
    old backward took torch.func's create_graph formulas: silu's differed by up to 0.5
    in bf16 here.) Plain torch.func.grad of the function is not bitwise comparable in
    low precision (see the module docstring); in fp32 it agrees to round-off."""
    fn = FUNCTIONS[name]
    p, x = make(64, 256, 33, 1, dtype)
    want = autograd_loss_grads(fn, p, x)
    for policy in POLICIES.values():
        assert_equal(func_grads(remat(fn, policy), p, x), want)
    p32, x32 = make(64, 256, 33, 1, torch.float32)
    assert_close(func_grads(remat(fn), p32, x32), func_grads(fn, p32, x32))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("how", ["autograd", "func"])
def test_under_autocast(dtype, how):
    """F.linear under autocast reads autocast's cached cast of the weight through a view
    (w.t()): that is an argument, not a closure. Gradients bit for bit."""
    p, x = make(16, 24, 5, 2, torch.float32)

    def cast(fn):
        def run(p, x):
            with torch.autocast("cpu", dtype=dtype):
                return fn(p, x)
        return run

    grads_of = autograd_loss_grads if how == "autograd" else func_grads
    for name in ("linear", "mlp"):
        fn = FUNCTIONS[name]
        want = autograd_loss_grads(cast(fn), p, x)
        for policy in POLICIES.values():
            assert_equal(grads_of(cast(remat(fn, policy)), p, x), want)
        if how == "autograd":
            assert_equal(autograd_loss_grads(
                cast(lambda p, x, fn=fn: checkpoint(fn, p, x, use_reentrant=False)), p, x), want)


# ---------------------------------------------------------------- shard_params, remat= or not


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.silu(self.up(x)))


@pytest.mark.parametrize("dtype", LOW)
def test_shard_params_with_and_without_remat_agree_bit_for_bit(dtype):
    torch.manual_seed(0)
    fm = sf.functional(nn.Sequential(nn.Linear(8, 16), Block(16), Block(16),
                                     nn.Linear(16, 4)).to(dtype))
    x = torch.randn(6, 8).to(dtype)
    mesh = sf.Mesh({"dp": 1})
    loss_of = lambda model: lambda p: model.apply(p, x).float().square().mean()  # noqa: E731
    results = {}
    for label, policy in [("keep", None), ("nothing", cp.nothing_saveable),
                          ("dots", cp.dots_saveable)]:
        model = sf.shard_params(fm, mesh, "dp", units=Block, remat=policy)
        shards = model.init(0)
        results[label, "func"] = torch.func.grad(loss_of(model))(shards)
        leaves = {k: v.detach().requires_grad_() for k, v in shards.items()}
        loss_of(model)(leaves).backward()
        results[label, "autograd"] = {k: v.grad for k, v in leaves.items()}
    leaves = {k: v.detach().requires_grad_() for k, v in fm.init(0).items()}
    loss_of(fm)(leaves).backward()
    want = {k: v.grad for k, v in leaves.items()}
    for got in results.values():
        assert_equal(got, want)


# ---------------------------------------------------------------- crashes that now work


@pytest.mark.parametrize("how", ["autograd", "func"])
def test_an_argument_returned_as_it_is(how):
    x = torch.randn(5)
    f = lambda t: (t * 2, t)  # noqa: E731
    loss = lambda fn: lambda t: (lambda a, b: (a * a).sum() + 3 * b.sum())(*fn(t))  # noqa: E731
    if how == "func":
        got, want = torch.func.grad(loss(remat(f)))(x), torch.func.grad(loss(f))(x)
    else:
        got, want = [torch.autograd.grad(loss(fn)(xs), xs)[0]
                     for fn in (remat(f), f) for xs in [x.clone().requires_grad_()]]
    assert torch.equal(got, want)


class Cube(torch.autograd.Function):
    """Old style: ctx in forward, no setup_context (torch.func refuses it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


def test_an_autograd_function_without_setup_context():
    x = torch.randn(7, requires_grad=True)
    f = lambda t: torch.tanh(Cube.apply(t)) * 2  # noqa: E731
    (want,) = torch.autograd.grad(f(x).sum(), x)
    for policy in POLICIES.values():
        assert torch.equal(torch.autograd.grad(remat(f, policy)(x).sum(), x)[0], want)
    assert torch.equal(torch.autograd.grad(remat(Cube.apply)(x).sum(), x)[0], 3 * x * x)


def test_autocast_linear_with_bias_is_not_a_closure():
    w, b = torch.randn(6, 4, requires_grad=True), torch.randn(6, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    f = lambda p, t: F.linear(t, p["w"], p["b"])  # noqa: E731
    grads = []
    for fn in (f, remat(f)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn({"w": w, "b": b}, x)
        grads.append(torch.autograd.grad(out.float().sum(), (w, b, x)))
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("policy", [cp.everything_saveable, cp.dots_saveable])
def test_a_saved_output_keeps_its_history(policy):
    """The output of a saved op may be the function's own output: the replay returns it
    as a new tensor object, so the backward does not overwrite its grad_fn."""
    w, x = torch.randn(5, 5, requires_grad=True), torch.randn(3, 5)
    y = remat(lambda w, x: torch.mm(x, w), policy)(w, x)
    grad_fn = y.grad_fn
    y.sum().backward(retain_graph=True)
    assert y.grad_fn is grad_fn
    y.sum().backward()
    assert_close(w.grad, 2 * x.sum(0)[:, None].expand(5, 5))


# ---------------------------------------------------------------- Hugging Face checkpointing


def _llama(checkpointing: bool, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).train()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    return model


def _hf_grads(model, how: str, ids, wrap=None):
    fm = sf.functional(model)
    wrapped = wrap(fm) if wrap else fm
    trainable, rest = wrapped.split_trainable(wrapped.init(0))
    loss = lambda t: wrapped.apply(  # noqa: E731
        wrapped.merge(t, rest), ids, labels=ids, use_cache=False).loss
    if how == "func":
        return torch.func.grad(loss)(trainable), fm
    leaves = {k: v.detach().requires_grad_() for k, v in trainable.items()}
    loss(leaves).backward()
    return {k: v.grad for k, v in leaves.items()}, fm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_gradient_checkpointing_runs_as_remat(dtype):
    """Was: 'Tensor on device cpu is not on the expected device meta!' (autograd), and
    requires_grad_() refused inside torch.func (HF's input-grad hook). Now bit for bit
    the gradients of the model without checkpointing, under both."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    want, _ = _hf_grads(_llama(False, dtype), "autograd", ids)
    model = _llama(True, dtype)
    for how in ("autograd", "func"):
        got, fm = _hf_grads(model, how, ids)
        assert_equal(got, want)
        # nothing left behind: the skeleton's checkpointing function and meta leaves; HF's
        # input-grad hook is dropped from the functional copy (requires_grad_ cannot run
        # under torch.func) and kept on the user's model
        skeleton = fm.module
        assert "checkpoint" in repr(skeleton.model.layers[0]._gradient_checkpointing_func)
        assert not skeleton.model.embed_tokens._forward_hooks
        assert model.model.embed_tokens._forward_hooks
        assert all(p.device.type == "meta" for p in skeleton.parameters())


@pytest.mark.parametrize("how", ["autograd", "func"])
def test_hf_gradient_checkpointing_under_shard_params(how):
    transformers = pytest.importorskip("transformers")
    layer_type = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    want, _ = _hf_grads(_llama(False), "autograd", ids)
    for policy in (None, cp.nothing_saveable):
        wrap = lambda fm, policy=policy: sf.shard_params(  # noqa: E731
            fm, sf.Mesh({"dp": 1}), "dp", units=layer_type, remat=policy)
        assert_equal(_hf_grads(_llama(True), how, ids, wrap)[0], want)


class OldStyle(nn.Module):
    """Checkpoints like Hugging Face models before GradientCheckpointingLayer: the parent
    holds the flag and checkpoints ``layer.__call__`` (or, wrongly, a lambda)."""

    def __init__(self, d: int, how: str):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.gradient_checkpointing, self.how = False, how

    def forward(self, x):
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                fn = block.__call__ if self.how == "method" else (lambda t, b=block: b(t))
                x = self._gradient_checkpointing_func(fn, x, use_reentrant=True)
            else:
                x = block(x)
        return x


@pytest.mark.parametrize("how", ["autograd", "func"])
def test_a_parent_checkpointing_its_layers_call(how):
    torch.manual_seed(0)
    module = OldStyle(6, "method")
    fm = sf.functional(module)
    params, x = fm.init(0), torch.randn(4, 6)
    loss = lambda p: fm.apply(p, x).square().sum()  # noqa: E731
    want = torch.func.grad(loss)(params)
    module.gradient_checkpointing, module._gradient_checkpointing_func = True, checkpoint
    fm = sf.functional(module)
    if how == "func":
        got = torch.func.grad(loss)(params)
    else:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss(leaves).backward()
        got = {k: v.grad for k, v in leaves.items()}
    assert_close(got, want)


def test_checkpointing_something_else_is_refused_with_the_way_out():
    module = OldStyle(6, "lambda")
    module.gradient_checkpointing, module._gradient_checkpointing_func = True, checkpoint
    fm = sf.functional(module)
    with pytest.raises(TypeError, match="gradient_checkpointing_disable.*remat"):
        torch.func.grad(lambda p: fm.apply(p, torch.randn(2, 6)).sum())(fm.init(0))
