"""Stage-boundary shapes inferred once per batch signature (the default), or dynamic.

The first step for a batch signature exchanges a shape header before each
payload (``report.header_first`` counts those messages); later steps with that
signature declare the shapes the first one found, so no payload waits for its
header (the count is 0), with the same numbers. A new batch shape infers again.
A stage whose output shape changes after the first step raises on every rank
(naming the stage and ``shapes='dynamic'``), and ``shapes="dynamic"`` runs it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.pipeline import pipeline_stages
from shardfn.transforms.pipeline._p2p import Declared
from shardfn.transforms.pipeline.shapes import parse_shapes
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, reference


def _steps(p: int, schedule: str, shapes, batches: list[int], m: int = 3):
    pp = pipeline_stages(mlp_units(2 * p + 1), sf.Mesh({"pp": p}), balance=[2] * (p - 1) + [3],
                         schedule=schedule, microbatches=m, loss_fn=mse, shapes=shapes)
    params = pp.init(0)
    found = []
    for rows in batches:
        loss, grads, report = pp.value_and_grad(params, *batch(rows), report=True)
        found.append((loss, grads, report.header_first))
    out = pp.apply(params, batch(batches[0])[0])
    return found, out, len(pp.shape_cache)


@pytest.mark.parametrize("p, schedule", [(2, "1f1b"), (4, "gpipe"), (2, "zb-h1")])
def test_inferred_shapes_drop_the_headers_and_keep_the_numbers(worlds, p, schedule):
    batches = [6, 6, 7, 6, 7]  # 7 rows: uneven micro-batches (3, 2, 2), its own signature
    inferred = worlds(p).run(_steps, p, schedule, None, batches)
    dynamic = worlds(p).run(_steps, p, schedule, "dynamic", batches)
    for rank in range(p):
        (steps, out, cached), (dyn_steps, dyn_out, dyn_cached) = inferred[rank], dynamic[rank]
        counts = [count for _, _, count in steps]
        assert counts[0] > 0 and counts[2] > 0, counts  # each new signature: headers first
        assert counts[1] == counts[3] == counts[4] == 0, counts  # then none waits for one
        # dynamic: every step's messages wait for their headers, as the first step's did
        assert [c for _, _, c in dyn_steps] == [counts[0]] * len(batches)
        assert cached == 3 and dyn_cached == 0  # two step signatures and one apply
        for rows, (loss, grads, _), (dyn_loss, dyn_grads, _) in zip(
                batches, steps, dyn_steps, strict=True):
            _, ref_loss, ref_grads, _ = reference(mlp_units(2 * p + 1), 0, *batch(rows))
            assert_close(loss, ref_loss)
            assert_close(dyn_loss, ref_loss)
            for name, grad in grads.items():
                assert_close(grad, ref_grads[name])
                assert_close(dyn_grads[name], ref_grads[name])
        ref_out = reference(mlp_units(2 * p + 1), 0, *batch(batches[0]))[3]
        assert_close(out, ref_out)
        assert_close(dyn_out, ref_out)


class _Widening(nn.Module):
    """From its ``after``-th call on, adds a zero column (the next unit drops it)."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.calls = after, 0

    def forward(self, x):
        self.calls += 1
        return torch.cat([x, torch.zeros_like(x[:, :1])], dim=1) if self.calls > self.after \
            else x


class _Narrow(nn.Module):
    def forward(self, x):
        return x[:, :8]


def _changing(shapes):
    """Two steps; stage 0's output widens from the second step's first micro-batch on."""
    units = [nn.Linear(4, 8), _Widening(after=3), _Narrow(), nn.Linear(8, 3)]
    pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=[2, 2], schedule="1f1b",
                         microbatches=3, loss_fn=mse, shapes=shapes)
    params, results = pp.init(0), []
    for _ in range(2):
        try:
            results.append(pp.value_and_grad(params, *batch(6))[0])
        except Exception as error:  # noqa: BLE001 - the test looks at every rank's error
            results.append((type(error).__name__, str(error)))
    return results


def test_a_shape_that_changes_after_inference_raises_and_dynamic_runs_it(worlds):
    expected = reference([nn.Linear(4, 8), nn.Identity(), nn.Identity(), nn.Linear(8, 3)], 0,
                         *batch(6))[1]
    (first_ok, first_err), (second_ok, second_err) = worlds(2).run(_changing, None)
    assert_close(first_ok, expected)
    assert_close(second_ok, expected)
    assert first_err[0] == "ValueError", first_err
    assert "pipeline stage 0 output for micro-batch 0 has shape (2, 9) torch.float32, but " \
           "the first step with this batch signature inferred (2, 8) torch.float32 (on pp " \
           "rank 0)" in first_err[1]
    assert "shapes='dynamic'" in first_err[1]
    assert second_err[0] == "PeerFailed" and "shapes='dynamic'" in second_err[1]
    for losses in worlds(2).run(_changing, "dynamic"):
        assert len(losses) == 2
        for loss in losses:
            assert_close(loss, expected)


def test_parse_shapes():
    f32, i64 = torch.float32, torch.int64
    assert parse_shapes(None, 2) is None and parse_shapes("dynamic", 2) is None
    assert parse_shapes((2, 8), 2) == (Declared((2, 8), f32),) * 2
    assert parse_shapes(((2, 8), i64), 1) == (Declared((2, 8), i64),)
    assert parse_shapes([(2, 8), ((2, 8), (2,), None)], 2) == (
        Declared((2, 8), f32), (Declared((2, 8), f32), Declared((2,), f32), None))
    assert parse_shapes([(sf.ShapeDtype(torch.Size([2]), i64), ((2, 8), f32))], 1) == (
        (Declared((2,), i64), Declared((2, 8), f32)),)
    with pytest.raises(ValueError, match="shapes='static'"):
        parse_shapes("static", 1)
    with pytest.raises(TypeError, match=r"entry 1 \(output of stage 1\) is \(2, 'x'\)"):
        parse_shapes([(2, 8), (2, "x")], 2)
    with pytest.raises(ValueError, match="shapes= has 1 entries, but the pipeline has 2"):
        parse_shapes([((2, 8), (2, 8))], 2)


def _with_and_without_autocast():
    pp = pipeline_stages(mlp_units(5), sf.Mesh({"pp": 2}), balance=[3, 2], schedule="1f1b",
                         microbatches=2, loss_fn=mse)
    params, x = pp.init(0), batch(4)[0]
    plain = pp.apply(params, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 activations: its own signature
        low = pp.apply(params, x)
    return plain.dtype, low.dtype, len(pp.shape_cache)


def test_autocast_is_part_of_the_signature(worlds):
    for plain, low, cached in worlds(2).run(_with_and_without_autocast):
        assert (plain, low, cached) == (torch.float32, torch.bfloat16, 2)
