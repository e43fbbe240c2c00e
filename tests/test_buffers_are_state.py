"""Buffers are state, never differentiated (issue #22, item 2; docs/functional.md, "Buffers
are state").

Every model kind's ``apply`` refuses a floating buffer (or a frozen parameter) that is
being differentiated, under ``torch.func`` (a grad level tracks it) and under autograd
(``requires_grad=True``), naming it: sharded and unsharded code refuse alike, where
before ``sf.functional`` trained the buffer and ``shard_params`` gave it a zero gradient
and weight decay. The documented path (``split_trainable`` / ``merge``) trains the
parameters and never moves a buffer, on a real Hugging Face Llama too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardfn as sf
from shardfn import _torch_internals as ti
from shardfn._functional_leaves import refuse_differentiated_state
from shardfn.transforms.precision import Precision, with_precision
from shardfn.transforms.remat import checkpoint_policies


class Net(nn.Module):
    """Two Linear layers (a tensor_split plan splits them), a float and an int buffer, and
    a frozen parameter (``frozen=True``)."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        if frozen:
            self.fc2.bias.requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x * self.scale)))


PLAN = {"fc1": "colwise", "fc2": "rowwise"}


def _kinds(frozen: bool = False) -> dict:
    """Every model kind over one process (size-1 meshes), built from ``Net``."""
    fm = sf.functional(Net(frozen))
    dp, dp_tp = sf.Mesh({"dp": 1}), sf.Mesh({"dp": 1, "tp": 1})
    return {
        "functional": fm,
        "with_precision": with_precision(fm, Precision(torch.float64)),
        "shard_params": sf.shard_params(fm, dp, "dp", units=["fc1"]),
        "shard_params_remat": sf.shard_params(fm, dp, "dp", remat=checkpoint_policies.
                                              nothing_saveable),
        "shard_params_precision": sf.shard_params(fm, dp, "dp",
                                                  precision=Precision(torch.float64)),
        "hsdp": sf.shard_params(fm, sf.Mesh({"rep": 1, "dp": 1}), "dp", replicate_axis="rep"),
        "tensor_split": sf.tensor_split(fm, sf.Mesh({"tp": 1}), "tp", PLAN),
        "fsdp_tp": sf.shard_params(sf.tensor_split(fm, dp_tp, "tp", PLAN), dp_tp, "dp"),
    }


KINDS = ("functional", "with_precision", "shard_params", "shard_params_remat",
         "shard_params_precision", "hsdp", "tensor_split", "fsdp_tp")  # _kinds()' keys
X = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))


def _loss(model, params):
    return model.apply(params, X).square().mean()


def _floating(params):
    """``(floating leaves, the others)``: torch.func.grad itself refuses integer leaves."""
    return ({n: t for n, t in params.items() if t.is_floating_point()},
            {n: t for n, t in params.items() if not t.is_floating_point()})


@pytest.mark.parametrize("kind", KINDS)
def test_torch_func_grad_of_the_whole_tree_is_refused_naming_the_buffer(kind):
    model = _kinds()[kind]
    params = model.init(0)
    floats, ints = _floating(params)  # every floating leaf: what the old docs differentiated
    with pytest.raises(ValueError, match=r"buffers \['scale'\] \(1 in all\).*split_trainable"):
        torch.func.grad(lambda f: _loss(model, {**f, **ints}))(floats)
    with pytest.raises(ValueError, match=r"\['scale'\]"):  # vjp too
        torch.func.vjp(lambda f: _loss(model, {**f, **ints}), floats)
    # a buffer passed but not differentiated (outside argnums) is fine
    trainable, rest = model.split_trainable(params)
    torch.func.grad(lambda t, r: _loss(model, model.merge(t, r)))(trainable, rest)


@pytest.mark.parametrize("kind", KINDS)
def test_autograd_on_a_buffer_that_requires_grad_is_refused(kind):
    model = _kinds()[kind]
    params = {n: t.detach().requires_grad_(t.is_floating_point())
              for n, t in model.init(0).items()}
    with pytest.raises(ValueError, match=r"buffers \['scale'\].*mutable=True"):
        _loss(model, params)
    with torch.no_grad():  # requires_grad is read, not the grad mode: still refused
        with pytest.raises(ValueError, match="scale"):
            model.apply(params, X)


@pytest.mark.parametrize("kind", KINDS)
def test_a_differentiated_frozen_parameter_is_refused_in_every_kind(kind):
    """Before: functional and tensor_split gave fc2.bias a gradient, shard_params a zero."""
    model = _kinds(frozen=True)[kind]
    params = model.init(0)
    trainable, rest = model.split_trainable(params)
    assert "fc2.bias" in rest and "scale" in rest
    only_frozen = {**trainable, "fc2.bias": rest["fc2.bias"]}
    others = {n: t for n, t in rest.items() if n != "fc2.bias"}
    with pytest.raises(ValueError, match=r"frozen parameters .*\['fc2.bias'\]"):
        torch.func.grad(lambda t: _loss(model, model.merge(t, others)))(only_frozen)


@pytest.mark.parametrize("kind", KINDS)
def test_the_documented_path_trains_parameters_and_never_moves_a_buffer(kind):
    model = _kinds(frozen=True)[kind]
    params = model.init(0)
    trainable, rest = model.split_trainable(params)
    opt = sf.optim.adamw(1e-1, weight_decay=0.5)
    state = opt.init(trainable)
    for _ in range(2):
        grads = torch.func.grad(lambda t: _loss(model, model.merge(t, rest)))(trainable)
        updates, state = opt.update(grads, state, trainable)
        trainable = sf.optim.apply_updates(trainable, updates)
    new = model.merge(trainable, rest)
    assert not torch.equal(new["fc1.weight"], params["fc1.weight"])
    for name in ("scale", "steps", "fc2.bias"):
        assert torch.equal(new[name], params[name]), name


def test_the_message_names_the_first_five_and_the_count():
    params = {f"b{i}": torch.zeros(1, requires_grad=True) for i in range(7)}
    with pytest.raises(ValueError, match=r"\['b0', 'b1', 'b2', 'b3', 'b4'\] and 2 more "
                                         r"\(7 in all\)"):
        refuse_differentiated_state(params, list(params), [], "m.apply")
    refuse_differentiated_state({"b0": torch.zeros(1)}, ["b0", "absent"], [], "m.apply")


def test_is_differentiated_sees_every_grad_level_and_nothing_else():
    seen = {}

    def inner(a, b):
        seen.setdefault("inner", (ti.is_differentiated(a), ti.is_differentiated(b)))
        return (a * b).sum()

    a, b = torch.ones(3), torch.ones(3)
    torch.func.grad(inner)(a, b)  # b: wrapped at the grad level but outside argnums
    assert seen.pop("inner") == (True, False)
    torch.func.grad(lambda a, b: torch.func.grad(inner)(a, b).sum(), argnums=1)(a, b)
    assert seen.pop("inner") == (True, True)  # b: differentiated by the outer level
    torch.func.vmap(torch.func.grad(inner), in_dims=(0, None))(torch.ones(2, 3), b)
    assert seen.pop("inner") == (True, False)
    torch.func.grad(lambda a, b: torch.func.vmap(inner, in_dims=(None, 0))(a, b).sum(),
                    argnums=1)(a, torch.ones(2, 3))
    assert seen.pop("inner") == (False, True)  # under a vmap level above the grad level
    torch.func.jvp(inner, (a, b), (a, b))
    assert seen.pop("inner") == (False, False)  # forward mode: no gradient
    assert ti.is_differentiated(torch.ones(1, requires_grad=True))


def test_pipeline_value_and_grad_refuses_a_buffer_requiring_grad_and_never_returns_one():
    units = [Net(), nn.Tanh(), nn.Linear(3, 1)]
    pp = sf.pipeline_stages(units, sf.Mesh({"pp": 1}), "pp", balance=[3], microbatches=2,
                            loss_fn=lambda out, y: (out - y).square().mean())
    params = pp.init(0)
    y = torch.zeros(5, 1)
    loss, grads = pp.value_and_grad(params, X, y)
    assert "0.scale" not in grads and "0.steps" not in grads and "0.fc1.weight" in grads
    bad = {**params, "0.scale": params["0.scale"].detach().requires_grad_()}
    with pytest.raises(ValueError, match=r"buffers \['0.scale'\]"):
        pp.value_and_grad(bad, X, y)


def _llama(transformers):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train_llama(model, steps: int = 3):
    """The documented step: split_trainable, grad of the trainable part, AdamW on it."""
    params = model.init(0)
    trainable, rest = model.split_trainable(params)
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(trainable)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 9), generator=gen)

    def loss(t):
        logits = model.apply(model.merge(t, rest), tokens[:, :-1], return_dict=False)[0]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))

    for _ in range(steps):
        grads = torch.func.grad(loss)(trainable)
        updates, state = opt.update(grads, state, trainable)
        trainable = sf.optim.apply_updates(trainable, updates)
    return params, model.merge(trainable, rest)


def test_llama_inv_freq_is_never_trained_and_sharded_equals_unsharded():
    transformers = pytest.importorskip("transformers")
    fm = sf.functional(_llama(transformers))
    inv_freq = [n for n in fm.buffer_names if n.endswith("inv_freq")]
    assert inv_freq, fm.buffer_names
    floats, ints = _floating(fm.init(0))
    with pytest.raises(ValueError, match="inv_freq"):  # what the old docs path did
        torch.func.grad(lambda f: fm.apply({**f, **ints}, torch.zeros(1, 4, dtype=torch.long),
                                           return_dict=False)[0].sum())(floats)
    start, unsharded = _train_llama(fm)
    sp = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp")
    _, sharded = _train_llama(sp)
    sharded = sf.gather(sharded, sp.specs, sp.mesh)
    for name in inv_freq:
        assert torch.equal(unsharded[name], start[name]), name
        assert torch.equal(sharded[name], start[name]), name
    moved = [n for n in fm.trainable_names if not torch.equal(unsharded[n], start[n])]
    assert len(moved) == len(fm.trainable_names)
    torch.testing.assert_close(sharded, unsharded)


def test_a_remat_wrapped_apply_refuses_too_and_the_documented_path_runs():
    fm = sf.functional(Net())
    block = sf.remat(fm.apply, policy=checkpoint_policies.nothing_saveable)
    floats, ints = _floating(fm.init(0))
    with pytest.raises(ValueError, match=r"buffers \['scale'\]"):
        torch.func.grad(lambda f: block({**f, **ints}, X).sum())(floats)
    trainable, rest = fm.split_trainable(fm.init(0))
    grads = torch.func.grad(lambda t: block(fm.merge(t, rest), X).sum())(trainable)
    expected = torch.func.grad(lambda t: fm.apply(fm.merge(t, rest), X).sum())(trainable)
    torch.testing.assert_close(grads, expected)


def _llama_on_rank():
    import transformers

    fm = sf.functional(_llama(transformers))
    sp = sf.shard_params(fm, sf.Mesh({"dp": 2}), "dp")
    start, trained = _train_llama(sp)  # the same batch on both ranks: the mean is that batch's
    return sf.gather(start, sp.specs, sp.mesh), sf.gather(trained, sp.specs, sp.mesh)


def test_llama_on_two_ranks_equals_one_process_and_keeps_inv_freq(worlds):
    transformers = pytest.importorskip("transformers")
    fm = sf.functional(_llama(transformers))
    start, unsharded = _train_llama(fm)
    for rank_start, trained in worlds(2).run(_llama_on_rank):
        for name in fm.buffer_names:
            assert torch.equal(trained[name], start[name]), name
        torch.testing.assert_close(rank_start, start)
        torch.testing.assert_close(trained, unsharded)
