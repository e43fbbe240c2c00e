"""The MoE layer on one process: Hugging Face Mixtral's numbers for the same weights, the
router's capacity and dropping rules, the auxiliary losses, and its errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from shardfn.models.moe import MoE
from shardfn.models.moe_router import expert_capacity, load_balancing_loss, route, router_z_loss


def _mixtral(top_k: int):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=8, intermediate_size=12, num_local_experts=4,
                           num_experts_per_tok=top_k)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


@pytest.mark.parametrize("top_k", [1, 2])
def test_matches_hugging_face_mixtral(top_k):
    """Dropless with renormalised weights is Mixtral's block: same state dict, same output,
    same load-balancing loss; gradients agree too."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    block = _mixtral(top_k)
    moe = MoE(8, 12, num_experts=4, top_k=top_k)
    assert sorted(moe.state_dict()) == sorted(block.state_dict())
    moe.load_state_dict(block.state_dict())
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    out, aux = moe(x)
    torch.testing.assert_close(out, block(x))
    logits = block.gate(x.reshape(-1, 8))[0]
    torch.testing.assert_close(aux.load_balancing, load_balancing_loss_func((logits,), 4, top_k))
    torch.testing.assert_close(aux.z_loss, torch.logsumexp(logits, -1).square().mean())
    out.square().sum().backward()
    block(x).square().sum().backward()
    for (name, p), (_, q) in zip(moe.named_parameters(), block.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_wrong_weight_mapping_is_caught():
    """The comparison above can fail: swapping the gate and up halves changes the output."""
    block = _mixtral(2)
    state = dict(block.state_dict())
    gate, up = state["experts.gate_up_proj"].chunk(2, dim=1)
    state["experts.gate_up_proj"] = torch.cat([up, gate], dim=1)
    moe = MoE(8, 12, num_experts=4, top_k=2)
    moe.load_state_dict(state)
    x = torch.randn(1, 6, 8)
    assert not torch.allclose(moe(x)[0], block(x))


def test_capacity_drops_second_choices_first():
    """GShard's order: every first choice is queued before any second choice."""
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0], [2.0, 3.0, 0.0]])
    routing = route(logits, top_k=2, capacity_factor=0.75)  # ceil(4 * 2 / 3 * .75) = 2
    assert expert_capacity(4, 3, 2, 0.75) == 2
    # expert 0: first choices of tokens 0, 1, then second choice of token 3 -> dropped
    # expert 1: first choices of tokens 2, 3, then second choice of token 0 -> dropped
    assert routing.experts.tolist() == [[0, 1], [0, 2], [1, 2], [1, 0]]
    assert routing.kept.tolist() == [[True, False], [True, True], [True, True], [True, False]]


@given(tokens=st.integers(1, 40), experts=st.integers(2, 8), top_k=st.sampled_from([1, 2]),
       factor=st.sampled_from([0.5, 1.0, 1.25, 2.0]), seed=st.integers(0, 2**16))
def test_capacity_is_respected(tokens, experts, top_k, factor, seed):
    """No expert takes more than its capacity; within an expert, first choices are kept
    before second ones and earlier tokens before later ones; dropless keeps everything."""
    logits = 3 * torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    routing = route(logits, top_k, factor)
    capacity = math.ceil(tokens * top_k / experts * factor)
    for e in range(experts):
        chose = routing.experts == e
        queue = [(j, t) for j in range(top_k) for t in range(tokens) if chose[t, j]]
        kept = [bool(routing.kept[t, j]) for j, t in queue]
        assert kept == [i < capacity for i in range(len(queue))]
    assert route(logits, top_k).kept.all()


def test_dropped_tokens_give_zeros_and_kept_ones_match_dropless():
    """A token whose choices were all dropped gets zeros (left to the residual); a token
    whose choices were all kept gets the dropless output."""
    torch.manual_seed(0)
    fm = sf.functional(MoE(4, 8, num_experts=2, top_k=1, capacity_factor=0.5))
    dropless = sf.functional(MoE(4, 8, num_experts=2, top_k=1))
    params = fm.init(0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    out, _ = fm.apply(params, x)
    full, _ = dropless.apply(params, x)
    kept = route(x @ params["gate.weight"].t(), 1, 0.5).kept[:, 0]
    assert 0 < int(kept.sum()) < 8
    torch.testing.assert_close(out[kept], full[kept])
    assert torch.equal(out[~kept], torch.zeros_like(out[~kept]))


def test_auxiliary_losses():
    """Uniform routing gives a balance loss of 1 per choice; all tokens on one expert E;
    the z-loss is mean(logsumexp^2); ``MoEAux.loss`` weighs both."""
    probs = torch.full((6, 3), 1 / 3)
    spread = torch.tensor([[0], [1], [2], [0], [1], [2]])
    torch.testing.assert_close(load_balancing_loss(probs, spread, 3), torch.tensor(1.0))
    one_hot = torch.tensor([[1.0, 0.0, 0.0]]).expand(6, 3)
    torch.testing.assert_close(load_balancing_loss(one_hot, torch.zeros(6, 1, dtype=torch.long),
                                                   3), torch.tensor(3.0))
    torch.testing.assert_close(router_z_loss(torch.zeros(5, 4)), torch.tensor(math.log(4) ** 2))
    moe = MoE(4, 8, num_experts=3, aux_loss_coef=0.5, z_loss_coef=0.25)
    _, aux = moe(torch.randn(5, 4))
    torch.testing.assert_close(aux.loss, 0.5 * aux.load_balancing + 0.25 * aux.z_loss)
    _, none = MoE(4, 8, num_experts=3, aux_loss="none")(torch.randn(5, 4))
    assert float(none.load_balancing) == 0.0


def test_switch_weights_are_the_probabilities():
    """``normalize=False`` (Switch top-1): the weight is the router probability, so the
    router gets a gradient from the output (Mixtral's renormalised top-1 weight is 1)."""
    logits = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    torch.testing.assert_close(route(logits, 1, normalize=False).weights[:, 0],
                               torch.softmax(logits, -1).max(-1).values)
    moe = MoE(4, 8, num_experts=2, top_k=1, normalize=False, aux_loss="none")
    moe(torch.randn(6, 4))[0].sum().backward()
    assert moe.gate.weight.grad.abs().sum() > 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="top_k must be in 1..num_experts=2"):
        MoE(4, 8, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(4, 8, num_experts=2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="aux_loss"):
        MoE(4, 8, num_experts=2, aux_loss="gshard")
    with pytest.raises(ValueError, match="last dim is 5, expected dim=4"):
        MoE(4, 8, num_experts=2)(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="MoE does not run under torch.func.vmap"):
        torch.func.vmap(MoE(4, 8, num_experts=2))(torch.randn(2, 3, 4))
