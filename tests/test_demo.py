"""examples/demo.py, plan by plan: every plan trains like one process and resumes exactly.

The demo's own checks, run on the session's 4-rank world for a few steps: the losses
and the final full parameters equal the one-process run on the whole batch, and the
run resumed from the mid-run checkpoint ends bit-identical to the uninterrupted one.
(The demo script itself, end to end, runs under torchrun in test_distributed_launch.py.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def _demo():
    spec = importlib.util.spec_from_file_location("shardfn_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(plan: str, steps: int, ckpt: str | None, sharded: bool = True):
    return _demo().train(plan, steps, 8, 16, ckpt, sharded)


@pytest.mark.parametrize("plan", _demo().PLANS)
def test_plan_matches_one_process_and_resumes_exactly(worlds, tmp_path, plan):
    results = worlds(4).run(_train, plan, 4, str(tmp_path / "ckpt"))
    reference = _train(plan, 4, None, sharded=False)
    for rank, result in enumerate(results):
        assert result["resumed"] is True, f"rank {rank}: the resumed run differs"
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(result["full"], reference["full"], rtol=1e-3, atol=1e-4)
    assert reference["losses"][-1] < reference["losses"][0]  # it trains


def test_demo_text_and_vocabulary():
    demo = _demo()
    ids = demo.load_text(2000)
    assert ids.numel() == 2000 and int(ids.max()) < len(demo.VOCAB) == 96
    assert demo.decode(ids[:50]) == demo.decode(ids)[:50]
    x, y = demo.global_batch(ids, 3, 4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
