"""examples/demo.py, plan by plan: every plan trains like one process and resumes exactly.

The demo's own checks (``demo.check`` with ``demo.CHECKS[plan]``), run on the session's
4-rank world for a few steps: the losses and the final full parameters equal the
one-process run on the whole batch, and the run resumed from the mid-run checkpoint ends
bit-identical to the uninterrupted one. (The demo script itself, end to end, runs under
torchrun in test_distributed_launch.py.)

Every plan at the demo's default 300 steps took 30 minutes on a loaded 2-core machine
(1-6 minutes per plan on 4 ranks, plus the one-process runs), too slow for the suite:
``SHARDFN_DEMO_DEFAULTS=1`` runs it (``test_every_plan_passes_its_check_at_the_default_
steps``). The suite checks instead that the check refuses what it must, and that the drift
each plan showed at the defaults (``DEFAULT_DRIFT``, measured that way) fits its tolerance.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import shardfn as sf

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo.py"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID")

#: measured at the defaults (300 steps, batch 16 x 64, 4 ranks; SHARDFN_DEMO_DEFAULTS=1):
#: plan -> (largest relative loss difference over the steps and ranks, the final
#: parameters' largest |difference| / (atol + rtol |one process|) under CHECKS[plan],
#: element by element: by the triangle inequality that bounds the leaf-norm ratio
#: demo.check applies)
#: (measured 2026-12-02 at the peak learning rate 3e-3; seconds: the 4-rank run with its
#: resumed half, on 2 cores at load 15-30; the two one-process runs took 91 and 38 s)
#: (measured on the demo's earlier batches, random windows of the text drawn per step;
#: since #25 it reads whole windows of its token file through sf.data.loader, and these
#: have not been measured again at the defaults: SHARDFN_DEMO_DEFAULTS=1 does that)
DEFAULT_DRIFT: dict[str, tuple[float, float]] = {
    "dp": (2.28e-07, 0.06),  # 227 s
    "zero1": (2.28e-07, 0.06),  # 61 s
    "zero2": (2.28e-07, 0.06),  # 77 s
    "fsdp": (2.13e-07, 0.05),  # 110 s
    "hsdp": (2.06e-07, 0.03),  # 72 s
    "tp": (2.28e-07, 0.04),  # 232 s
    "tp+sp": (2.28e-07, 0.04),  # 337 s
    "fsdp+tp": (2.12e-07, 0.03),  # 160 s
    "pp": (2.16e-07, 0.07),  # 276 s (at the old peak rate 1e-2: 9.6e-4, and failing)
    "pp+fsdp": (2.20e-07, 0.04),  # 119 s
}


def _demo():
    spec = importlib.util.spec_from_file_location("shardfn_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(plan: str, steps: int, run_dir: str, sharded: bool = True):
    return _demo().train(plan, steps, 8, 16, run_dir, sharded)


@pytest.mark.parametrize("plan", _demo().PLANS)
def test_plan_matches_one_process_and_resumes_exactly(worlds, tmp_path, plan):
    results = worlds(4).run(_train, plan, 4, str(tmp_path))   # writes tmp_path/text.uint16
    reference = _train(plan, 4, str(tmp_path), sharded=False)  # reads it: the same batches
    for rank, result in enumerate(results):
        assert result["resumed"] is True, f"rank {rank}: the resumed run differs"
    _demo().check(plan, results, reference)
    assert reference["losses"][-1] < reference["losses"][0]  # it trains


def test_every_plan_has_a_tolerance_and_its_reason():
    demo = _demo()
    assert set(demo.CHECKS) == set(demo.PLANS)
    for plan, tol in demo.CHECKS.items():
        assert tol.changes and 0 < tol.loss_rtol <= 1e-4, plan  # float32 round-off, no more
        assert 0 < tol.param_rtol <= 1e-3 and 0 < tol.param_atol <= 1e-5, plan


def _fake_run(seed: int = 0, steps: int = 6):
    gen = torch.Generator().manual_seed(seed)
    full = {"w": torch.randn(4, 3, generator=gen), "b": torch.zeros(3)}
    return {"losses": [3.0 - 0.1 * k for k in range(steps)], "full": full}


@pytest.mark.parametrize("plan", _demo().PLANS)
def test_check_passes_within_and_refuses_beyond_each_tolerance(plan):
    demo = _demo()
    tol = demo.CHECKS[plan]
    reference = _fake_run()
    near = copy.deepcopy(reference)
    near["losses"][3] *= 1 + 0.9 * tol.loss_rtol
    near["full"]["w"] = near["full"]["w"] * (1 + 0.9 * tol.param_rtol)
    near["full"]["b"] = near["full"]["b"] + 0.9 * tol.param_atol
    assert "largest loss difference" in demo.check(plan, [reference, near], reference)

    far = copy.deepcopy(reference)
    far["losses"][3] *= 1 + 1.5 * tol.loss_rtol
    with pytest.raises(AssertionError, match="rank 1: the loss at step 3 .* allowed"):
        demo.check(plan, [reference, far], reference)
    far = copy.deepcopy(reference)
    far["full"]["b"] = far["full"]["b"] + 1.5 * tol.param_atol
    with pytest.raises(AssertionError, match="rank 0, b: up to .* norm .* times the tolerance"):
        demo.check(plan, [far], reference)


def test_the_measured_default_drift_fits_each_tolerance():
    demo = _demo()
    assert set(DEFAULT_DRIFT) == set(demo.PLANS)
    for plan, (loss_drift, param_ratio) in DEFAULT_DRIFT.items():
        assert loss_drift <= demo.CHECKS[plan].loss_rtol, plan
        assert param_ratio <= 1, plan


@pytest.mark.skipif(os.environ.get("SHARDFN_DEMO_DEFAULTS") != "1",
                    reason="every plan at the default 300 steps takes ~30 min on 2 cores; "
                           "SHARDFN_DEMO_DEFAULTS=1 runs it")
@pytest.mark.parametrize("plan", _demo().PLANS)
def test_every_plan_passes_its_check_at_the_default_steps(worlds, tmp_path, plan):
    demo = _demo()
    args = demo.parse_args([])
    results = worlds(4).run(demo.train, plan, args.steps, args.batch, args.seq,
                            str(tmp_path / "ckpt"))
    reference = demo.train(plan, args.steps, args.batch, args.seq, None, sharded=False)
    assert all(r["resumed"] for r in results)
    print(plan, demo.check(plan, results, reference))


def test_demo_text_is_a_token_file_read_by_the_mesh_loader(tmp_path):
    demo = _demo()
    ids = demo.load_text(2000)
    assert ids.numel() == 2000 and int(ids.max()) < len(demo.VOCAB) == 96
    assert demo.decode(ids[:50]) == demo.decode(ids)[:50]
    path = demo.text_tokens(str(tmp_path))
    tokens = torch.from_numpy(np.fromfile(path, dtype="<u2").astype("int64"))
    assert torch.equal(tokens, demo.load_text())                 # written once, uint16
    os.utime(path, (0, 0))
    assert demo.text_tokens(str(tmp_path)) == path and os.stat(path).st_mtime == 0  # reused
    mesh = sf.Mesh({"dp": 1})
    plan = demo.Plan(mesh, "dp", None, None, None, None)
    x, y = next(iter(demo.loader(plan, path, 4, 16)))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    windows = tokens[:len(sf.data.TokenFile(path, 16)) * 16].view(-1, 16)
    found = (windows[None] == x[:, None]).all(-1)               # each row: a window of it
    assert found.any(1).all()
    starts = 16 * found.int().argmax(1)
    assert torch.equal(y, torch.stack([tokens[s + 1:s + 17] for s in starts.tolist()]))
    assert not torch.equal(starts, torch.arange(4) * 16)        # shuffled


def test_demo_into_a_pipe_without_the_reference(tmp_path):
    """The script as a user runs it with its output to a file (`make demo > log`): progress
    as plain lines (no ``\\r``, no line over 500 characters), the rank-0 lines once, each
    rank's line tagged with its mesh coordinates, and ``--no-reference`` saying what it
    skipped."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(DEMO), "--ranks", "2", "--steps", "4",
                             "--batch", "4", "--seq", "16", "--no-reference", "--ckpt",
                             str(tmp_path / "run")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "\r" not in out and max(map(len, out.splitlines())) <= 500, out
    assert [line.split("  ")[0] for line in out.splitlines() if "step_ms" in line] == \
        [f"fsdp on 2 ranks: step {k}/4 ({k / 4:.0%})" for k in (1, 2, 3, 4)]
    for rank in (0, 1):
        assert out.count(f"[dp={rank}] checkpoint shards ") == 1, out
    assert out.count("starting a local world of 2") == 1
    assert "training the same steps on one process" not in out
    assert "  1 process skipped (--no-reference)" in out
    assert "sharded training (fsdp) matches one-process training: skipped (--no-reference; " \
           "loss " in out
    assert "the second half gives the same parameters bit for bit: OK" in out
    assert out.splitlines()[-1].startswith("final: plan fsdp  world 2  loss ")


def test_no_progress_and_no_reference_flags(tmp_path, capsys):
    demo = _demo()
    args = demo.parse_args(["--no-progress", "--no-reference"])
    assert (args.progress, args.reference) == (False, False)
    args = demo.parse_args([])
    assert (args.progress, args.reference) == (True, True)
    demo.train("fsdp", 2, 4, 16, str(tmp_path), sharded=False, show=True)
    shown = capsys.readouterr().out           # captured: not a terminal, so lines
    assert shown.count("fsdp on 1 rank: step ") == 2 and "\r" not in shown, shown
    demo.train("fsdp", 2, 4, 16, str(tmp_path), sharded=False, show=False)  # --no-progress
    assert capsys.readouterr().out == ""
