"""The benchmark report (``benchmarks/report.py``) rendered from saved results: a summary of
every row with its target, the machine in one line, figures whose labels are whole and whose
formulas are drawn over the measured bars, and no path of the machine anywhere.

Nothing here runs a benchmark: the report is rendered from a small synthetic results file
(and the committed ``benchmarks/results.json`` is checked against the targets).
"""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402
from _common import BenchOutput, machine  # noqa: E402

LONG_LABEL = "shardfn shard_params (ZeRO-3, default units, root kept as FSDP2s, torch.func)"


def _table(header, rows, **meta):
    return {"header": header, "rows": rows, "caption": "", "ratio": None, "peer": "",
            "quantity": "", "label": [0], "labels": None, **meta}


def _results() -> dict:
    """Three benchmarks in the shape ``run_all`` saves: a step-time table (one target met,
    one missed), the scaling table and the pipeline's bubble columns."""
    dp = _table(["system", "median ms", "ratio to DDP"],
                [["torch DDP", "100", "1.000"],
                 ["shardfn ZeRO-1 (torch.func, donated)", "97", "0.970"],
                 ["shardfn ZeRO-2 (autograd overlap, donated)", "120", "1.200"],
                 [LONG_LABEL, "90", "0.900"]],
                ratio="ratio to DDP", peer="torch DDP", quantity="step time")
    scaling = _table(
        ["strategy", "N", "params+grads+opt MiB/rank (measured)", "formula", "ratio",
         "sent MiB/step (measured)", "formula"],
        [[s, str(n), f"{8 / n:.2f}", f"{8 / n:.2f}", "1.000", f"{n - 1:.2f}", f"{n - 1:.2f}"]
         for n in (1, 2) for s in ("dp", "zero3")],
        ratio="ratio", peer="ZeRO formula", quantity="memory per rank",
        labels=[f"{s}, N={n}" for n in (1, 2) for s in ("dp", "zero3")])
    pp = _table(["schedule", "system", "ratio to torch", "measured bubble", "theory"],
                [["gpipe", "torch ScheduleGPipe", "—", "26.1%", "20.0%"],
                 ["gpipe", "shardfn pipeline_stages(schedule='gpipe')", "0.961", "21.9%",
                  "20.0%"]],
                ratio="ratio to torch", peer="torch pipelining", quantity="step time",
                label=[1])

    def bench(key, table):
        return {"bench": key, "command": f"python benchmarks/bench_{key}.py", "seconds": 12,
                "setup": [f"Model of {key}."], "tables": [table], "notes": [], "plots": []}

    return {"machine": {"cpu": "Test CPU 3000", "cores": 2, "memory_gib": 7.5,
                        "os": "Linux 6.1", "torch": "2.13.0", "python": "3.11.7"},
            "date": "2026-12-02", "quick": False,
            "benches": {"dp": bench("dp", dp), "scaling": bench("scaling", scaling),
                        "pp": bench("pp", pp)}}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    text = report.render(_results(), str(out / "benchmark_report.md"), str(out / "img"), "svg")
    return out, text


def _summary_rows(text: str) -> dict[str, list[str]]:
    block = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in block.splitlines() if line.startswith("| ")]
    assert rows[0] == ["benchmark", "row", "ratio", "compared", "target", "met"]
    return {row[1]: row for row in rows[1:]}


def test_summary_lists_every_row_with_its_ratio_target_and_verdict(rendered):
    _, text = rendered
    assert text.index("## Summary") < text.index("## Data parallel")
    rows = _summary_rows(text)
    assert rows["shardfn ZeRO-1 (torch.func, donated)"][2:] == [
        "0.970", "step time vs torch DDP", "≤ 1.05", "yes"]
    assert rows["shardfn ZeRO-2 (autograd overlap, donated)"][4:] == ["≤ 1.05", "**no**"]
    assert rows[LONG_LABEL][4:] == ["—", "—"]  # no target: shown, not judged
    assert rows["zero3, N=2"][2:] == ["1.000", "memory per rank vs ZeRO formula", "≤ 1.02",
                                      "yes"]
    assert "torch DDP" not in rows  # the peer itself is not compared with itself
    # a target no row measured says so instead of vanishing
    assert rows["shard_params (ZeRO-3) within 5% of DDP"][5] == "not measured"


def test_machine_line_and_command(rendered):
    _, text = rendered
    assert ("**Machine:** Test CPU 3000, 2 cores, 7.5 GiB memory, Linux 6.1, torch 2.13.0, "
            "Python 3.11.7; 2026-12-02.") in text
    assert "`make bench`" in text and "`python benchmarks/bench_dp.py`, 12 s." in text
    assert "```" not in text  # tables, not console logs


def test_no_path_of_the_machine(rendered):
    out, text = rendered
    assert str(out) not in text and str(ROOT) not in text
    assert report.machine_paths(text) == []
    assert "![time ratios against each peer](img/bench_ratios.svg)" in text


def test_a_machine_path_in_the_results_is_refused(tmp_path):
    results = _results()
    results["benches"]["dp"]["notes"] = [f"wrote {ROOT}/docs/img/x.png"]
    with pytest.raises(ValueError, match="paths of this machine"):
        report.render(results, str(tmp_path / "r.md"), str(tmp_path / "img"), "svg")
    assert not (tmp_path / "r.md").exists()


def _svg_text(path: Path) -> str:
    return html.unescape(path.read_text())


def test_figures_are_written_with_whole_labels_and_formulas_over_the_bars(rendered):
    out, _ = rendered
    img = out / "img"
    names = {p.name for p in img.iterdir()}
    assert names == {"bench_ratios.svg", "bench_scaling_memory.svg", "bench_scaling_comm.svg",
                     "bench_pp_bubble.svg"}
    ratios = _svg_text(img / "bench_ratios.svg")
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", ratios)
    assert f"dp: {LONG_LABEL}" in texts  # the whole label, one piece of text
    assert "target" in texts
    # the target marks are drawn after (over) every bar
    assert ratios.index('id="target"') > ratios.rindex('id="measured_')
    for name, over in (("bench_scaling_memory.svg", "ZeRO formula"),
                       ("bench_pp_bubble.svg", "theory (textbook)")):
        svg = _svg_text(img / name)
        assert over in re.findall(r"<text[^>]*>([^<]*)</text>", svg)  # in the legend
        first_over = min(m.start() for m in re.finditer(r'id="(formula|theory)', svg))
        assert first_over > svg.rindex('id="measured_'), name


def test_bench_output_records_relative_paths_and_a_repeatable_command(tmp_path, capsys):
    out = BenchOutput("pp", argv=[str(ROOT / "benchmarks" / "bench_pp.py"), "--img-dir",
                                  str(ROOT / "docs" / "img"), "--results",
                                  str(tmp_path / "r.json"), "--quick"])
    assert out.command == "python benchmarks/bench_pp.py --img-dir docs/img --quick"
    out.table("| system | ratio to torch |\n|---|---:|\n| sf | 0.96 |", "Caption.",
              ratio="ratio to torch", peer="torch", quantity="step time")
    out.plot(str(ROOT / "docs" / "img" / "x.png"), "a timeline")
    out.save(str(tmp_path / "r.json"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["plots"] == [{"path": "docs/img/x.png", "caption": "a timeline"}]
    assert saved["tables"][0]["rows"] == [["sf", "0.96"]]
    assert str(ROOT) not in json.dumps(saved)
    assert "| sf | 0.96 |" in capsys.readouterr().out  # the console still shows the table


def test_machine_names_cpu_cores_memory_os_and_torch():
    m = machine()
    assert m["cores"] >= 1 and m["torch"] and m["os"] and m["cpu"]


def test_committed_results_measure_every_target_and_name_no_path():
    path = ROOT / "benchmarks" / "results.json"
    text = path.read_text()
    assert report.machine_paths(text) == []
    results = json.loads(text)
    rows, missing = report.summary(results)
    assert not missing, [t.text for t in missing]
    assert {r.bench for r in rows} == {b.key for b in report.BENCHES}
    assert not any(re.search(r"#\d", t.text) for t in report.TARGETS)  # no issue numbers
