"""The reference GPT: config checks, shapes, causality, tying, dropout, init, gradients
through ``sf.functional`` (torch.func.grad and autograd), and blocks that run on
tensor-parallel slices of their weights without any attribute patching."""

from __future__ import annotations

import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import GPT, MLP, Attention, AttentionCore, Block, GPTConfig, gpt_tp_plan

SMALL = GPTConfig(vocab_size=13, d_model=12, n_layers=2, n_heads=3, seq_len=6)


def _tokens(config, shape, seed=0):
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _module_with(config, params):
    module = GPT(config)
    module.load_state_dict(params, strict=False)
    return module


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("bad,match", [
    (dict(d_model=10, n_heads=3), "d_model=10 is not divisible by n_heads=3"),
    (dict(vocab_size=0), "vocab_size must be > 0"),
    (dict(n_layers=1.5), "n_layers must be an int"),
    (dict(seq_len=True), "seq_len must be an int"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(dropout="0.1"), "dropout must be a float"),
    (dict(tied_embeddings=1), "tied_embeddings must be a bool"),
])
def test_config_validation(bad, match):
    fields = dict(vocab_size=13, d_model=12, n_layers=2, n_heads=3, seq_len=6) | bad
    with pytest.raises((TypeError, ValueError), match=match):
        GPTConfig(**fields)


def test_config_is_frozen_and_model_checks_inputs():
    with pytest.raises(AttributeError):
        SMALL.d_model = 4
    assert SMALL.head_dim == 4
    model = GPT(SMALL)
    with pytest.raises(ValueError, match="exceeds config.seq_len=6"):
        model(_tokens(SMALL, (1, 7)))
    with pytest.raises(TypeError, match="token ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT({"vocab_size": 3})


@settings(max_examples=8, deadline=None)
@given(batch=st.lists(st.integers(1, 3), max_size=2), seq=st.integers(1, 6),
       tied=st.booleans(), seed=st.integers(0, 2**16))
def test_functional_equals_module_and_gradients(batch, seq, tied, seed):
    """apply == the module's forward; torch.func.grad == autograd on the module, the tied
    weight's gradient adding up both of its uses."""
    config = GPTConfig(13, 12, 2, 3, 6, tied_embeddings=tied)
    model = sf.functional(GPT(config))
    params = model.init(seed)
    tokens = _tokens(config, (*batch, seq), seed)
    targets = _tokens(config, (*batch, seq), seed + 1)
    module = _module_with(config, params)
    logits = model.apply(params, tokens)
    assert logits.shape == (*batch, seq, config.vocab_size)
    assert_close(logits, module(tokens))

    grads = torch.func.grad(lambda p: _loss(model.apply(p, tokens), targets))(params)
    _loss(module(tokens), targets).backward()
    expected = dict(module.named_parameters())
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        assert_close(grad, expected[name].grad, msg=lambda m, n=name: f"{n}: {m}")
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    _loss(model.apply(leaves, tokens), targets).backward()
    for name, leaf in leaves.items():
        assert_close(leaf.grad, grads[name], msg=lambda m, n=name: f"autograd {n}: {m}")


def test_tied_embeddings_are_one_leaf():
    tied = sf.functional(GPT(SMALL))
    assert tied.tied == {"head.weight": "tok.weight"} and "head.weight" not in tied.init(0)
    untied = sf.functional(GPT(GPTConfig(13, 12, 2, 3, 6, tied_embeddings=False)))
    assert not untied.tied and untied.init(0)["head.weight"].shape == (13, 12)
    module = GPT(SMALL)
    assert module.head.weight is module.tok.weight
    # the tied head really uses tok.weight: changing it changes the logits' last layer
    params = tied.init(0)
    tokens = _tokens(SMALL, (2, 4))
    bumped = dict(params, **{"tok.weight": params["tok.weight"] * 2})
    h = tied.apply(params, tokens)
    assert not torch.allclose(h, tied.apply(bumped, tokens))


@pytest.mark.parametrize("position", [0, 2, 5])
def test_causal(position):
    config = GPTConfig(13, 12, 2, 3, 6)
    model = sf.functional(GPT(config))
    params = model.init(3)
    tokens = _tokens(config, (2, 6))
    changed = tokens.clone()
    changed[:, position] = (changed[:, position] + 1) % config.vocab_size
    a, b = model.apply(params, tokens), model.apply(params, changed)
    assert_close(a[:, :position], b[:, :position])
    assert not torch.allclose(a[:, position:], b[:, position:])


def test_dropout_only_in_training():
    config = GPTConfig(13, 12, 2, 3, 6, dropout=0.3)
    tokens = _tokens(config, (2, 6))
    model = sf.functional(GPT(config))
    params = model.init(0)
    no_dropout = sf.functional(GPT(GPTConfig(13, 12, 2, 3, 6)))
    eval_out = model.eval().apply(params, tokens)
    assert_close(eval_out, model.eval().apply(params, tokens))
    assert_close(eval_out, no_dropout.apply(params, tokens))
    train = model.train()
    torch.manual_seed(0)
    first = train.apply(params, tokens)
    second = train.apply(params, tokens)
    torch.manual_seed(0)
    again = train.apply(params, tokens)
    assert not torch.allclose(first, eval_out) and not torch.allclose(first, second)
    assert_close(first, again)  # the masks come from torch's RNG
    assert_close(no_dropout.train().apply(params, tokens), eval_out)


def test_seeded_init_is_reproducible():
    model = sf.functional(GPT(SMALL))
    a, b, c = model.init(5), model.init(5), model.init(6)
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name])
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
    assert not torch.equal(a["blocks.0.mlp.fc1.weight"], a["blocks.1.mlp.fc1.weight"])


def _head_rows(rank, n, config):
    """Rows of qkv.weight giving rank ``rank`` whole heads of q, k and v ([q | k | v])."""
    per = config.d_model // n
    return torch.cat([torch.arange(part * config.d_model + rank * per,
                                   part * config.d_model + (rank + 1) * per) for part in range(3)])


@pytest.mark.parametrize("n", [1, 3])
def test_blocks_run_on_tensor_parallel_slices(n):
    """Column-split qkv/fc1 and row-split proj/fc2 (Megatron): each rank's slice runs as it
    is (local heads from the weight), and the partial outputs sum to the full ones."""
    config = GPTConfig(13, 12, 1, 3, 6)
    per = config.d_model // n
    attn, mlp = Attention(config), MLP(config)
    x = torch.randn(2, 5, config.d_model, generator=torch.Generator().manual_seed(0))
    attn_parts, mlp_parts = [], []
    for rank in range(n):
        rows = _head_rows(rank, n, config)
        cols = slice(rank * per, (rank + 1) * per)
        local = {"qkv.weight": attn.qkv.weight[rows], "qkv.bias": attn.qkv.bias[rows],
                 "proj.weight": attn.proj.weight[:, cols],
                 "proj.bias": attn.proj.bias * (rank == 0)}
        attn_parts.append(torch.func.functional_call(attn, local, (x,)))
        hidden = slice(rank * 4 * per, (rank + 1) * 4 * per)
        local = {"fc1.weight": mlp.fc1.weight[hidden], "fc1.bias": mlp.fc1.bias[hidden],
                 "fc2.weight": mlp.fc2.weight[:, hidden], "fc2.bias": mlp.fc2.bias * (rank == 0)}
        mlp_parts.append(torch.func.functional_call(mlp, local, (x,)))
    assert_close(sum(attn_parts), attn(x))
    assert_close(sum(mlp_parts), mlp(x))
    if n > 1:  # a slice alone is not the answer: the test can fail
        assert not torch.allclose(attn_parts[0], attn(x))


def test_attention_refuses_partial_heads():
    config = GPTConfig(13, 12, 1, 3, 6)
    attn = Attention(config)
    local = {"qkv.weight": attn.qkv.weight[:10], "qkv.bias": attn.qkv.bias[:10]}
    with pytest.raises(ValueError, match="not a multiple of 3 \\* head_dim = 12"):
        torch.func.functional_call(attn, local, (torch.randn(1, 2, 12),))


def test_tp_plan_matches_the_model():
    plan = gpt_tp_plan()
    assert plan == {"tok": "vocab", "blocks.*.attn.qkv": "colwise",
                    "blocks.*.attn.core": "split_rng",
                    "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc1": "colwise",
                    "blocks.*.mlp.fc2": "rowwise", "head": "colwise"}
    sp = gpt_tp_plan(sequence_parallel=True)
    assert set(sp) == set(plan) | {"pos", "drop", "blocks.*.ln1", "blocks.*.ln2", "ln_f",
                                   "blocks.*.attn.resid_dropout", "blocks.*.mlp.dropout"}
    modules = dict(GPT(SMALL).named_modules())
    kinds = {"vocab": torch.nn.Embedding, "colwise": torch.nn.Linear, "rowwise": torch.nn.Linear,
             "split_rng": AttentionCore,
             "sequence_parallel": (torch.nn.LayerNorm, torch.nn.Embedding, torch.nn.Dropout)}
    for pattern, style in [*plan.items(), *sp.items()]:
        matched = [m for path, m in modules.items() if fnmatch.fnmatchcase(path, pattern)]
        assert matched, pattern
        assert all(isinstance(m, kinds[style.removesuffix("_sp")]) for m in matched), pattern
    # every replicated leaf of the model is in a sequence-parallel module
    covered = [p for p in sp if sp[p] in ("sequence_parallel", "rowwise_sp")]
    for name, _ in GPT(SMALL).named_parameters():
        module = name.rpartition(".")[0]
        split = any(fnmatch.fnmatchcase(module, p) for p in sp if sp[p] != "sequence_parallel")
        assert split or any(fnmatch.fnmatchcase(module, p) for p in covered), name
    assert isinstance(modules["blocks.1"], Block)
    plan["tok"] = "replicate"
    assert gpt_tp_plan()["tok"] == "vocab"  # a fresh dict each call
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        gpt_tp_plan(sequence_parallel="yes")


def test_gpt_units_compute_the_untied_gpt():
    """nn.Sequential(*gpt_units(cfg)) is GPT(cfg) with its leaves renamed (untied only)."""
    from shardfn.models import gpt_units

    config = GPTConfig(vocab_size=11, d_model=8, n_layers=2, n_heads=2, seq_len=6,
                       tied_embeddings=False)
    gpt = sf.functional(GPT(config))
    units = sf.functional(torch.nn.Sequential(*gpt_units(config)))
    params = gpt.init(0)
    last = config.n_layers + 1

    def unit_name(name: str) -> str:
        head, _, rest = name.partition(".")
        if head in ("tok", "pos"):
            return f"0.{name}"
        if head == "blocks":
            index, _, rest = rest.partition(".")
            return f"{int(index) + 1}.{rest}"
        return f"{last}.{name}"

    renamed = {unit_name(k): v for k, v in params.items()}
    assert set(renamed) == set(units.names)
    tokens = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(units.apply(renamed, tokens), gpt.apply(params, tokens))
    with pytest.raises(ValueError, match="tied_embeddings"):
        gpt_units(GPTConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, seq_len=6))


def test_bias_false_drops_every_linear_bias_and_tied_logits_start_near_uniform():
    config = GPTConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, seq_len=16, bias=False)
    model = sf.functional(GPT(config))
    assert not [n for n in model.names if n.endswith("bias") and ".ln" not in n
                and not n.startswith("ln_f")]
    tokens = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))
    logits = model.apply(model.init(0), tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             tokens[:, 1:].flatten())
    # the tied head's input is scaled by d ** -0.5: O(1) logits (unscaled, N(0, 1) embedding
    # rows against unit-variance features give logits of std ~8 and a first loss ~30)
    assert math.log(96) - 0.5 < float(loss) < 2 * math.log(96)
    with pytest.raises(TypeError, match="bias"):
        GPTConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, seq_len=4, bias=1)
