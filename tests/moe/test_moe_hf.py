"""Hugging Face Mixtral and Qwen2-MoE (random init from a small config) under expert
parallelism: each rank's logits, loss and aux loss equal the one-process HF model's on that
rank's tokens, the gathered gradients (torch.func.grad and autograd) the one-process
gradient of the mean of the ranks' losses; with data parallelism on {"dp": 2, "ep": 2};
and under ep x FSDP (shard_params over "dp" of the ep model)."""

from __future__ import annotations

import copy

import pytest
import torch

import shardfn as sf
from shardfn.transforms._experts_hf import HFExpertsOverAxis, split_hf_experts
from shardfn.transforms.experts import expert_parallel

VOCAB, SEQ, EXPERTS = 64, 8, 4
BATCHES = (1, 2, 1, 3)  # sequences on rank 0, 1, ...: uneven token counts per rank


def hf_model(kind: str):
    """A tiny random-init Mixtral or Qwen2-MoE (hidden 32, 2 layers, 4 experts, top-2)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=SEQ,
                  router_aux_loss_coef=0.1, output_router_logits=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=16, num_local_experts=EXPERTS,
                                                 **common))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            intermediate_size=16, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=EXPERTS, norm_topk_prob=kind == "qwen2_moe_norm", **common))
    with torch.no_grad():  # a sharper router than the 0.02-std init: uneven expert loads
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(40.0)
    return model


def tokens(rank: int, batches: tuple[int, ...] = BATCHES) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batches[rank], SEQ),
                         generator=torch.Generator().manual_seed(100 + rank))


def run(model, leaves, ids, aux: bool = True):
    """``(logits, loss, aux_loss)``; the loss is HF's: cross-entropy + coef * aux loss
    (``aux=False``: cross-entropy alone, aux_loss None)."""
    out = model.apply(leaves, input_ids=ids, labels=ids, output_router_logits=aux)
    return out.logits, out.loss, out.aux_loss


def grads_of(model, leaves, ids, mode: str, aux: bool = True):
    trainable, rest = model.split_trainable(leaves)
    if mode == "grad":
        return torch.func.grad(lambda t: run(model, model.merge(t, rest), ids, aux)[1])(trainable)
    live = {k: v.detach().clone().requires_grad_() for k, v in trainable.items()}
    run(model, model.merge(live, rest), ids, aux)[1].backward()
    return {k: v.grad for k, v in live.items()}


def reference(kind: str, ranks: int, aux: bool = True, batches: tuple[int, ...] = BATCHES):
    """Per rank the one-process model's ``(logits, loss, aux)`` on that rank's tokens, and
    the gradient of the mean of the ranks' losses."""
    hf = hf_model(kind)
    fm = sf.functional(hf)
    full = fm.params_from(hf)
    outs = [run(fm, full, tokens(r, batches), aux) for r in range(ranks)]
    trainable, rest = fm.split_trainable(full)
    grads = torch.func.grad(lambda t: sum(
        run(fm, fm.merge(t, rest), tokens(r, batches), aux)[1] for r in range(ranks)) / ranks
    )(trainable)
    return outs, grads


def _on_rank(kind: str, mesh_shape: dict[str, int], dp_reduce: bool):
    """This rank's ``(outputs, {mode: gathered grads}, local expert shapes, a2a bytes)``."""
    import torch.distributed as dist

    mesh = sf.Mesh(mesh_shape)
    hf = hf_model(kind)
    fm = sf.functional(hf)
    model = expert_parallel(fm, mesh, "ep")
    leaves = model.params_from(hf)
    ids = tokens(dist.get_rank())
    sf.reset_comm_stats()
    outs = run(model, leaves, ids)
    sent = sf.comm_stats().by_op.get(("ep", "all_to_all_v"), 0)
    grads = {}
    for mode in ("grad", "autograd"):
        g = grads_of(model, leaves, ids, mode)
        if dp_reduce:
            g = sf.data_parallel(mesh, "dp").reduce_grads(g)
        grads[mode] = model.gather(g)
    shapes = {k: tuple(v.shape) for k, v in leaves.items() if k in model.experts}
    return outs, grads, shapes, sent


@pytest.mark.parametrize("kind,ep", [("mixtral", 2), ("qwen2_moe", 2), ("qwen2_moe_norm", 2),
                                     ("mixtral", 4)])
def test_hf_moe_under_expert_parallel_equals_one_process(worlds, kind, ep):
    """Rank-wise logits, loss and aux loss are the one-process HF model's on that rank's
    tokens; gathered gradients (torch.func.grad and autograd) are the one-process gradient
    of the mean loss; each rank holds E/ep experts and its tokens crossed the axis."""
    outs, ref_grads = reference(kind, ep)
    for rank, (got, grads, shapes, sent) in enumerate(worlds(ep).run(_on_rank, kind, {"ep": ep},
                                                                       False)):
        torch.testing.assert_close(got, outs[rank])
        torch.testing.assert_close(grads["grad"], ref_grads)
        torch.testing.assert_close(grads["autograd"], ref_grads)
        assert len(shapes) == 4 and all(s[0] == EXPERTS // ep for s in shapes.values())
        assert sent > 0


def test_dp_by_ep_mixtral(worlds):
    """{"dp": 2, "ep": 2}: experts split over ep, everything averaged over dp after the step
    (sf.data_parallel.reduce_grads): the gradient of the mean of the four ranks' losses."""
    _, ref_grads = reference("mixtral", 4)
    for _, grads, shapes, _ in worlds(4).run(_on_rank, "mixtral", {"dp": 2, "ep": 2}, True):
        torch.testing.assert_close(grads["grad"], ref_grads)
        torch.testing.assert_close(grads["autograd"], ref_grads)
        assert all(s[0] == EXPERTS // 2 for s in shapes.values())


def test_dp_by_ep_without_the_dp_reduction_is_caught(worlds):
    """The mutant (no reduction over dp) gives another gradient: the test above can fail."""
    _, ref_grads = reference("mixtral", 4)
    got = worlds(4).run(_on_rank, "mixtral", {"dp": 2, "ep": 2}, False)[0][1]["grad"]
    name = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(got[name], ref_grads[name])


# shard_params (check mode) wants equal batches over its axis "dp" (ranks 0/2, 1/3); the
# ep pairs (0/1, 2/3) still differ
FSDP_BATCHES = (1, 2, 1, 2)


def _ep_by_shard_params():
    """This rank's ``({mode: gathered grads}, local shard shapes)`` under ep x FSDP."""
    import torch.distributed as dist

    mesh = sf.Mesh({"dp": 2, "ep": 2})
    hf = hf_model("mixtral")
    model = sf.shard_params(expert_parallel(sf.functional(hf), mesh, "ep"), mesh, "dp")
    leaves = model.params_from(hf)
    ids = tokens(dist.get_rank(), FSDP_BATCHES)
    # without the aux loss: shard_params loses HF's router_logits (see the test's docstring)
    grads = {mode: model.gather(grads_of(model, leaves, ids, mode, aux=False))
             for mode in ("grad", "autograd")}
    return grads, {k: tuple(v.shape) for k, v in leaves.items()}, model.units


def test_mixtral_ep_by_fsdp(worlds):
    """The issue's acceptance: Mixtral from config on {"dp": 2, "ep": 2}, expert leaves
    split over ep, then (like every other leaf) sharded over dp (ZeRO-3) by shard_params,
    one unit per decoder layer: gathered gradients (torch.func.grad and autograd) are the
    one-process gradient of the mean of the four ranks' losses; a rank stores E/4 experts.
    The loss leaves the aux loss out: under shard_params HF's output_router_logits comes
    back empty (also without ep), a separate problem."""
    _, ref_grads = reference("mixtral", 4, aux=False, batches=FSDP_BATCHES)
    full = sf.functional(hf_model("mixtral")).param_shapes()
    for grads, shapes, units in worlds(4).run(_ep_by_shard_params):
        torch.testing.assert_close(grads["grad"], ref_grads)
        torch.testing.assert_close(grads["autograd"], ref_grads)
        assert units == ("model.layers.0", "model.layers.1")
        expert = "model.layers.1.mlp.experts.down_proj"
        assert shapes[expert][0] == EXPERTS // 4 and shapes[expert][1:] == full[expert].shape[1:]
        assert shapes["lm_head.weight"][0] == VOCAB // 2


def test_one_process_split_equals_hf():
    """ep=1 in this process: the experts are replaced (HF's router kept) and every output
    and gradient is HF's own; the aux loss of one batch is not the mean of two halves'."""
    hf = hf_model("qwen2_moe")
    fm = sf.functional(hf)
    model = expert_parallel(fm, sf.Mesh({"ep": 1}), "ep")
    experts = [m for m in model.module.modules() if isinstance(m, HFExpertsOverAxis)]
    routers = [type(m).__name__ for m in model.module.modules() if type(m).__name__.endswith(
        "TopKRouter")]
    assert len(experts) == 2 and routers == ["Qwen2MoeTopKRouter"] * 2
    full = fm.params_from(hf)
    ids = torch.cat([tokens(1), tokens(3)])
    torch.testing.assert_close(run(model, full, ids), run(fm, full, ids))
    torch.testing.assert_close(grads_of(model, full, ids, "grad"), grads_of(fm, full, ids, "grad"))
    halves = (run(fm, full, ids[:2])[2] + run(fm, full, ids[2:])[2]) / 2
    assert not torch.allclose(halves, run(fm, full, ids)[2])


def test_errors_name_the_experts():
    module = sf.functional(hf_model("mixtral")).module
    skeleton = copy.deepcopy(module)
    skeleton.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts' .*has_bias"):
        split_hf_experts(skeleton, sf.Mesh({"ep": 1}), "ep")
