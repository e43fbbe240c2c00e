"""Expert parallelism under ``pipeline_stages`` (PP x EP) on ``{"pp": 2, "ep": 2}``.

Each ep index is a pipeline replica with its own batch (uneven rows); each stage holding
MoE layers is ``expert_parallel`` over ``"ep"`` (``stage_transform=expert_stage``), its
tokens exchanged with the same stage of the other replica; ``dp_axis="ep"`` averages the
loss and the plain stages' gradients. The MoE aux loss travels with the activations as the
second entry of a ``(hidden, aux)`` tuple and ``loss_fn`` adds it.

* hypothesis over the schedule (GPipe, 1F1B, ZB-H1), the balance (a plain first or last
  stage, or MoE on both with the aux crossing the boundary), top-k, capacity, aux, uneven
  rows per replica and micro-batch counts: the loss on every rank and the gathered
  gradients equal one process applying the unsplit model to each replica's micro-batches
  (the mean of the replicas' losses); dropless without aux that is the global batch's loss.
* The model protocol's conformance suite (``check_model``, ``apply`` included) passes.
* A missing reduction is caught: ``dp_axis`` other than ``"ep"`` is refused naming the
  stage; a pipeline that skipped the replicas' mean, or averaged the expert stage again
  (different replicas hold different experts), differs from the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.models.moe import MoE
from shardfn.transforms._pp_ep import expert_stage

D, D_IN, D_OUT, SEED = 6, 4, 3, 5


class _MoEBlock(nn.Module):
    """A residual MoE MLP over ``(hidden, aux)``: adds its call's aux loss to the sum."""

    def __init__(self, **moe):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = MoE(D, 8, num_experts=4, z_loss_coef=0.01 * moe.pop("z", 0.0), **moe)

    def forward(self, x):
        h, aux = x if isinstance(x, tuple) else (x, x.new_zeros(()))
        y, losses = self.moe(self.norm(h))
        return h + y, aux + losses.loss


class _Head(nn.Module):
    """The output layer; the aux sum comes out per row (``pp.apply`` concatenates rows)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x):
        h, aux = x
        return self.out(h), aux.expand(h.shape[0])


def _units(config: dict) -> list[nn.Module]:
    moe = {"top_k": config["top_k"], "capacity_factor": config["capacity"],
           "aux_loss": config["aux"], "z": 1.0 if config["aux"] != "none" else 0.0}
    blocks = [_MoEBlock(**dict(moe)) for _ in range(2)]
    return [nn.Linear(D_IN, D), *blocks, _Head()]


def _loss_fn(out, y):
    logits, aux = out
    return (logits - y).square().mean() + aux.mean()


def _batch(rows: int, replica: int):
    g = torch.Generator().manual_seed(100 + replica)
    return torch.randn(rows, D_IN, generator=g), torch.randn(rows, D_OUT, generator=g)


GPIPE = {"schedule": "gpipe", "balance": [1, 3], "top_k": 2, "capacity": 1.25,
         "aux": "switch", "rows": (7, 5), "microbatches": 3}
ONE_F_ONE_B = {"schedule": "1f1b", "balance": [2, 2], "top_k": 1, "capacity": None,
               "aux": "switch", "rows": (4, 6), "microbatches": 2}
ZB_H1 = {"schedule": "zb-h1", "balance": [2, 2], "top_k": 2, "capacity": 1.0,
         "aux": "switch", "rows": (5, 3), "microbatches": 3}
DROPLESS = {"schedule": "1f1b", "balance": [3, 1], "top_k": 2, "capacity": None,
            "aux": "none", "rows": (6, 6), "microbatches": 2}


@st.composite
def configs(draw) -> dict:
    """A schedule, a balance of the 4 units (input, two MoE blocks, head), routing, aux,
    each replica's rows (uneven) and the micro-batch count."""
    m = draw(st.integers(1, 3))
    return {"schedule": draw(st.sampled_from(["gpipe", "1f1b", "zb-h1"])),
            "balance": draw(st.sampled_from([[1, 3], [2, 2], [3, 1]])),
            "top_k": draw(st.integers(1, 2)),
            "capacity": draw(st.sampled_from([None, 1.0, 1.25])),
            "aux": draw(st.sampled_from(["switch", "none"])),
            "rows": (draw(st.integers(m, 7)), draw(st.integers(m, 7))), "microbatches": m}


def _reference(config: dict):
    """The unsplit model applied to each replica's micro-batches: the mean over replicas of
    each replica's loss (micro-batch losses weighted by rows), and its gradients."""
    fm = sf.functional(nn.Sequential(*_units(config)))
    trainable, rest = fm.split_trainable(fm.init(SEED))
    m = config["microbatches"]

    def loss(t):
        total = 0.0
        for replica, rows in enumerate(config["rows"]):
            x, y = _batch(rows, replica)
            for xi, yi in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
                total = total + _loss_fn(fm.apply({**rest, **t}, xi), yi) * xi.shape[0] / rows
        return total / len(config["rows"])

    grads, value = torch.func.grad_and_value(loss)(trainable)
    return fm, trainable, value, grads


def _pipeline(config: dict, dp_axis: str | None = "ep"):
    mesh = sf.Mesh({"pp": 2, "ep": 2})
    return sf.pipeline_stages(_units(config), mesh, "pp", balance=config["balance"],
                              schedule=config["schedule"], microbatches=config["microbatches"],
                              loss_fn=_loss_fn, dp_axis=dp_axis, stage_transform=expert_stage)


def _on_rank(config: dict, mutants: bool):
    """This rank's loss, gathered gradients and local expert shapes; with ``mutants`` also
    the (loss, gathered gradients) of the pipeline without the replicas' mean and of the one
    that averages the expert stages again."""
    pp = _pipeline(config)
    replica = pp.mesh.index("ep")
    x, y = _batch(config["rows"][replica], replica)
    params = pp.init(SEED)
    loss, grads = pp.value_and_grad(params, x, y)
    shapes = {n: tuple(t.shape) for n, t in params.items() if "experts" in n}
    found = {"loss": loss, "grads": pp.gather(grads), "shapes": shapes}
    if mutants:
        for name, mutant in (("no_mean", dataclasses.replace(pp, dp_axis=None)),
                             ("mean_twice", dataclasses.replace(pp, reduced_axes={}))):
            got, wrong = mutant.value_and_grad(params, x, y)
            found[name] = (got, pp.gather(wrong))
    return found


@settings(max_examples=4, deadline=None)
@given(configs())
@example(GPIPE)
@example(ONE_F_ONE_B)
@example(ZB_H1)
@example(DROPLESS)
def test_pp_by_ep_equals_one_process(worlds, config):
    """Loss on every rank, gathered gradients, experts per rank; dropless without aux the
    reference is the global batch's loss."""
    fm, _, loss, grads = _reference(config)
    results = worlds(4).run(_on_rank, config, False)
    for found in results:
        assert_close(found["loss"], loss)
        assert_close(found["grads"], grads)
        assert all(s[0] == 2 for s in found["shapes"].values())  # 4 experts over ep=2
    first = config["balance"][0]  # units 1, 2 are the MoE blocks; ranks 0, 1 hold stage 0
    assert bool(results[0]["shapes"]) == (first > 1) and bool(results[3]["shapes"]) == (first < 3)
    if config["aux"] == "none" and config["capacity"] is None and \
            len(set(config["rows"])) == 1:  # dropless, no aux: the global batch's loss
        x, y = (torch.cat(t) for t in zip(*(_batch(r, i) for i, r in
                                             enumerate(config["rows"])), strict=True))
        assert_close(_loss_fn(fm.apply(fm.init(SEED), x), y), loss)


def test_a_missing_or_doubled_reduction_is_caught(worlds):
    """GPipe: the pipeline without the replicas' mean (each replica's own loss and plain
    gradients) and the one averaging the expert stage again (experts of different replicas
    mixed) differ from the reference the test above compares with."""
    _, _, loss, grads = _reference(GPIPE)
    experts = [n for n in grads if "experts" in n]
    for found in worlds(4).run(_on_rank, GPIPE, True):
        assert_close(found["loss"], loss)
        no_mean, twice = found["no_mean"], found["mean_twice"]
        assert not torch.allclose(no_mean[0], loss)
        assert not torch.allclose(no_mean[1]["0.weight"], grads["0.weight"])
        assert_close(twice[0], loss)
        assert any(not torch.allclose(twice[1][n], grads[n]) for n in experts)


def test_expert_stage_without_its_dp_axis_is_refused():
    """One process ({"pp": 1, "ep": 1}): an expert stage with dp_axis None is refused, naming
    the stage and the axis; a stage without MoE layers stays plain."""
    mesh = sf.Mesh({"pp": 1, "ep": 1})
    units = _units(GPIPE)
    with pytest.raises(ValueError, match=r"stage 1 is expert_parallel over 'ep'.*dp_axis='ep'"):
        sf.pipeline_stages(units, mesh, "pp", balance=[1, 3], virtual=2, schedule="gpipe",
                           microbatches=2, loss_fn=_loss_fn, stage_transform=expert_stage)
    pp = sf.pipeline_stages(units, mesh, "pp", balance=[1, 3], virtual=2, schedule="gpipe",
                            microbatches=2, loss_fn=_loss_fn, dp_axis="ep",
                            stage_transform=expert_stage)
    assert 0 not in pp.stage_models and pp.reduced_axes[1] == ("ep",)
    fsdp_ep = [expert_stage(s, mesh.submesh(["ep"])) for s in sf.pipeline_split(units, [1, 3])]
    fsdp_ep[1] = sf.shard_params(fsdp_ep[1], mesh.submesh(["ep"]), "ep")
    with pytest.raises(ValueError, match="stage 1 is shard_params over an expert_parallel"):
        sf.pipeline_stages(fsdp_ep, mesh, "pp", virtual=2, schedule="gpipe", microbatches=2,
                           loss_fn=_loss_fn, dp_axis="ep")


def _conforms():
    """The model protocol's conformance suite on the PP x EP pipeline (every rank the same
    batch, one micro-batch: the reference is the unsplit model on it)."""
    from shardfn.testing.conformance import check_model

    pp = _pipeline({**ONE_F_ONE_B, "microbatches": 1})
    x, y = _batch(4, 0)
    return check_model(pp, (x,), loss_fn=_loss_fn, targets=y, mutable=False).checked


def test_pp_by_ep_conforms(worlds):
    for checked in worlds(4).run(_conforms):
        assert {"members", "init", "gather", "grads"} <= set(checked)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=8,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


def _ids(replica: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(replica))


def _mixtral_on_rank():
    hf = _mixtral()
    pp = sf.pipeline_stages(hf, sf.Mesh({"pp": 2, "ep": 2}), "pp", balance=[2, 2],
                            schedule="1f1b", microbatches=2, dp_axis="ep",
                            stage_transform=expert_stage)
    ids = _ids(pp.mesh.index("ep"))
    loss, grads = pp.value_and_grad(pp.params_from(hf), {"input_ids": ids, "labels": ids})
    return loss, pp.gather(grads)


def test_mixtral_pp_by_ep(worlds):
    """Hugging Face's Mixtral pipelined on {"pp": 2, "ep": 2}, its experts split over "ep"
    in both stages: the loss and the gathered gradients (HF's names) equal HF's own model
    on one process, the mean of the two replicas' losses (HF's token mean, no padding)."""
    hf = _mixtral()
    loss = sum(hf(input_ids=_ids(r), labels=_ids(r)).loss for r in range(2)) / 2
    loss.backward()
    params = dict(hf.named_parameters())
    for got_loss, got_grads in worlds(4).run(_mixtral_on_rank):
        assert_close(got_loss, loss.detach())
        assert set(got_grads) == set(params) and any("experts" in n for n in got_grads)
        for name, grad in got_grads.items():
            assert_close(grad, params[name].grad, msg=name)
