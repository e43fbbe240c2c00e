"""TP x EP: tensor parallelism on the attention of an expert-parallel model
(``tensor_split(expert_parallel(fm, mesh, "ep"), mesh, "tp", plan)``) against one process:
a property test over ep and tp sizes (1, 2), experts, top-k, capacity and uneven batches
per ep index (outputs, losses, gradients gathered by ``model.gather`` and ``sf.gather``,
``init`` == ``shard``), under torch.func.grad and autograd; a mutant without the ep
reduction is caught; the reverse order and the layouts it does not do are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import shardfn as sf
from shardfn.models.gpt import Attention, GPTConfig
from shardfn.models.moe import MoE
from shardfn.transforms._tp_ep import TpEpModel, moe_paths
from shardfn.transforms.experts import expert_parallel

DIM, WIDTH, SEQ = 6, 8, 5
PLAN = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}


class _Block(nn.Module):
    """Pre-LN block: fused-qkv attention (GPT's), then an MoE layer; returns its aux loss."""

    def __init__(self, experts: int, top_k: int, capacity: float | None):
        super().__init__()
        config = GPTConfig(vocab_size=4, d_model=WIDTH, n_layers=1, n_heads=2, seq_len=SEQ,
                           dropout=0.0)
        self.ln1, self.attn = nn.LayerNorm(WIDTH), Attention(config)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = MoE(WIDTH, 12, experts, top_k, capacity_factor=capacity, z_loss_coef=0.01)

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        y, aux = self.mlp(self.ln2(h))
        return h + y, aux.loss


class _MoEGPT(nn.Module):
    """Two attention + MoE blocks between an input and an output Linear."""

    def __init__(self, experts: int, top_k: int, capacity: float | None):
        super().__init__()
        self.inp, self.out = nn.Linear(DIM, WIDTH), nn.Linear(WIDTH, 3)
        self.blocks = nn.ModuleList([_Block(experts, top_k, capacity) for _ in range(2)])

    def forward(self, x):
        h, aux = self.inp(x), 0.0
        for block in self.blocks:
            h, a = block(h)
            aux = aux + a
        return self.out(h), aux


def _fm(experts, top_k, capacity):
    torch.manual_seed(0)
    return sf.functional(_MoEGPT(experts, top_k, capacity))


def _tokens(batches, index, seed):
    g = torch.Generator().manual_seed(seed * 7 + index)
    return torch.randn(batches[index], SEQ, DIM, generator=g)


def _loss(apply, leaves, x):
    out, aux = apply(leaves, x)
    return out.square().mean() + aux


def _reference(setup):
    """Per ep index ``(output, loss)`` of the unsplit model, and the gradient of the mean
    over ep indices of their losses."""
    ep, _, experts, top_k, capacity, batches, seed, _ = setup
    fm = _fm(experts, top_k, capacity)
    full = fm.init(seed)
    xs = [_tokens(batches, i, seed) for i in range(ep)]
    outs = [(fm.apply(full, x)[0], _loss(fm.apply, full, x)) for x in xs]
    grads = torch.func.grad(lambda t: sum(_loss(fm.apply, t, x) for x in xs) / ep)(full)
    return outs, grads


def _on_rank(setup, enter_ep=True):
    """This rank's ``(ep index, output, loss, grads by model.gather, by sf.gather,
    init == shard)``; ``enter_ep=False``: the mutant without the ep reduction."""
    ep, tp, experts, top_k, capacity, batches, seed, mode = setup
    mesh = sf.Mesh({"ep": ep, "tp": tp})
    fm = _fm(experts, top_k, capacity)
    model = sf.tensor_split(expert_parallel(fm, mesh, "ep"), mesh, "tp", PLAN)
    leaves = model.shard(fm.init(seed))
    assert leaves["blocks.0.attn.qkv.weight"].shape[0] == 3 * WIDTH // tp  # split over tp
    assert leaves["blocks.1.mlp.experts.down_proj"].shape[0] == experts // ep
    index = mesh.index("ep")
    x = _tokens(batches, index, seed)
    apply = model.apply if enter_ep else model.tp.apply
    out = model.apply(leaves, x)[0]
    if mode == "grad":
        grads, loss = torch.func.grad_and_value(lambda t: _loss(apply, t, x))(leaves)
    else:
        live = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        loss = _loss(apply, live, x)
        loss.backward()
        grads = {k: v.grad for k, v in live.items()}
    init = model.init(seed)
    same_init = all(torch.equal(init[k], leaves[k]) for k in init)
    return index, out, loss.detach(), model.gather(grads), sf.gather(grads, model.specs, mesh), \
        same_init


def _run(worlds, setup, enter_ep=True):
    size = setup[0] * setup[1]
    return [_on_rank(setup, enter_ep)] if size == 1 else worlds(size).run(_on_rank, setup,
                                                                          enter_ep)


@st.composite
def _setups(draw):
    ep, tp = draw(st.sampled_from([2, 1])), draw(st.sampled_from([2, 1]))
    experts, top_k = draw(st.sampled_from([4, 2])), draw(st.sampled_from([2, 1]))
    capacity = draw(st.sampled_from([None, 1.0]))
    batches = tuple(draw(st.integers(1, 3)) for _ in range(ep))  # uneven over ep
    return (ep, tp, experts, top_k, capacity, batches, draw(st.integers(0, 9)),
            draw(st.sampled_from(["grad", "autograd"])))


@settings(max_examples=2, deadline=None)
@given(setup=_setups())
@example(setup=(2, 2, 4, 2, None, (1, 3), 1, "grad"))
@example(setup=(2, 2, 2, 1, 1.0, (2, 2), 2, "autograd"))
def test_tp_ep_matches_one_process(worlds, setup):
    """Every rank's output and loss are its ep index's on one process; the gathered
    gradients are the unsplit model's of the mean over the ep indices' losses."""
    outs, grads = _reference(setup)
    for index, out, loss, by_model, by_spec, same_init in _run(worlds, setup):
        torch.testing.assert_close(out, outs[index][0])
        torch.testing.assert_close(loss, outs[index][1])
        for name, want in grads.items():
            torch.testing.assert_close(by_model[name], want, msg=name)
            torch.testing.assert_close(by_spec[name], want, msg=name)
        assert same_init


def test_missing_ep_reduction_is_caught(worlds):
    """The mutant that skips the ep entry (the tp model's apply direct) gives each ep rank
    its own batch's gradient of the attention leaves: the comparison fails."""
    setup = (2, 2, 4, 2, None, (1, 3), 1, "grad")
    _, grads = _reference(setup)
    results = _run(worlds, setup, enter_ep=False)
    wrong = [name for name in grads if "attn" in name
             and not torch.allclose(results[0][3][name], grads[name])]
    assert wrong, "a missing reduction over ep went unnoticed"


def test_layout_and_refusals():
    """Experts over ep, attention over tp (fused qkv), the rest replicated; the reverse
    order, one axis for both, a style on the MoE layer and sequence parallelism are
    refused by name."""
    mesh = sf.Mesh({"ep": 1, "tp": 1})
    fm = _fm(2, 1, None)
    ep = expert_parallel(fm, mesh, "ep")
    model = sf.tensor_split(ep, mesh, "tp", PLAN)
    assert isinstance(model, TpEpModel)
    assert moe_paths(ep) == ("blocks.0.mlp", "blocks.1.mlp")
    specs = model.specs
    assert specs["blocks.0.mlp.experts.down_proj"].spec == sf.P("ep")
    assert specs["blocks.1.attn.proj.weight"].spec == sf.P(None, "tp")
    assert specs["blocks.0.mlp.gate.weight"].spec == sf.P()
    with pytest.raises(TypeError, match=r"sf.tensor_split\(sf.expert_parallel"):
        expert_parallel(sf.tensor_split(fm, mesh, "tp", PLAN), mesh, "ep")
    with pytest.raises(ValueError, match="is the expert-parallel axis"):
        sf.tensor_split(ep, mesh, "ep", PLAN)
    with pytest.raises(ValueError, match="inside\\) the MoE layer 'blocks.0.mlp'"):
        sf.tensor_split(ep, mesh, "tp", {**PLAN, "blocks.0.mlp.gate": "colwise"})
    with pytest.raises(ValueError, match="sequence-parallel style"):
        sf.tensor_split(ep, mesh, "tp", {"blocks.*.attn.qkv": "colwise_sp",
                                         "blocks.*.attn.proj": "rowwise_sp",
                                         "blocks.*.ln*": "sequence_parallel"})
    with pytest.raises(ValueError, match="not the mesh the model was expert_parallel over"):
        sf.tensor_split(ep, sf.Mesh({"tp": 1}), "tp", PLAN)


HF_PLAN = {"model.layers.*.self_attn.q_proj": "colwise",
           "model.layers.*.self_attn.k_proj": "colwise",
           "model.layers.*.self_attn.v_proj": "colwise",
           "model.layers.*.self_attn.o_proj": "rowwise"}


def _hf_on_rank():
    """This rank's ``(ep index, logits, loss, gathered grads)`` of HF Mixtral on
    {"ep": 2, "tp": 2} (heads over tp, experts over ep)."""
    from tests.moe import test_moe_hf as hf

    mesh = sf.Mesh({"ep": 2, "tp": 2})
    module = hf.hf_model("mixtral")
    fm = sf.functional(module)
    model = sf.tensor_split(expert_parallel(fm, mesh, "ep"), mesh, "tp", HF_PLAN)
    leaves = model.params_from(module)
    assert leaves["model.layers.0.self_attn.q_proj.weight"].shape[0] == 32 // 2
    index = mesh.index("ep")
    ids = hf.tokens(index)
    logits, loss, _ = hf.run(model, leaves, ids)
    return index, logits, loss, model.gather(hf.grads_of(model, leaves, ids, "grad"))


def test_hf_mixtral_tp_ep(worlds):
    """Hugging Face Mixtral from config: attention heads over tp, experts over ep; logits,
    losses (with the router's aux loss) and gradients as on one process."""
    from tests.moe import test_moe_hf as hf

    outs, grads = hf.reference("mixtral", 2)
    for index, logits, loss, got in worlds(4).run(_hf_on_rank):
        torch.testing.assert_close(logits, outs[index][0])
        torch.testing.assert_close(loss, outs[index][1])
        for name, want in grads.items():
            torch.testing.assert_close(got[name], want, msg=name)


def _conforms():
    mesh = sf.Mesh({"ep": 2, "tp": 2})
    model = sf.tensor_split(expert_parallel(_fm(4, 2, 1.25), mesh, "ep"), mesh, "tp", PLAN)
    g = torch.Generator().manual_seed(3)  # the same tokens on every rank: the suite's
    x, y = torch.randn(2, SEQ, DIM, generator=g), torch.randn(2, SEQ, 3, generator=g)

    def loss_fn(out, t):
        return (out[0] - t).square().mean() + out[1]

    return sf.testing.check_model(model, (x,), loss_fn=loss_fn, targets=y).checked


def test_model_protocol_conformance(worlds):
    """The conformance suite (members, init, leaves, apply, train/eval, gathered gradients
    against the unsplit model) on {"ep": 2, "tp": 2}."""
    for checked in worlds(4).run(_conforms):
        assert {"members", "init", "gather", "apply", "grads"} <= set(checked)


def _save(path: str):
    import shardfn.checkpoint as ck

    mesh = sf.Mesh({"ep": 2, "tp": 2})
    fm = _fm(4, 2, None)
    model = sf.tensor_split(expert_parallel(fm, mesh, "ep"), mesh, "tp", PLAN)
    ck.save(path, {"params": model.init(3)}, mesh, {"params": model})


def test_checkpoint_from_tp_ep_to_one_process(worlds, tmp_path):
    """Saved under {"ep": 2, "tp": 2} (experts over ep, fused qkv and proj over tp), loaded
    into one process: the unsplit init."""
    import shardfn.checkpoint as ck

    path = str(tmp_path / "tp_ep")
    worlds(4).run(_save, path)
    full = _fm(4, 2, None).init(3)
    like = {k: torch.zeros_like(v) for k, v in full.items()}
    torch.testing.assert_close(ck.load(path, {"params": like})["params"], full)
