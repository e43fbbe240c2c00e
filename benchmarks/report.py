"""`make bench`: run every benchmark, save their results, write the report a person reads.

Runs each script of :data:`BENCHES` in turn (each starts its own local world of
CPU ranks) with ``--results FILE``: the script writes its setup, tables, notes
and figures as JSON (``_common.BenchOutput``). This script gathers them, with
the machine and the date, into ``benchmarks/results.json`` (committed: it names
no path of the machine), and renders from that file alone:

* ``docs/benchmark_report.md``: the machine in one line, the command, a summary
  table of every row that has a ratio to a peer (the ratio, the target the
  issues set for it, met or not), then one section per benchmark with its
  tables and figures;
* ``docs/img/bench_ratios.png``: the time ratios against each peer, targets drawn
  over the bars; ``docs/img/bench_scaling_memory.png`` / ``bench_scaling_comm.png``:
  memory and bytes sent against world size beside the ZeRO formulas;
  ``docs/img/bench_pp_bubble.png``: the measured pipeline bubble beside the theory.

The consoles' output goes to ``benchmarks/last_run.log`` (git-ignored), not into the
report. The report refuses to name a path of the machine (:func:`machine_paths`).

Run: .venv/bin/python benchmarks/report.py [--quick] [--only dp tp ...]
     .venv/bin/python benchmarks/report.py --from-results benchmarks/results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _plots import Bar, bubble_plot, ratio_plot, scaling_plots  # noqa: E402

RESULTS = os.path.join(HERE, "results.json")
LOG = os.path.join(HERE, "last_run.log")
REPORT = os.path.join(ROOT, "docs", "benchmark_report.md")


class Bench(NamedTuple):
    key: str
    title: str
    script: str
    args: tuple[str, ...]


BENCHES = (
    Bench("dp", "Data parallel, ZeRO-1/2 and ZeRO-3 against DDP, FSDP2, FairScale and "
          "ZeroRedundancyOptimizer", "bench_dp.py", ()),
    Bench("scaling", "Memory and communication against world size (ZeRO formulas)",
          "bench_scaling.py", ()),
    Bench("tp", "Tensor parallel against torch parallelize_module", "bench_tp.py", ()),
    Bench("pp", "Pipeline parallel against torch.distributed.pipelining", "bench_pp.py",
          ("--img-dir", os.path.join("docs", "img"))),
    Bench("ckpt", "Checkpoints against torch DCP with FSDP2", "bench_ckpt.py", ()),
    Bench("hf", "A Hugging Face Llama: ZeRO-3, TP from plan='auto' and a pipeline against "
          "torch's own", "bench_hf.py", ()),
    Bench("data", "The data loader's throughput against the demo's step and torch's "
          "DataLoader", "bench_data.py", ()),
    Bench("compile", "Whole pure steps under torch.compile against the same steps eager",
          "bench_compile.py", ("--overlap",)),
    Bench("moe", "Expert parallelism: a Mixtral under sf.expert_parallel against the same "
          "model without ep, and the MoE layer against DeepSpeed-MoE", "bench_moe.py", ()),
)


class Target(NamedTuple):
    """A goal an issue set: the rows of ``bench`` whose cells (joined by " | ") contain
    ``row`` (case-insensitive), read in the column whose title contains ``column``."""

    bench: str
    text: str
    row: str
    column: str
    op: str
    value: float

    def met(self, value: float) -> bool:
        return value <= self.value if self.op == "<=" else value >= self.value


TARGETS = (
    Target("dp", "ZeRO-1 step within 5% of DDP", "zero-1 (torch.func, donated)",
           "ratio to ddp", "<=", 1.05),
    Target("dp", "ZeRO-2 step within 5% of DDP", "zero-2", "ratio to ddp", "<=", 1.05),
    Target("dp", "shard_params (ZeRO-3) within 5% of DDP",
           "shard_params (zero-3, torch.func, donated)", "ratio to ddp", "<=", 1.05),
    *(Target("dp", f"data_parallel {what} within 5% of DDP", f"data_parallel ({what})",
             "ratio to ddp", "<=", 1.05)
      for what in ("torch.func, donated", "torch.func, no donation", "autograd overlap, donated",
                   "sf.grad_and_value, donated", "dp.grad_and_value, overlapped, donated",
                   "dp.grad_and_value, overlapped, no donation")),
    Target("scaling", "memory per rank = ZeRO formula (padding aside), every strategy and N",
           "", "ratio", "<=", 1.02),
    Target("tp", "tensor_split no slower than torch parallelize_module (autograd step)",
           "autograd step", "ratio (target", "<=", 1.0),
    Target("tp", "tensor_split no slower than torch parallelize_module (torch.func step)",
           "torch.func step", "ratio (target", "<=", 1.0),
    Target("tp", "tensor_split no slower than torch parallelize_module (sf.grad_and_value "
           "step)", "sf.grad_and_value step", "ratio (target", "<=", 1.0),
    *(Target("pp", f"pipeline_stages no slower than torch.distributed.pipelining, {label}",
             f"schedule='{name}'", "ratio to torch", "<=", 1.0)
      for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B"), ("interleaved", "interleaved"),
                          ("zb-h1", "ZB-H1"))),
    Target("ckpt", "sf.checkpoint save no slower than DCP + FSDP2", "save (s)",
           "ratio sf/torch", "<=", 1.0),
    Target("ckpt", "sf.checkpoint load no slower than DCP + FSDP2", "load (s)",
           "ratio sf/torch", "<=", 1.0),
    Target("ckpt", "sf.checkpoint async save blocks less than a fresh staging copy "
           "(by 10% at least)", "async save, blocking", "ratio async/copy", "<=", 0.9),
    *(Target("hf", f"HF Llama {what} no slower than {peer}", row, "ratio sf/torch", "<=", 1.0)
      for what, peer, row in (
          ("ZeRO-3 (shard_params)", "FSDP2 fully_shard", "shard_params"),
          ("TP (tensor_split plan='auto', autograd step)", "parallelize_module",
           "plan='auto'); autograd"),
          ("TP (tensor_split plan='auto', torch.func step)", "parallelize_module",
           "plan='auto'); torch.func"),
          ("pipeline (pipeline_stages 1F1B)", "torch pipelining Schedule1F1B",
           "pipeline_stages"))),
    # "same bytes per rank": no more than the peer's; 1% for the pipeline's message
    # headers and padding
    *(Target("hf", f"HF Llama {what}: bytes sent per rank per step no more than {peer}'s",
             row, "sent ratio", "<=", 1.01)
      for what, peer, row in (("ZeRO-3", "FSDP2", "shard_params"),
                              ("TP", "parallelize_module", "tensor_split"),
                              ("pipeline", "torch pipelining", "pipeline_stages"))),
    Target("hf", "HF Llama: memory per rank (params + grads + optimizer state) no more than "
           "the peer's, every comparison", "shardfn", "memory ratio", "<=", 1.01),
    # the loader is not the bottleneck of the demo's training step
    *(Target("data", f"sf.data.loader (num_workers={w}) delivers tokens per rank faster than "
             "the demo's fsdp step consumes them", f"sf.data.loader (TokenFile), num_workers={w}",
             "loader / step", ">=", 1.0) for w in (0, 2)),
    # issue 27: a whole pure step under torch.compile faster than the eager one (a row
    # that does not compile has no ratio: its target shows as "not measured")
    *(Target("compile", f"{what} step under torch.compile faster than the eager one", row,
             "compiled / eager", "<=", 1.0)
      for what, row in (("pmean", "pmean ("), ("data_parallel (donated)",
                                                "data_parallel (donated)"),
                        ("data_parallel (not donated)", "data_parallel (not donated)"),
                        ("ZeRO-1", "zero-1 shard_opt_state"),
                        ("ZeRO-3", "zero-3 shard_params"), ("TP + SP", "tp + sp tensor_split"))),
)


def number(cell: str) -> float | None:
    """The first number in a table cell ("0.712 (0.682-0.996)" -> 0.712), or None."""
    match = re.search(r"-?\d+(\.\d+)?(e-?\d+)?", cell.replace(",", ""))
    return float(match.group(0)) if match else None


def _column(header: Sequence[str], title: str | None) -> int | None:
    if not title:
        return None
    return next((i for i, h in enumerate(header) if title.lower() in h.lower()), None)


def row_label(table: dict, i: int) -> str:
    """The name of row ``i`` of ``table``: its given label, or its label columns joined."""
    if table.get("labels"):
        return table["labels"][i]
    return ", ".join(table["rows"][i][c] for c in table.get("label", [0]))


# ----------------------------------------------------------------------------- summary


class Check(NamedTuple):
    target: Target
    value: float
    cell: str  # the value as the table shows it
    same_column: bool  # the target reads the table's ratio column


class SummaryRow(NamedTuple):
    bench: str
    label: str
    ratio: str  # the cell, with its spread when the benchmark gives one
    compared: str  # "step time vs torch DDP"
    checks: tuple[Check, ...]
    quantity: str

    @property
    def met(self) -> str:
        if not self.checks:
            return "—"
        return "yes" if all(c.target.met(c.value) for c in self.checks) else "**no**"


def summary(results: dict) -> tuple[list[SummaryRow], list[Target]]:
    """Every row with a ratio to its peer, with the targets it meets or misses; and the
    targets of benchmarks in ``results`` that no row measured."""
    rows, seen = [], set()
    for key, bench in results["benches"].items():
        targets = [t for t in TARGETS if t.bench == key]
        for table in bench["tables"]:
            header, ratio_col = table["header"], _column(table["header"], table.get("ratio"))
            for i, cells in enumerate(table["rows"]):
                checks = []
                for target in targets:
                    col = _column(header, target.column)
                    value = number(cells[col]) if col is not None and col < len(cells) else None
                    if value is None or target.row.lower() not in " | ".join(cells).lower():
                        continue
                    checks.append(Check(target, value, cells[col].split(" ")[0],
                                        col == ratio_col))
                    seen.add(target)
                label = row_label(table, i)
                ratio = cells[ratio_col] if ratio_col is not None else ""
                if number(ratio) is None and not checks or label == table.get("peer"):
                    continue
                rows.append(SummaryRow(key, label, ratio or "—",
                                       f"{table.get('quantity') or 'ratio'} vs "
                                       f"{table.get('peer') or 'the peer'}", tuple(checks),
                                       table.get("quantity", "")))
    missing = [t for t in TARGETS if t.bench in results["benches"] and t not in seen]
    return rows, missing


def why_unmeasured(results: dict, target: Target) -> str:
    """``": <cell>"`` when a row of ``target`` is there but its cell holds no number
    (bench_compile's "does not compile: ..."), else ``""``."""
    bench = results["benches"].get(target.bench, {})
    for table in bench.get("tables", []):
        col = _column(table["header"], target.column)
        for cells in table["rows"]:
            if col is None or target.row.lower() not in " | ".join(cells).lower():
                continue
            # the first cell that explains: the target's own, else one that says it failed
            for cell in [cells[col], *cells]:
                if cell.startswith(("does not compile", "failed", "n/a")):
                    return f": {cell}"
    return ""


def _target_cell(checks: Sequence[Check]) -> str:
    parts = []
    for c in checks:
        bound = f"{'≤' if c.target.op == '<=' else '≥'} {c.target.value:g}"
        parts.append(bound if c.same_column else f"{c.target.column} {bound} ({c.cell})")
    return "; ".join(dict.fromkeys(parts)) or "—"


# ----------------------------------------------------------------------------- rendering


def machine_line(results: dict) -> str:
    """The one line naming the machine: CPU model, cores, memory, OS, torch, date."""
    m = results["machine"]
    memory = f"{m['memory_gib']:g} GiB memory, " if m.get("memory_gib") else ""
    return (f"{m['cpu']}, {m['cores']} cores, {memory}{m['os']}, torch {m['torch']}, "
            f"Python {m['python']}; {results['date']}")


#: a cell that is a number: "0.712", "1.0e-06", "21.9%", "254–265", "0.712 (0.68-0.99)",
#: "278 / 252 (1.100)"
NUMERIC = re.compile(r"-?[\d.,]+(e[-+]?\d+)?%?([–-][\d.,]+)?( \(.*\))?( / .*)?")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def esc(cell: str) -> str:
        return str(cell).replace("|", "\\|")

    def numeric(i: int) -> bool:  # every cell a number (with its spread) or a dash
        cells = [r[i] for r in rows if i < len(r) and r[i] not in ("", "—")]
        return bool(cells) and all(NUMERIC.fullmatch(c) for c in cells)

    align = ["---:" if i and numeric(i) else "---" for i in range(len(header))]
    return ["| " + " | ".join(esc(h) for h in header) + " |",
            "|" + "|".join(align) + "|",
            *("| " + " | ".join(esc(c) for c in r) + " |" for r in rows)]


def figures(results: dict, img_dir: str, ext: str = "png") -> dict[str, list[tuple[str, str]]]:
    """Draw the report's own figures from ``results``: ``{bench or "summary": [(path,
    caption)]}``."""
    out: dict[str, list[tuple[str, str]]] = {}
    rows, _ = summary(results)
    bars = [Bar(f"{r.bench}: {r.label}", number(r.ratio),
                next((c.target.value for c in r.checks if c.same_column), None))
            for r in rows if "time" in r.quantity and number(r.ratio) is not None]
    if bars:
        path = os.path.join(img_dir, f"bench_ratios.{ext}")
        out["summary"] = [(ratio_plot(bars, path), "time ratios against each peer")]
    scaling = results["benches"].get("scaling")
    if scaling and scaling["tables"]:
        paths = scaling_plots(scaling["tables"][0]["rows"], img_dir, ext)
        out["scaling"] = list(zip(paths, ("memory per rank", "bytes sent per step"),
                                  strict=True))
    pp = results["benches"].get("pp")
    if pp and pp["tables"]:
        table = pp["tables"][0]
        m_col, t_col = _column(table["header"], "measured bubble"), _column(table["header"],
                                                                            "theory")
        if m_col is not None and t_col is not None:
            kept = [(row_label(table, i), number(r[m_col]), number(r[t_col]))
                    for i, r in enumerate(table["rows"])
                    if number(r[m_col]) is not None and number(r[t_col]) is not None]
            if kept:
                labels, measured, theory = zip(*kept, strict=True)
                path = bubble_plot(labels, [v / 100 for v in measured],
                                   [v / 100 for v in theory],
                                   os.path.join(img_dir, f"bench_pp_bubble.{ext}"))
                out["pp"] = [(path, "measured pipeline bubble beside the textbook value")]
    return out


def render(results: dict, out_path: str, img_dir: str, ext: str = "png") -> str:
    """Write the report of ``results`` to ``out_path`` and its figures to ``img_dir``.

    Args:
        results: what :func:`run_all` saved (``benchmarks/results.json``).
        out_path: the markdown file.
        img_dir: where the figures go (linked relative to ``out_path``).
        ext: the figures' format, ``png`` or ``svg``.

    Returns:
        The report's text.

    Raises:
        ValueError: if the text would name a path of this machine.
    """
    drawn = figures(results, img_dir, ext)
    base = os.path.dirname(os.path.abspath(out_path))

    def image(path: str, caption: str) -> str:
        full = path if os.path.isabs(path) else os.path.join(ROOT, path)
        return f"![{caption}]({os.path.relpath(full, base)})"

    total = sum(b.get("seconds", 0) for b in results["benches"].values())
    command = ("`python benchmarks/report.py --quick` (each benchmark's smoke-test size; "
               "`make bench` runs the full one)" if results.get("quick") else
               "`make bench` (it runs `python benchmarks/report.py`)")
    lines = ["# Benchmark report", "",
             f"**Machine:** {machine_line(results)}.", "",
             f"**Command:** {command}: every benchmark below, {total / 60:.0f} min in all. "
             "The report again from the saved "
             "results, running nothing: `python benchmarks/report.py --from-results "
             "benchmarks/results.json`.", "",
             "Machines are shared and noisy: every table gives medians over interleaved steps, "
             "and each ratio is measured against its peer in the same run. "
             "[benchmarks.md](benchmarks.md) explains each row.", "",
             "## Summary", "",
             "Every row with a ratio to its peer, and the target set for it. Below 1: less "
             "time, bytes or memory than the peer; for tokens/s, above 1 is faster.", ""]
    rows, missing = summary(results)
    lines += _md_table(["benchmark", "row", "ratio", "compared", "target", "met"],
                       [[r.bench, r.label, r.ratio, r.compared, _target_cell(r.checks), r.met]
                        for r in rows]
                       + [[t.bench, t.text, "—", "—", f"{t.op} {t.value:g}",
                           "not measured" + why_unmeasured(results, t)] for t in missing])
    lines.append("")
    lines += [image(p, c) for p, c in drawn.get("summary", [])] + [""]
    titles = {b.key: b for b in BENCHES}
    for key, bench in results["benches"].items():
        title = titles[key].title if key in titles else key
        seconds = f", {bench['seconds']:.0f} s" if bench.get("seconds") else ""
        lines += [f"## {title}", "", f"`{bench['command']}`{seconds}.", ""]
        lines += [*(s for text in bench["setup"] for s in (text, "")), ]
        for table in bench["tables"]:
            if table.get("caption"):
                lines += [table["caption"], ""]
            lines += _md_table(table["header"], table["rows"]) + [""]
        lines += [*(s for text in bench["notes"] for s in (text, ""))]
        for path, caption in drawn.get(key, []):
            lines += [image(path, caption), ""]
        for plot in bench["plots"]:
            lines += [f"{plot['caption']}:", "", image(plot["path"], plot["caption"]), ""]
    text = "\n".join(lines).rstrip() + "\n"
    found = machine_paths(text)
    if found:
        raise ValueError(f"the report would name paths of this machine: {found[:5]}")
    with open(out_path, "w") as f:
        f.write(text)
    return text


def machine_paths(text: str) -> list[str]:
    """The paths of this machine in ``text``: the checkout, the home directory, the
    temporary directory, and any user's home or temporary folder (``tests/test_no_machine_
    paths.py`` checks every file of the repository more closely)."""
    roots = {ROOT, os.path.expanduser("~"), tempfile.gettempdir()} - {"/", ""}
    found = [r for r in roots if r + os.sep in text]
    found += re.findall(r"(?<![\w.])/(?:home|root|Users|tmp|var/folders|private/var)/\S+", text)
    return found


# ----------------------------------------------------------------------------- running


def run_bench(bench: Bench, quick: bool, log) -> tuple[dict | None, float]:
    """Run one script with ``--results``; its structured results and the seconds it took.
    Its console output goes to ``log``; a failure is recorded as a note in the results."""
    path = os.path.join(HERE, bench.script)
    with tempfile.TemporaryDirectory() as tmp:
        results_path = os.path.join(tmp, "results.json")
        cmd = [sys.executable, path, *bench.args, *(["--quick"] if quick else []),
               "--results", results_path]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        seconds = time.perf_counter() - start
        log.write(f"== {bench.script} ({seconds:.0f} s, exit {proc.returncode})\n"
                  f"{proc.stdout}\n{proc.stderr}\n")
        log.flush()
        if proc.returncode or not os.path.exists(results_path):
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"bench": bench.key, "command": f"python benchmarks/{bench.script}",
                    "setup": [], "tables": [], "plots": [],
                    "notes": [f"The run failed (exit {proc.returncode}): {last[:300]}. "
                              "The console output is in benchmarks/last_run.log."]}, seconds
        with open(results_path) as f:
            return json.load(f), seconds


def run_all(keys: Sequence[str], quick: bool) -> dict:
    """Run the benchmarks ``keys``; everything the report needs, as one JSON-ready dict."""
    from _common import machine

    results: dict[str, Any] = {"machine": machine(), "date": datetime.date.today().isoformat(),
                               "quick": quick, "benches": {}}
    with open(LOG, "w") as log:
        for bench in BENCHES:
            if bench.key not in keys:
                continue
            print(f"== {bench.script}", flush=True)
            record, seconds = run_bench(bench, quick, log)
            record["seconds"] = round(seconds)
            record.pop("date", None)
            results["benches"][bench.key] = record
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick")
    parser.add_argument("--only", nargs="+", choices=[b.key for b in BENCHES])
    parser.add_argument("--out", default=REPORT, help="the report (markdown)")
    parser.add_argument("--img-dir", default=os.path.join(ROOT, "docs", "img"))
    parser.add_argument("--results", default=RESULTS,
                        help="where the run saves its results (default benchmarks/results.json)")
    parser.add_argument("--from-results", "--from-json", metavar="FILE", dest="from_results",
                        help="render the report from saved results, running nothing")
    parser.add_argument("--merge", action="store_true",
                        help="with --only: replace those benchmarks in the saved results and "
                             "keep the others (the machine line stays the saved run's)")
    args = parser.parse_args(argv)
    if args.from_results:
        with open(args.from_results) as f:
            results = json.load(f)
    else:
        results = run_all(args.only or [b.key for b in BENCHES], args.quick)
        if args.merge and os.path.exists(args.results):
            with open(args.results) as f:
                saved = json.load(f)
            if saved.get("quick") != results["quick"]:
                raise ValueError("--merge: the saved results are of the other size (--quick)")
            saved["benches"].update(results["benches"])
            results = saved
        text = json.dumps(results, indent=1, ensure_ascii=False)
        if machine_paths(text):
            raise ValueError(f"results name paths of this machine: {machine_paths(text)[:5]}")
        with open(args.results, "w") as f:
            f.write(text + "\n")
    render(results, args.out, args.img_dir)
    print(f"wrote {os.path.relpath(args.out, ROOT)} (console output: "
          f"{os.path.relpath(LOG, ROOT)})")


if __name__ == "__main__":
    main()
