"""Issue #23: the composition matrix. Hypothesis draws an order of model transforms
(``with_precision``, ``remat``, ``tensor_split``, ``shard_params``; each at most once, any
subset, any order) and a mesh of 1-4 ranks; every order that means something builds a
model that passes the conformance suite against the unsharded reference, and every
order that does not is refused when the model is built (never at ``apply``) with a
message naming the valid order. :func:`_valid` is the table of docs/composing.md in
code; the test fails if a transform accepts an order the table refuses, or the other
way round.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardfn as sf

F64 = sf.Precision(torch.float64, output_dtype=torch.float32, cast_inputs=True)
POLICY = sf.checkpoint_policies.dots_saveable
PLAN = {"0": "colwise", "2": "rowwise"}
TRANSFORMS = ("precision", "remat", "split", "shard")


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.BatchNorm1d(5),
                        nn.Linear(5, 3))
    net[4].bias.requires_grad_(False)
    return net


def _valid(order: tuple[str, ...]) -> bool:
    """Whether applying ``order`` (innermost first) means something: a split plan cuts
    full leaves, so ``tensor_split`` must come before ``shard_params``."""
    return not ("split" in order and "shard" in order
                and order.index("split") > order.index("shard"))


def _apply(name: str, model, mesh):
    if name == "precision":
        return sf.with_precision(model, F64)
    if name == "remat":
        return sf.remat(model, POLICY)
    if name == "split":
        return sf.tensor_split(model, mesh, "tp", PLAN)
    return sf.shard_params(model, mesh, "dp")


def _on_rank(order: tuple[str, ...], shape: dict[str, int]):
    fm = sf.functional(_net())
    mesh = sf.Mesh(shape)
    model = fm
    try:
        for name in order:
            model = _apply(name, model, mesh)
    except (TypeError, ValueError) as error:
        return "refused", str(error)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
    reference = sf.with_precision(fm, F64) if "precision" in order else fm
    report = sf.testing.check_model(model, (x,), seed=2, reference=reference,
                                    loss_fn=lambda out, t: (out - t).square().mean(),
                                    targets=y, rtol=1e-5, atol=1e-6)
    return "built", type(model).__name__, report.checked


ORDERS = st.lists(st.sampled_from(TRANSFORMS), unique=True, min_size=1, max_size=4)


@settings(max_examples=12, deadline=None)
@given(order=ORDERS, dp=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2]))
def test_every_order_builds_the_reference_or_is_refused(worlds, order, dp, tp):
    order = tuple(order)
    shape = {"dp": dp, "tp": tp}
    results = worlds(dp * tp).run(_on_rank, order, shape)
    if not _valid(order):
        for result in results:
            assert result[0] == "refused", (order, result)
            assert "shard_params(tensor_split(" in result[1] or "order" in result[1], result
        return
    for result in results:
        assert result[0] == "built", (order, result)
        assert "grads" in result[2]


@pytest.mark.parametrize("order", [("shard", "split"), ("shard", "shard"),
                                   ("split", "split")])
def test_meaningless_orders_are_refused_when_built(order):
    fm = sf.functional(_net())
    mesh = sf.Mesh({"dp": 1, "tp": 1})
    model = _apply(order[0], fm, mesh)
    with pytest.raises((TypeError, ValueError)) as error:
        _apply(order[1], model, mesh)
    assert "shard_params" in str(error.value) or "tensor_split" in str(error.value)


def test_a_pipeline_is_not_wrapped_but_its_stage_models_are():
    """shard_params / tensor_split / remat / with_precision over a PipelineModel are
    refused when built, naming the valid order (transform each stage model)."""
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    pp = sf.pipeline_stages(net, sf.Mesh({"pp": 1}), "pp", balance=[3], microbatches=1,
                            loss_fn=lambda out, y: (out - y).square().mean())
    mesh = sf.Mesh({"dp": 1, "tp": 1})
    for wrap in (lambda m: sf.shard_params(m, mesh, "dp"),
                 lambda m: sf.tensor_split(m, mesh, "tp", PLAN),
                 lambda m: sf.remat(m, POLICY)):
        with pytest.raises(TypeError, match=r"each stage model.*pipeline_split"):
            wrap(pp)
    with pytest.raises((TypeError, ValueError), match="stage"):
        sf.with_precision(pp, F64)
