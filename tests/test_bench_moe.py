"""``benchmarks/bench_moe.py --quick``: the MoE benchmark row runs and its numbers hold.

One small run on 2 ranks: the ep Mixtral's gathered gradients equal the one-process
gradient of the mean loss, every all-to-all's bytes equal the formula from the step's
routing, the expert memory per rank is half, and the tables carry the ratio columns the
report reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--quick",
                           "--results", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["bench"] == "moe" and "--results" not in results["command"]
    model, comm, layer = results["tables"]
    assert model["ratio"] == "ratio to one process" and model["quantity"] == "step time"
    ep_row = dict(zip(model["header"], model["rows"][1], strict=True))
    assert float(ep_row["ratio to one process"].split()[0]) > 0
    assert float(ep_row["max rel diff (grads)"]) < 1e-4
    ops = {(row[0], row[1]): row for row in comm["rows"]}
    for rank in ("0", "1"):
        for op in ("ep/all_to_all", "ep/all_to_all_v", "ep/psum"):
            assert ops[(rank, op)][4] == "1.000", ops[(rank, op)]
    assert len(ops) == 6  # nothing else was sent in the step
    rows = {row[0]: row for row in layer["rows"]}
    assert float(rows["shardfn MoE layer, sf.expert_parallel ep=2"][3]) < 1e-5
    assert any("(0.500 = 1/2)" in note for note in results["notes"])
