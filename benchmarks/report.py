"""`make bench`: run every benchmark, write docs/benchmark_report.md and its plots.

Runs each script below in turn (each starts its own local world of CPU ranks),
keeps its printed tables, reads the targets set by the issues that built each
transform from those tables, and writes:

* ``docs/benchmark_report.md``: the machine, each benchmark's tables, and a
  targets table (target, measured, met or not);
* ``docs/img/report_step_ratio.png``: step-time ratios against each peer;
* ``docs/img/scaling_memory.png`` / ``scaling_comm.png``: memory per rank and
  bytes sent against world size, beside the ZeRO formulas (``bench_scaling.py``);
* the pipeline timelines ``bench_pp.py`` draws.

Run: .venv/bin/python benchmarks/report.py [--quick] [--only dp tp ...]
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
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS = os.path.join(ROOT, "docs")
IMG = os.path.join(DOCS, "img")


class Bench(NamedTuple):
    key: str
    title: str
    script: str
    args: tuple[str, ...]


BENCHES = (
    Bench("dp", "Data parallel, ZeRO-1/2 and ZeRO-3 against DDP, FSDP2, FairScale and "
          "ZeroRedundancyOptimizer", "bench_dp.py", ()),
    Bench("scaling", "Memory and communication against world size (ZeRO formulas)",
          "bench_scaling.py", ("--plots", IMG)),
    Bench("tp", "Tensor parallel against torch parallelize_module", "bench_tp.py", ()),
    Bench("pp", "Pipeline parallel against torch.distributed.pipelining", "bench_pp.py",
          ("--img-dir", IMG)),
    Bench("ckpt", "Checkpoints against torch DCP with FSDP2", "bench_ckpt.py", ()),
    Bench("hf", "A Hugging Face Llama: ZeRO-3, TP from plan='auto' and a pipeline against "
          "torch's own", "bench_hf.py", ()),
    Bench("data", "The data loader's throughput against the demo's step and torch's "
          "DataLoader", "bench_data.py", ()),
)


class Target(NamedTuple):
    """``row``: a case-insensitive substring of a table row (its cells joined by " | ");
    ``column``: of the header cell whose values are read."""

    bench: str
    text: str
    row: str
    column: str
    op: str
    value: float


TARGETS = (
    Target("dp", "ZeRO-1 step within 5% of DDP", "zero-1 (torch.func, donated)",
           "ratio to ddp", "<=", 1.05),
    Target("dp", "ZeRO-2 step within 5% of DDP", "zero-2", "ratio to ddp", "<=", 1.05),
    Target("dp", "shard_params (ZeRO-3) no slower than 1.1x DDP",
           "shard_params (zero-3, torch.func, donated)", "ratio to ddp", "<=", 1.10),
    Target("scaling", "memory per rank = ZeRO formula (padding aside), every strategy and N",
           "", "ratio", "<=", 1.02),
    Target("tp", "tensor_split no slower than torch parallelize_module (autograd step)",
           "autograd step", "ratio (target", "<=", 1.0),
    Target("tp", "tensor_split no slower than torch parallelize_module (torch.func step)",
           "torch.func step", "ratio (target", "<=", 1.0),
    *(Target("pp", f"pipeline_stages no slower than torch.distributed.pipelining, {label}",
             f"schedule='{name}'", "ratio to torch", "<=", 1.0)
      for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B"), ("interleaved", "interleaved"),
                          ("zb-h1", "ZB-H1 (beyond the three schedules #12 names)"))),
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
    # "same bytes per rank" (#24): no more than the peer's; 1% for the pipeline's message
    # headers and padding
    *(Target("hf", f"HF Llama {what}: bytes sent per rank per step no more than {peer}'s",
             row, "sent ratio", "<=", 1.01)
      for what, peer, row in (("ZeRO-3", "FSDP2", "shard_params"),
                              ("TP", "parallelize_module", "tensor_split"),
                              ("pipeline", "torch pipelining", "pipeline_stages"))),
    Target("hf", "HF Llama: memory per rank (params + grads + optimizer state) no more than "
           "the peer's, every comparison", "shardfn", "memory ratio", "<=", 1.01),
    # #25 item 5: the loader is not the bottleneck of the demo's training step
    *(Target("data", f"sf.data.loader (num_workers={w}) delivers tokens per rank faster than "
             "the demo's fsdp step consumes them", f"sf.data.loader (TokenFile), num_workers={w}",
             "loader / step", ">=", 1.0) for w in (0, 2)),
)


def parse_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table in ``text``: (header cells, rows of cells)."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.strip().startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and re.fullmatch(r"[-: ]+", "".join(block[1])):
            tables.append((block[0], block[2:]))
        block = []
    return tables


def _number(cell: str) -> float | None:
    match = re.search(r"-?\d+(\.\d+)?(e-?\d+)?", cell.replace(",", ""))
    return float(match.group(0)) if match else None


def measured(target: Target, text: str) -> list[float]:
    """The values of ``target.column`` in rows whose first cell contains ``target.row``."""
    values = []
    for header, rows in parse_tables(text):
        cols = [i for i, h in enumerate(header) if target.column.lower() in h.lower()]
        if not cols:
            continue
        for row in rows:
            if target.row.lower() in " | ".join(row).lower() and len(row) > cols[0]:
                value = _number(row[cols[0]])
                if value is not None:
                    values.append(value)
    return values


def check(target: Target, values: list[float]) -> str:
    if not values:
        return "not measured"
    worst = max(values) if target.op == "<=" else min(values)
    ok = worst <= target.value if target.op == "<=" else worst >= target.value
    return "met" if ok else "missed"


def run_bench(bench: Bench, quick: bool) -> tuple[str, float, int]:
    path = os.path.join(HERE, bench.script)
    if not os.path.exists(path):
        return f"({bench.script} is not in this checkout)", 0.0, 0
    cmd = [sys.executable, path, *bench.args, *(["--quick"] if quick else [])]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    seconds = time.perf_counter() - start
    out = result.stdout
    if result.returncode:
        out += f"\n(exit {result.returncode})\n" + result.stderr[-3000:]
    return out, seconds, result.returncode


def ratio_plot(outputs: dict[str, str], path: str) -> str | None:
    """A bar per table row that has a 'ratio' column: step time against its reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []
    for key, text in outputs.items():
        if key == "scaling":
            continue
        for header, rows in parse_tables(text):
            cols = [i for i, h in enumerate(header) if "ratio" in h.lower()]
            if not cols:
                continue
            for row in rows:
                value = _number(row[cols[0]]) if len(row) > cols[0] else None
                if value is not None and 0 < value < 20:
                    label = f"{key}: {row[0][:44]}"
                    if len(row) > 1 and ";" in row[1]:  # "plan; variant": show the variant
                        label += f" ({row[1].rsplit(';', 1)[1].strip()[:32]})"
                    bars.append((label, value))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(bars) + 1.2))
    names, values = zip(*bars, strict=True)
    ax.barh(range(len(bars)), values, color=["C2" if v <= 1.0 else "C1" for v in values])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(bars)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("step time / reference's (lower is faster; 1 = the peer)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(outputs: dict[str, str], seconds: dict[str, float], quick: bool,
                 machine: str) -> str:
    lines = ["# Benchmark report", "",
             f"Generated by `make bench` (`benchmarks/report.py{' --quick' if quick else ''}`) "
             f"on {datetime.date.today().isoformat()}. Machine: {machine}. The machines are "
             "shared and noisy: every table gives medians over interleaved steps and ratios "
             "measured in the same run; see [benchmarks.md](benchmarks.md) for the analysis "
             "of each row.", "", "## Targets", "",
             "| benchmark | target | measured | result |", "|---|---|---:|---|"]
    for target in TARGETS:
        if target.bench not in outputs:
            continue
        values = measured(target, outputs[target.bench])
        shown = ", ".join(f"{v:.3f}" for v in values[:6]) or "—"
        lines.append(f"| {target.bench} | {target.text} ({target.op} {target.value}) | "
                     f"{shown} | {check(target, values)} |")
    lines += ["", "![step-time ratios](img/report_step_ratio.png)", ""]
    for bench in BENCHES:
        if bench.key not in outputs:
            continue
        lines += [f"## {bench.title}", "", f"`benchmarks/{bench.script}`, "
                  f"{seconds[bench.key]:.0f} s.", ""]
        if bench.key == "scaling":
            lines += ["![memory per rank](img/scaling_memory.png)",
                      "![bytes sent per step](img/scaling_comm.png)", ""]
        lines += ["```text", _relative(outputs[bench.key]).strip(), "```", ""]
    return "\n".join(lines)


def _relative(text: str) -> str:
    """A benchmark's console output with the checkout's absolute path cut off, so that the
    report names files relative to the repository, never a path of the machine that ran it."""
    return text.replace(ROOT + os.sep, "").replace(ROOT, ".")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick")
    parser.add_argument("--only", nargs="+", choices=[b.key for b in BENCHES])
    parser.add_argument("--out", default=os.path.join(DOCS, "benchmark_report.md"))
    parser.add_argument("--from-json", metavar="FILE",
                        help="write the report from the raw outputs a run saved (the path it "
                             "printed), running nothing")
    args = parser.parse_args(argv)
    os.makedirs(IMG, exist_ok=True)
    sys.path.insert(0, HERE)
    from _common import machine_info

    outputs, seconds = {}, {}
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        outputs, seconds = saved["outputs"], saved["seconds"]
    for bench in BENCHES if not args.from_json else ():
        if args.only and bench.key not in args.only:
            continue
        print(f"== {bench.script}", flush=True)
        outputs[bench.key], seconds[bench.key], _ = run_bench(bench, args.quick)
        print(outputs[bench.key], flush=True)
    ratio_plot(outputs, os.path.join(IMG, "report_step_ratio.png"))
    text = write_report(outputs, seconds, args.quick, machine_info())
    with open(args.out, "w") as f:
        f.write(text + "\n")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"outputs": outputs, "seconds": seconds}, f)
    print(f"wrote {os.path.relpath(args.out, ROOT)} (raw outputs: {f.name})")


if __name__ == "__main__":
    main()
