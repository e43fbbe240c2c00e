"""``benchmarks/bench_compile.py``: compiled pure steps beside eager ones, in the report.

* A real run, small: the ``pmean`` step on 2 ranks, eager and compiled with
  ``aot_eager`` (no code generation, so seconds, not minutes; ``make bench`` uses
  inductor), with the check row whose step has a graph break. The compiled row has
  times, ratios, no recompile and parameters bitwise the eager run's (aot_eager
  runs the same kernels); the broken row says "does not compile" with dynamo's
  reason, and the benchmark still finishes.
* The report (``benchmarks/report.py``) from synthetic results: the compile table's
  ratio reaches the summary with the "faster than eager" target, and a row that does
  not compile shows its target as not measured, with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_compile") / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_compile.py"), "--quick",
         "--systems", "pmean", "broken-graph-break", "--backend", "aot_eager",
         "--steps", "2", "--warmup", "1", "--results", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_quick_run_has_compiled_rows_beside_eager(quick_run):
    results, stdout = quick_run
    assert results["bench"] == "compile"
    assert "--results" not in results["command"]
    (table,) = results["tables"]
    assert table["ratio"] == "compiled / eager"
    rows = {row[0]: dict(zip(table["header"], row, strict=True)) for row in table["rows"]}
    pmean = rows["pmean (grads averaged by sf.pmean)"]
    assert pmean["peer"] == "torch DDP"
    for column in ("eager ms", "compiled ms", "compiled / eager", "eager / peer",
                   "compiled / peer", "compile s"):
        assert float(pmean[column]) > 0, (column, pmean)
    # the ratio is the two medians' (rounded cells: a loose check)
    ratio = float(pmean["compiled ms"]) / float(pmean["eager ms"])
    assert abs(float(pmean["compiled / eager"]) - ratio) < 0.02 * ratio + 0.01, pmean
    assert pmean["recompiles"] == "0"
    assert float(pmean["max rel diff compiled vs eager"]) == 0.0  # aot_eager: same kernels
    broken = rows["check: pmean step with a graph break"]
    assert broken["compiled ms"].startswith("does not compile: Unsupported: "), broken
    assert "graph_break" in broken["compiled ms"]
    assert float(broken["eager ms"]) > 0  # its eager step still ran
    assert broken["compiled / eager"] == broken["max rel diff compiled vs eager"] == "—"
    assert "Run took" in stdout


def _compile_results() -> dict:
    from bench_compile import HEADER

    rows = [["pmean (grads averaged by sf.pmean)", "torch DDP", "100.0", "80.0", "0.800",
             "1.100", "0.880", "12.0", "0", "3.1e-07"],
            ["data_parallel (donated)", "torch DDP", "100.0", "120.0", "1.200", "1.050",
             "1.260", "11.0", "0", "2.0e-07"],
            ["ZeRO-3 shard_params per block (donated)", "torch DDP", "110.0",
             "does not compile: Unsupported: x (at exchange.py:12, in f)", "—", "1.100", "—",
             "—", "—", "—"]]
    table = {"header": HEADER, "rows": rows, "caption": "", "ratio": "compiled / eager",
             "peer": "the same step, eager", "quantity": "step time", "label": [0],
             "labels": None}
    return {"machine": {"cpu": "Test CPU", "cores": 2, "memory_gib": 8, "os": "Linux",
                        "torch": "2.13.0", "python": "3.11.7"},
            "date": "2026-12-02", "quick": True,
            "benches": {"compile": {"bench": "compile", "command":
                                    "python benchmarks/bench_compile.py --quick",
                                    "seconds": 60, "setup": ["Tiny."], "tables": [table],
                                    "notes": [], "plots": []}}}


def test_report_summary_judges_compiled_against_eager(tmp_path):
    pytest.importorskip("matplotlib")
    import report

    text = report.render(_compile_results(), str(tmp_path / "r.md"), str(tmp_path / "img"),
                         "svg")
    block = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = {cells[1]: cells for cells in
            ([c.strip() for c in line.strip().strip("|").split("|")]
             for line in block.splitlines() if line.startswith("| "))}
    assert rows["pmean (grads averaged by sf.pmean)"][2:] == [
        "0.800", "step time vs the same step, eager", "≤ 1", "yes"]
    assert rows["data_parallel (donated)"][5] == "**no**"
    zero3 = rows["ZeRO-3 step under torch.compile faster than the eager one"]
    assert zero3[5] == ("not measured: does not compile: Unsupported: x (at exchange.py:12, "
                        "in f)")
    # a target whose row is absent altogether is not measured, with no reason
    assert rows["TP + SP step under torch.compile faster than the eager one"][5] == "not measured"
    assert "## Whole pure steps under torch.compile" in text
