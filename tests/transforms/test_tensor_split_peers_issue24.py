"""The tensor-parallel pieces torch's ``parallelize_module`` has, each against the unsplit model.

Ported from PyTorch's own tests (``test/distributed/tensor/parallel/``), each case named
in its check's comment; every case compares values and gradients with the unsplit
module computed on the same rank (``torch.func.grad``), not only shapes:

* ``PrepareInput`` / ``PrepareOutput`` / ``PrepareInputOutput`` (re-layouts between
  replicated ``P()`` and split ``P("tp")`` / ``P(None, "tp")``), and a style on the
  root module (plan key ``""``, or a style passed as the plan);
* ``Colwise`` on an ``nn.Embedding`` (embedding dim split, no communication);
* uneven splits, padded: 10 features over 4 ranks (3, 3, 3, 1), 5 over 4 (rank 3 holds
  none), odd widths over 2; the specs keep the true shapes and the padding stays zero;
* class weights in ``vocab_parallel_cross_entropy`` (``F.cross_entropy(weight=...)``);
* ``SequenceParallel`` on a user-written RMSNorm (torch's ``RMSNormPython``);
* a Llama-like block under sequence parallelism: q, k, v share ONE all-gather of their
  input, and gate / up one: 2 all-gathers forward + 2 backward per block (before this
  change 5 + 2: one per colwise layer), 2 + 2 reduce-scatters; without sequence
  parallelism 2 psums forward + 2 backward (was 2 + 5).

Two worlds: 2 ranks (everything) and 4 ranks (the uneven MLP of torch's test).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn import P
from shardfn.transforms.tensor_split import Colwise, Rowwise, SequenceParallel, tensor_split


class MLPModule(nn.Module):
    """torch's ``common_dtensor.MLPModule``: 10 -> 16 -> 10."""

    def __init__(self, d_in: int = 10, hidden: int = 16, d_out: int = 10):
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden,
                                                                                          d_out)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class RMSNormPython(nn.Module):
    """torch's ``common_dtensor.RMSNormPython``: a user-written norm (not ``nn.RMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """A Llama-like block: RMSNorm, q/k/v/o attention (causal), RMSNorm, SwiGLU MLP."""

    def __init__(self, d: int = 16, heads: int = 4, hidden: int = 24):
        super().__init__()
        self.head_dim = d // heads
        self.attention_norm, self.ffn_norm = RMSNormPython(d), RMSNormPython(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):  # the sequence length from q: under SP x is this rank's chunk
        h = self.attention_norm(x)
        q, k, v = (w(h) for w in (self.wq, self.wk, self.wv))
        b, t = q.shape[:2]
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _randomise(fmodel, seed: int):
    """``fmodel.init`` with every leaf random (norm weights not all ones)."""
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=generator) * 0.5
            for n, t in fmodel.init(seed).items()}


def _counts() -> dict:
    stats = sf.comm_stats()
    return {op: stats.op_calls(op) for op in ("psum", "all_gather", "psum_scatter", "all_to_all")
            if stats.op_calls(op)}


def _split_and_unsplit(model, fmodel, full, loss_of, inputs_tp, inputs_full):
    """``(got, want)``: the split model's loss and gathered grads, and the unsplit ones."""
    params = model.shard(full)
    grads, loss = torch.func.grad_and_value(lambda p: loss_of(model.apply(p, *inputs_tp)))(params)
    want_grads, want_loss = torch.func.grad_and_value(
        lambda p: loss_of(fmodel.apply(p, *inputs_full), full=True))(full)
    return (loss, model.gather(grads)), (want_loss, want_grads)


def _on_two(seed: int) -> dict:
    mesh = sf.Mesh({"tp": 2})
    rank, tp = mesh.index("tp"), 2
    out: dict = {}
    generator = torch.Generator().manual_seed(seed)

    # --- test_parallelize_module_with_root_module: a PrepareInputOutput on "" splits the
    # batch, colwise / rowwise over dim 0 inside, the output gathered again
    fmodel = sf.functional(MLPModule())
    full = _randomise(fmodel, seed)
    x = torch.rand(16, 10, generator=generator)
    plan = {"": sf.PrepareInputOutput(P(), P("tp"), P("tp"), P()),
            "net1": Colwise(sequence_parallel=True, sequence_dim=0),
            "net2": Rowwise(sequence_parallel=True, sequence_dim=0)}
    model = tensor_split(fmodel, mesh, "tp", plan)

    def total(y, full=False):
        return (y * torch.arange(y.numel()).view(y.shape)).sum() / 100

    out["root_prepare"] = _split_and_unsplit(model, fmodel, full, total, (x,), (x,))

    # --- test_linear_col_wise_parallel / test_linear_row_wise_parallel: the style alone is
    # the plan, on the root Linear (Linear(10, 16) colwise gathered; Linear(16, 10) rowwise:
    # apply's inputs are replicated, so torch's per-rank input slice is split_input=True)
    col = sf.functional(nn.Linear(10, 16))
    col_full = _randomise(col, seed + 1)
    col_tp = tensor_split(col, mesh, "tp", Colwise(gather_output=True))
    out["root_colwise"] = _split_and_unsplit(col_tp, col, col_full, total, (x,), (x,))
    row = sf.functional(nn.Linear(16, 10))
    row_full = _randomise(row, seed + 2)
    row_tp = tensor_split(row, mesh, "tp", {"": Rowwise(split_input=True)})
    x16 = torch.rand(9, 16, generator=generator)
    out["root_rowwise"] = _split_and_unsplit(row_tp, row, row_full, total, (x16,), (x16,))

    # --- test_prepare_module_input / _output / _input_output on an Identity
    ident = sf.functional(nn.Identity())
    x_full = torch.rand(2 * tp, 6, generator=generator)
    weights = torch.rand(2 * tp, 6, generator=generator)
    chunk, w_chunk = x_full.chunk(tp)[rank], weights.chunk(tp)[rank]
    gather_in = tensor_split(ident, mesh, "tp", sf.PrepareInput(P("tp"), P()))
    y = gather_in.apply({}, chunk)
    grad = torch.func.grad(lambda c: (gather_in.apply({}, c) * weights).sum())(chunk)
    out["prepare_input"] = ((y, grad), (x_full, w_chunk))  # backward: this rank's block
    scatter_out = tensor_split(ident, mesh, "tp", sf.PrepareOutput(P(), P("tp")))
    y = scatter_out.apply({}, x_full)
    grad = torch.func.grad(lambda v: (scatter_out.apply({}, v) * w_chunk).sum())(x_full)
    out["prepare_output"] = ((y, grad), (chunk, weights))  # backward: all blocks gathered
    both = tensor_split(ident, mesh, "tp", sf.PrepareInputOutput(P("tp"), P(), P(), P(None, "tp")))
    y = both.apply({}, chunk)
    out["prepare_input_output"] = (y, x_full.chunk(tp, dim=1)[rank])
    swap = tensor_split(ident, mesh, "tp", sf.PrepareInput(P("tp"), P(None, "tp")))
    grad = torch.func.grad(lambda c: (swap.apply({}, c)
                                      * weights.chunk(tp, dim=1)[rank]).sum())(chunk)
    out["prepare_all_to_all"] = ((swap.apply({}, chunk), grad),
                                 (x_full.chunk(tp, dim=1)[rank], w_chunk))

    # --- test_colwise_parallel_embedding: the embedding dim split, no communication;
    # with gather_output and an uneven dim (7 over 2: 4 + 3, padded)
    ids = torch.arange(8).reshape(4, 2)
    for dim, gathered in ((16, False), (7, True)):
        emb = sf.functional(nn.Embedding(16, dim))
        emb_full = _randomise(emb, seed + dim)
        emb_tp = tensor_split(emb, mesh, "tp", {"": Colwise(gather_output=gathered)})
        sf.reset_comm_stats()
        local = emb_tp.apply(emb_tp.shard(emb_full), ids)
        comm = _counts()
        want = emb.apply(emb_full, ids)
        padded = -(-dim // tp) * tp
        want_local = want if gathered else F.pad(want, (0, padded - dim)).chunk(tp, -1)[rank]
        out[f"colwise_embedding_{dim}"] = (
            (local, comm, emb_tp.specs["weight"].shape),
            (want_local, {"all_gather": 1} if gathered else {}, (16, dim)))

        def squares(y, full=False, gathered=gathered, mesh=mesh):  # the full rows
            rows = y.sum(-1)
            rows = rows if gathered or full else sf.psum_invariant(rows, "tp", mesh=mesh)
            return rows.square().sum()

        out[f"colwise_embedding_{dim}_grads"] = _split_and_unsplit(emb_tp, emb, emb_full,
                                                                   squares, (ids,), (ids,))

    # --- uneven: colwise 7 over 2 (4 + 3) into rowwise 7, and a gathered colwise 9
    odd = sf.functional(MLPModule(6, 7, 9))
    odd_full = _randomise(odd, seed + 3)
    x6 = torch.rand(5, 6, generator=generator)
    for name, plan in (("uneven_pair", {"net1": "colwise", "net2": "rowwise"}),
                       ("uneven_gathered", {"net2": Colwise(gather_output=True)})):
        odd_tp = tensor_split(odd, mesh, "tp", plan)
        out[name] = _split_and_unsplit(odd_tp, odd, odd_full, total, (x6,), (x6,))

    # --- class weights (F.cross_entropy's weight=), vocab 10 split 5 + 5, and 9 (5 + 4)
    for vocab in (10, 9):
        logits = torch.randn(12, vocab, generator=generator)
        targets = torch.randint(0, vocab, (12,), generator=generator)
        targets[3] = -100
        class_weight = torch.rand(vocab, generator=generator) + 0.1
        for reduction in ("mean", "sum", "none"):
            out[f"ce_weight_{vocab}_{reduction}"] = _weighted_ce(mesh, logits, targets,
                                                                 class_weight, reduction)

    # --- test_sequence_parallel_style (RMSNormPython): a user norm on sequence chunks
    norm = sf.functional(RMSNormPython(12))
    norm_full = _randomise(norm, seed + 4)
    norm_tp = tensor_split(norm, mesh, "tp", {"": SequenceParallel()})
    xs = torch.rand(3, 4 * tp, 12, generator=generator)
    sf.reset_comm_stats()
    y = norm_tp.apply(norm_tp.shard(norm_full), xs.chunk(tp, dim=1)[rank])
    forward_comm = _counts()
    out["sp_user_norm"] = ((y, forward_comm),
                           (norm.apply(norm_full, xs).chunk(tp, dim=1)[rank], {}))

    def chunk_squares(y, full=False):  # each rank's chunk's part, summed over the ranks
        return y.square().sum() if full else sf.psum_invariant(y.square().sum(), "tp", mesh=mesh)

    out["sp_user_norm_grads"] = _split_and_unsplit(norm_tp, norm, norm_full, chunk_squares,
                                                   (xs.chunk(tp, dim=1)[rank],), (xs,))

    # --- a Llama-like block: q/k/v (and w1/w3) share one all-gather (SP) / one pvary
    block = sf.functional(LlamaBlock())
    block_full = _randomise(block, seed + 5)
    xb = torch.rand(2, 4 * tp, 16, generator=generator)
    for sp in (True, False):
        suffix = "_sp" if sp else ""
        plan = {"w[qkv13]": f"colwise{suffix}", "w[o2]": f"rowwise{suffix}"}
        if sp:
            plan.update({"attention_norm": "sequence_parallel", "ffn_norm": "sequence_parallel"})
        block_tp = tensor_split(block, mesh, "tp", plan)
        params = block_tp.shard(block_full)
        x_in = xb.chunk(tp, dim=1)[rank] if sp else xb

        def loss_fn(p, block_tp=block_tp, x_in=x_in):
            return block_tp.apply(p, x_in).square().sum()

        sf.reset_comm_stats()
        loss_fn(params)
        forward = _counts()
        sf.reset_comm_stats()
        grads = torch.func.grad(loss_fn)(params)
        both_ways = _counts()
        want = torch.func.grad(lambda p: block.apply(p, xb).square().sum())(block_full)
        out[f"llama_block{suffix}"] = ((block_tp.gather(grads), forward, both_ways),
                                       (want, *_expected_block_comm(sp)))
    return out


def _weighted_ce(mesh, logits, targets, class_weight, reduction):
    """``(got, want)``: the vocab-parallel loss and logits gradient with class weights, and
    ``F.cross_entropy(weight=...)``'s (vocab padded to 10 columns, 5 per rank)."""
    tp, rank, vocab = mesh.size("tp"), mesh.index("tp"), logits.shape[-1]
    local = F.pad(logits, (0, 10 - vocab)).chunk(tp, -1)[rank]

    def ce(z):
        return sf.vocab_parallel_cross_entropy(z, targets, "tp", mesh=mesh, vocab_size=vocab,
                                               weight=class_weight, reduction=reduction)

    def reference(z):
        return F.cross_entropy(z, targets, weight=class_weight, reduction=reduction)

    want_grad = torch.func.grad(lambda z: reference(z).sum())(logits)
    return ((ce(local), torch.func.grad(lambda z: ce(z).sum())(local)),
            (reference(logits), F.pad(want_grad, (0, 10 - vocab)).chunk(tp, -1)[rank]))


def _expected_block_comm(sp: bool) -> tuple[dict, dict]:
    """Forward, and forward + backward, collectives of one Llama-like block on 2 ranks."""
    if sp:  # in: 1 all-gather for q/k/v, 1 for w1/w3; out: wo, w2 reduce-scatters;
        # backward: their transposes, plus the psum of each norm weight's gradient
        return ({"all_gather": 2, "psum_scatter": 2},
                {"all_gather": 4, "psum_scatter": 4, "psum": 2})
    return {"psum": 2}, {"psum": 4}  # g of wo and w2; backward f of the shared inputs


def _on_four(seed: int) -> dict:
    """test_parallelize_mlp_with_module_api: net2 Linear(16, 10) colwise gathered over 4
    ranks (3, 3, 3, 1 rows); and hidden 10 / 5 over 4 in a colwise / rowwise pair."""
    mesh = sf.Mesh({"tp": 4})
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(12, 10, generator=generator)
    out = {}
    for hidden, plan in ((16, {"net*": Colwise(gather_output=True)}),
                         (10, {"net1": "colwise", "net2": "rowwise"}),
                         (5, {"net1": "colwise", "net2": "rowwise"})):
        fmodel = sf.functional(MLPModule(10, hidden, 10))
        full = _randomise(fmodel, seed + hidden)
        model = tensor_split(fmodel, mesh, "tp", plan)
        params = model.shard(full)

        def loss_fn(p, model=model):
            return model.apply(p, x).square().sum()

        grads = torch.func.grad(loss_fn)(params)
        step = {n: params[n] - 0.1 * grads[n] for n in params}  # one SGD step, as torch's
        want_grads = torch.func.grad(lambda p, f=fmodel: f.apply(p, x).square().sum())(full)
        want_step = {n: full[n] - 0.1 * want_grads[n] for n in full}
        repadded = model.shard(model.gather(step))  # zeros in the padding: equal iff it is
        out[hidden] = ((model.gather(grads), model.apply(step, x), model.gather(step),
                        {n: tuple(s.shape) for n, s in model.specs.items()},
                        model.local_shapes, (step, repadded)),
                       (want_grads, fmodel.apply(want_step, x), want_step,
                        {n: tuple(t.shape) for n, t in full.items()}))
    return out


def test_peer_tp_pieces_equal_the_unsplit_model_on_two_ranks(worlds):
    """Ports of torch's ``test_parallelize_module_with_root_module``,
    ``test_linear_col_wise_parallel``, ``test_linear_row_wise_parallel``,
    ``test_prepare_module_input``/``_output``/``_input_output``,
    ``test_colwise_parallel_embedding``, ``test_sequence_parallel_style`` (RMSNormPython),
    plus uneven splits, class weights and the shared all-gather of q/k/v."""
    results = worlds(2).run(_on_two, 0)
    for rank, out in enumerate(results):
        for name, (got, want) in out.items():
            if name.startswith("llama_block"):
                grads, forward, both_ways = got
                want_grads, want_forward, want_both = want
                assert_close(grads, want_grads, rtol=1e-4, atol=1e-4, msg=f"{name} rank {rank}")
                assert forward == want_forward, (name, rank, forward)
                assert both_ways == want_both, (name, rank, both_ways)
                continue
            assert_close(got, want, rtol=1e-5, atol=1e-5,
                         msg=lambda m, name=name, rank=rank: f"{name} on rank {rank}: {m}")


def test_uneven_splits_are_padded_over_four_ranks(worlds):
    """torch's ``test_parallelize_mlp_with_module_api`` (``net2`` 10 features over 4 ranks,
    colwise gathered) and colwise / rowwise pairs of hidden 10 and 5 over 4 (rank 3 holds
    1 and 0 real features): gradients, one SGD step and the output after it equal the
    unsplit model's; the specs keep the true shapes, each rank holds ceil(d / 4)."""
    results = worlds(4).run(_on_four, 0)
    for rank, out in enumerate(results):
        for hidden, (got, want) in out.items():
            grads, after, gathered_step, spec_shapes, local_shapes, (step, repadded) = got
            want_grads, want_after, want_step, true_shapes = want
            assert_close(grads, want_grads, rtol=1e-5, atol=1e-5)
            assert_close(after, want_after, rtol=1e-5, atol=1e-5)
            assert_close(gathered_step, want_step, rtol=1e-5, atol=1e-5)
            assert spec_shapes == true_shapes
            assert_close(step, repadded, rtol=0, atol=0)  # the padding got no update
            block = -(-hidden // 4)
            if hidden != 16:
                assert local_shapes["net1.weight"] == (block, 10), (rank, hidden)
                assert local_shapes["net2.weight"] == (10, block), (rank, hidden)


def test_misuse_names_the_module():
    mesh = sf.Mesh({"tp": 1})
    with pytest.raises(ValueError, match="same length"):
        sf.PrepareInput((P("tp"), None), P())
    with pytest.raises(TypeError, match="give a P"):
        sf.PrepareOutput("shard", P())
    with pytest.raises(ValueError, match="'net1'.*tensor-parallel axis 'tp'"):
        tensor_split(sf.functional(MLPModule()), mesh, "tp",
                     {"net1": sf.PrepareInput(P("dp"), P())})
    with pytest.raises(ValueError, match="'' for the root module"):
        tensor_split(sf.functional(MLPModule()), mesh, "tp", {"nothing": "colwise"})
    with pytest.raises(ValueError, match="'0' needs an nn.Linear or a Conv1D or an nn.Embedding"):
        tensor_split(sf.functional(nn.Sequential(nn.LayerNorm(4))), mesh, "tp", {"0": "colwise"})
    block = sf.functional(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="'0'.*SequenceParallel takes"):
        tensor_split(block, mesh, "tp", {"0": "sequence_parallel"})
    emb = sf.functional(nn.Embedding(8, 4))
    with pytest.raises(ValueError, match="embedding dim; fused"):
        tensor_split(emb, mesh, "tp", {"": Colwise(sequence_parallel=True)})
    with pytest.raises(ValueError, match=r"weight must be .*\[6\]"):
        sf.vocab_parallel_cross_entropy(torch.randn(3, 6), torch.zeros(3, dtype=torch.long),
                                        "tp", mesh=mesh, weight=torch.ones(5))
