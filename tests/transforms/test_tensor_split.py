"""tensor_split (Megatron tensor parallelism) equals the unsplit model.

On 2 and 4 ranks (mesh {"tp": n}): an MLP block (LayerNorm -> colwise Linear ->
GELU -> rowwise Linear, residual) and an attention block with a vocab-split
embedding and a fused qkv (whole heads per rank): the forward output, the loss
and the gradients (gathered with the model's own gather) equal the
single-process model's, under torch.func.grad and autograd; the LayerNorm's
replicated gradients are not multiplied by the axis size. Then the
communication volume against Megatron's formula, and bad plans.
"""

from __future__ import annotations

import einops
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.models import GPT, GPTConfig, gpt_tp_plan
from shardfn.transforms.tensor_split import Colwise, FusedLayout, tensor_split


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.mlp = MLPBlock(d, hidden)

    def forward(self, x):
        return self.mlp(x)


MLP_PLAN = {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


class Attention(nn.Module):
    """Causal self-attention whose local head count comes from the qkv weight's shape."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.head_dim = d // n_heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = einops.rearrange(self.qkv(self.ln(x)), "b s (three h e) -> three b h s e",
                                   three=3, e=self.head_dim)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(einops.rearrange(att, "b h s e -> b s (h e)"))


class TinyAttnLM(nn.Module):
    def __init__(self, vocab: int, d: int, n_heads: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = Attention(d, n_heads)
        self.ln_f = nn.LayerNorm(d)
        self.out = nn.Linear(d, 3)

    def forward(self, ids):
        return self.out(self.ln_f(self.attn(self.emb(ids))))


def attn_plan(n_heads: int) -> dict:
    return {"emb": "vocab", "attn.qkv": Colwise(fused=3, n_heads=n_heads),
            "attn.proj": "rowwise", "out": "replicate"}


def _loss(out):
    return (out * torch.linspace(-1.0, 2.0, out.shape[-1])).square().mean()


def _on_rank(case: dict):
    torch.manual_seed(1234)  # the inputs: equal on every rank (replicated)
    fmodel, plan, x = _build(case)
    model = tensor_split(fmodel, sf.Mesh({"tp": case["n"]}), "tp", plan)
    params = model.init(case["seed"])
    out = model.apply(params, x)
    grads, loss = torch.func.grad_and_value(lambda p: _loss(model.apply(p, x)))(params)
    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    _loss(model.apply(leaves, x)).backward()
    plain = [n for n, s in model.specs.items() if not isinstance(s, FusedLayout)]
    return {
        "out": out, "loss": loss,
        "full": model.gather_params(params),
        "full_by_specs": sf.gather({n: params[n] for n in plain},
                                   {n: model.specs[n] for n in plain}, model.mesh),
        "grads": model.gather_params(grads),
        "autograd": model.gather_params({n: t.grad for n, t in leaves.items()}),
        "local_ln": grads[case["ln"]],
    }


def _build(case: dict):
    if case["kind"] == "mlp":
        fmodel = sf.functional(MLP(case["d"], case["hidden"]))
        x = torch.randn(case["b"], case["s"], case["d"])
        return fmodel, MLP_PLAN, x
    if case["kind"] == "gather":  # a colwise layer whose output is gathered, then a whole one
        net = nn.Sequential(nn.LayerNorm(case["d"]), nn.Linear(case["d"], case["hidden"]),
                            nn.GELU(), nn.Linear(case["hidden"], case["d"]))
        x = torch.randn(case["b"], case["s"], case["d"])
        return sf.functional(net), {"1": Colwise(gather_output=True)}, x
    fmodel = sf.functional(TinyAttnLM(case["vocab"], case["d"], case["heads"]))
    x = torch.randint(0, case["vocab"], (case["b"], case["s"]))
    return fmodel, attn_plan(case["heads"]), x


def _reference(case: dict):
    torch.manual_seed(1234)
    fmodel, _, x = _build(case)
    params = fmodel.init(case["seed"])
    grads, loss = torch.func.grad_and_value(lambda p: _loss(fmodel.apply(p, x)))(params)
    return params, fmodel.apply(params, x), loss, grads


def _check(worlds, case: dict):
    params, out, loss, grads = _reference(case)
    for got in worlds(case["n"]).run(_on_rank, case):
        assert_close(got["full"], params)
        assert_close(got["full_by_specs"], {n: params[n] for n in got["full_by_specs"]})
        assert_close(got["out"], out)
        assert_close(got["loss"], loss)
        assert_close(got["grads"], grads)
        assert_close(got["autograd"], grads)
        # the replicated LayerNorm gradient, as this rank holds it: not tp times too big
        assert_close(got["local_ln"], grads[case["ln"]])


@settings(max_examples=4)
@given(n=st.sampled_from([2, 4]), d=st.sampled_from([4, 8]), mult=st.integers(1, 3),
       b=st.integers(1, 3), s=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_mlp_block_equals_unsplit(worlds, n, d, mult, b, s, seed):
    _check(worlds, {"kind": "mlp", "n": n, "d": d, "hidden": n * mult * 2, "b": b, "s": s,
                    "seed": seed, "ln": "mlp.ln.weight"})


@settings(max_examples=3)
@given(n=st.sampled_from([2, 4]), mult=st.integers(1, 2), b=st.integers(1, 2),
       seed=st.integers(0, 2**16))
def test_colwise_gather_output_equals_unsplit(worlds, n, mult, b, seed):
    _check(worlds, {"kind": "gather", "n": n, "d": 4, "hidden": n * mult, "b": b, "s": 3,
                    "seed": seed, "ln": "0.weight"})


@settings(max_examples=4)
@given(n=st.sampled_from([2, 4]), head_dim=st.sampled_from([2, 4]),
       heads_per_rank=st.integers(1, 2), vocab_per_rank=st.integers(1, 5),
       b=st.integers(1, 2), s=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_fused_qkv_attention_equals_unsplit(worlds, n, head_dim, heads_per_rank, vocab_per_rank,
                                            b, s, seed):
    heads = n * heads_per_rank
    _check(worlds, {"kind": "attn", "n": n, "d": heads * head_dim, "heads": heads,
                    "vocab": n * vocab_per_rank, "b": b, "s": s, "seed": seed,
                    "ln": "attn.ln.weight"})


def _gpt(case: dict):
    config = GPTConfig(vocab_size=case["vocab"], d_model=case["d"], n_layers=2,
                       n_heads=case["heads"], seq_len=8, dropout=0.0)
    torch.manual_seed(1234)
    tokens = torch.randint(0, case["vocab"], (case["b"], case["s"]))
    targets = torch.randint(0, case["vocab"], (case["b"], case["s"]))
    return sf.functional(GPT(config)), tokens, targets


def _gpt_on_rank(case: dict):
    fmodel, tokens, targets = _gpt(case)
    model = tensor_split(fmodel, sf.Mesh({"tp": case["n"]}), "tp", gpt_tp_plan())
    params = model.init(case["seed"])

    def loss_fn(p):  # the head's logits stay vocab-split: no gather of the logits
        return sf.vocab_parallel_cross_entropy(model.apply(p, tokens), targets, "tp",
                                               mesh=model.mesh)

    grads, loss = torch.func.grad_and_value(loss_fn)(params)
    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    loss_fn(leaves).backward()
    return (loss, model.gather_params(params), model.gather_params(grads),
            model.gather_params({n: t.grad for n, t in leaves.items()}), grads["ln_f.weight"])


@settings(max_examples=3)
@given(n=st.sampled_from([2, 4]), heads_per_rank=st.integers(1, 2),
       vocab_per_rank=st.integers(1, 4), s=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_reference_gpt_with_its_plan_equals_unsplit(worlds, n, heads_per_rank, vocab_per_rank,
                                                    s, seed):
    case = {"n": n, "heads": n * heads_per_rank, "d": 2 * n * heads_per_rank,
            "vocab": n * vocab_per_rank, "b": 2, "s": s, "seed": seed}
    fmodel, tokens, targets = _gpt(case)
    params = fmodel.init(seed)

    def loss_fn(p):
        return F.cross_entropy(fmodel.apply(p, tokens).flatten(0, 1), targets.flatten())

    grads, loss = torch.func.grad_and_value(loss_fn)(params)
    for got_loss, full, got_grads, got_autograd, local_ln in worlds(n).run(_gpt_on_rank, case):
        assert_close(full, params)
        assert_close(got_loss, loss)
        assert_close(got_grads, grads)  # the tied tok/head weight included
        assert_close(got_autograd, grads)
        assert_close(local_ln, grads["ln_f.weight"])


def test_fused_qkv_rank_holds_whole_heads_of_q_k_and_v():
    """``sf.FusedLayout``'s cut, on one process: rank ``r`` holds block ``r`` of each part,
    against an einops statement of it (the layout's own arithmetic is reshapes)."""
    import einops

    full = torch.arange(3 * 4 * 2).reshape(-1, 1)  # 3 parts x 4 heads x head_dim 2
    layout = sf.FusedLayout("tp", 3, tuple(full.shape))
    mesh = sf.Mesh({"tp": 1})
    assert torch.equal(layout.shard_leaf(full, mesh), full)  # one rank holds every block
    split = einops.rearrange(full, "(part tp rows) ... -> part tp rows ...", part=3, tp=2)
    local = [einops.rearrange(split[:, r], "part rows ... -> (part rows) ...") for r in range(2)]
    # rank 1: heads 2 and 3 of q (rows 4..7), of k (rows 12..15) and of v (rows 20..23)
    assert local[1].flatten().tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    blocks = full.reshape(3, 2, 4, 1)  # what FusedLayout.shard_leaf indexes on 2 ranks
    assert all(torch.equal(blocks[:, r].reshape(12, 1), local[r]) for r in range(2))
    joined = einops.rearrange(torch.cat(local), "(tp part rows) ... -> (part tp rows) ...",
                              part=3, tp=2)
    assert torch.equal(joined, full)


def _comm_on_rank(n: int, b: int, s: int, d: int):
    fmodel = sf.functional(MLP(d, 4 * d))
    model = tensor_split(fmodel, sf.Mesh({"tp": n}), "tp", MLP_PLAN)
    params = model.init(0)
    x = torch.randn(b, s, d)
    sf.reset_comm_stats()
    out = model.apply(params, x)
    forward = sf.comm_stats()
    sf.reset_comm_stats()
    torch.func.grad(lambda p: model.apply(p, x).sum())(params)
    both = sf.comm_stats()
    return (forward.op_calls("psum"), forward.total_bytes, forward.total_calls,
            both.op_calls("psum"), both.total_bytes, out.shape)


@pytest.mark.parametrize("n", [2, 4])
def test_comm_volume_is_megatrons_one_all_reduce_each_way_per_mlp_block(worlds, n):
    b, s, d = 2, 3, 8
    activation_bytes = b * s * d * 4
    all_reduce = 2 * activation_bytes * (n - 1) / n
    for f_psums, f_bytes, f_calls, psums, total, shape in worlds(n).run(_comm_on_rank, n, b, s, d):
        assert (f_psums, f_calls) == (1, 1)
        assert f_bytes == pytest.approx(all_reduce)
        # forward + backward: the rowwise output's psum, then the colwise input's (pvary's)
        assert psums == 2
        assert total == pytest.approx(2 * all_reduce)
        assert shape == (b, s, d)


def _errors_on_rank():
    mesh = sf.Mesh({"tp": 2})
    mlp = sf.functional(MLP(8, 6))
    messages = []
    for fmodel, plan in [
        (mlp, {"blocks.*.fc1": "colwise"}),
        (mlp, {"mlp.ln": "colwise"}),
        (mlp, {"mlp.fc1": "vocab"}),
        (mlp, {"mlp.fc1": "sideways"}),
        (sf.functional(TinyAttnLM(6, 12, 3)), {"attn.qkv": Colwise(fused=3, n_heads=3)}),
        (mlp, {"mlp.*": "replicate", "mlp.fc1": "colwise"}),
    ]:
        with pytest.raises(ValueError) as error:
            tensor_split(fmodel, mesh, "tp", plan)
        messages.append(str(error.value))
    model = tensor_split(mlp, mesh, "tp", {"mlp.fc1": "colwise"})
    with pytest.raises(ValueError) as error:
        model.apply(mlp.init(0), torch.ones(1, 8))  # full params, not shards
    messages.append(str(error.value))
    gpt = sf.functional(GPT(GPTConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=2,
                                      seq_len=4, dropout=0.0)))
    with pytest.raises(ValueError) as error:  # the tied head would use the full weight
        tensor_split(gpt, mesh, "tp", {"tok": "vocab"})
    messages.append(str(error.value))
    return messages  # sf.gather of a fused layout works since issue 22 (test_tensor_split_misuse)


def test_bad_plans_raise_naming_the_module(worlds):
    for messages in worlds(2).run(_errors_on_rank):
        # uneven splits are padded since issue #24 (test_tensor_split_peers_issue24.py)
        nothing, ln, vocab, unknown, heads, twice, full, tied = messages
        assert "'blocks.*.fc1' matches no module" in nothing and "'mlp.fc1'" in nothing
        assert "'mlp.ln'" in ln and "LayerNorm" in ln
        assert "nn.Embedding" in vocab and "'mlp.fc1'" in vocab
        assert "sideways" in unknown
        assert "n_heads = 3" in heads and "axis size 2" in heads
        assert "both" in twice
        assert "'mlp.fc1.weight'" in full and "(3, 8)" in full
        assert "'head.weight' is tied to 'tok.weight'" in tied and "not in the plan" in tied


def test_user_module_is_not_changed():
    module = MLP(8, 4)
    fmodel = sf.functional(module)
    model = tensor_split(fmodel, sf.Mesh({"tp": 1}), "tp", MLP_PLAN)
    assert type(module.mlp.fc1) is nn.Linear and type(fmodel.module.mlp.fc1) is nn.Linear
    assert type(model.module.mlp.fc1) is not nn.Linear
    assert [n for n, _ in model.module.named_parameters()] == list(fmodel.param_names)


def _dp_tp_on_rank(b: int):
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    model = tensor_split(sf.functional(MLP(4, 8)), mesh, "tp", MLP_PLAN)
    params = model.init(3)
    torch.manual_seed(1234)
    x = torch.randn(2 * b, 3, 4)
    mine = x[mesh.index("dp") * b:(mesh.index("dp") + 1) * b]  # this dp rank's half of the batch
    grads = torch.func.grad(lambda p: _loss(model.apply(p, mine)))(params)
    grads = sf.pmean(grads, "dp", mesh=mesh)  # data parallel over dp, tensor parallel over tp
    return model.gather_params(grads)


def test_dp_by_tp_mesh_equals_unsplit_full_batch(worlds):
    b = 2
    fmodel = sf.functional(MLP(4, 8))
    torch.manual_seed(1234)
    x = torch.randn(2 * b, 3, 4)
    grads = torch.func.grad(lambda p: _loss(fmodel.apply(p, x)))(fmodel.init(3))
    for got in worlds(4).run(_dp_tp_on_rank, b):
        assert_close(got, grads)


def _memory_on_rank(n: int):
    fmodel = sf.functional(MLP(8, 16 * n))
    model = tensor_split(fmodel, sf.Mesh({"tp": n}), "tp", MLP_PLAN)
    with sf.memory.track() as tracker:
        params = model.init(0)
    same = all(torch.equal(a, b) for a, b in zip(
        params.values(), model.shard_params_tree(fmodel.init(0)).values(), strict=True))
    return tracker.current_bytes, sum(t.numel() * t.element_size() for t in params.values()), same


@pytest.mark.parametrize("n", [2, 4])
def test_per_rank_parameter_bytes_are_split_over_tp(worlds, n):
    d, hidden = 8, 16 * n
    split = 2 * d * hidden + hidden  # fc1 weight + bias, fc2 weight
    replicated = 2 * d + d  # LayerNorm, fc2 bias
    for live, held, same in worlds(n).run(_memory_on_rank, n):
        assert same  # init == shard_params_tree(fmodel.init(seed))
        assert held == 4 * (split // n + replicated)
        assert live == held  # no view keeps a full tensor alive
