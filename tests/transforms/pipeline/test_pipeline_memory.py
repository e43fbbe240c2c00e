"""Activation memory per stage, measured with sf.memory: 1F1B keeps at most p micro-batches'
activations per stage, GPipe all m.

Each stage's forward allocates under the category ``pipeline.stage{s}``; its
peak is ``T + k * K``: ``K`` the bytes one micro-batch's kept graph holds, ``T``
the forward's transient bytes, ``k`` the graphs kept at once. ``K`` and ``T`` are
measured from GPipe with 1 and 2 micro-batches; then for m = 4 the peak of each
stage must be exactly that formula with the runtime's own count of kept graphs
(``report.peak_live``), and that count is GPipe's ``m``, 1F1B's ``p - r`` (at most
``p``), and, per rank, the schedule simulator's ``peak_held``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardfn as sf
import shardfn.memory as mem
from shardfn.transforms.pipeline import make_schedule, pipeline_stages
from shardfn.transforms.pipeline.simulate import simulate
from tests.transforms.pipeline._pipeline_models import schedule_status, virtual_for

ROWS = 8  # per micro-batch
D = 32
SLACK = 256  # bytes: message headers and the scalar loss


def _units(n_stages: int) -> list[nn.Module]:
    return [u for s in range(n_stages)
            for u in (nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh())]


def _measure(p: int, schedule: str, m: int, v: int):
    pp = pipeline_stages(_units(p * v), sf.Mesh({"pp": p}), balance=[4] * (p * v),
                         schedule=schedule, microbatches=m, virtual=v,
                         loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean())
    params = pp.init(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS * m, D, generator=gen), torch.randn(ROWS * m, D, generator=gen)
    with mem.track() as tracker:
        _, _, report = pp.value_and_grad(params, x, y, report=True)
    peaks = {s: tracker.max_by_category[f"pipeline.stage{s}"] for s in report.peak_live}
    return pp.rank, peaks, report.peak_live, report.peak_held


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_kept_activations_per_stage(worlds, schedule):
    p, m, v = 2, 4, virtual_for(schedule)
    if schedule_status(schedule, p, m, v) == "missing":
        pytest.skip(f"make_schedule has no {schedule!r} yet")
    one = {r: peaks for r, peaks, _, _ in worlds(p).run(_measure, p, "gpipe", 1, v)}
    two = {r: peaks for r, peaks, _, _ in worlds(p).run(_measure, p, "gpipe", 2, v)}
    simulated = simulate(make_schedule(schedule, p, m, v)).peak_held
    for rank, peaks, live, held in worlds(p).run(_measure, p, schedule, m, v):
        assert held == simulated[rank]
        for stage, peak in peaks.items():
            kept = two[rank][stage] - one[rank][stage]  # one micro-batch's graph
            transient = one[rank][stage] - kept
            assert kept >= 2 * ROWS * D * 4, (stage, kept)  # two Tanh outputs at least
            assert abs(peak - (transient + live[stage] * kept)) <= SLACK, \
                (schedule, stage, peak, transient, kept, live[stage])
            if schedule == "gpipe":
                assert live[stage] == m
            if schedule in ("1f1b", "zb-h1"):
                assert live[stage] <= p
            if schedule == "1f1b":
                assert live[stage] == min(m, p - rank)
    if schedule == "1f1b":  # and so its first stage holds less than GPipe's
        gpipe = {r: peaks for r, peaks, _, _ in worlds(p).run(_measure, p, "gpipe", m, v)}
        ours = {r: peaks for r, peaks, _, _ in worlds(p).run(_measure, p, schedule, m, v)}
        assert ours[0][0] < gpipe[0][0] - (m - p - 1) * 2 * ROWS * D * 4
