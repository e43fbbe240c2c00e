"""A Hugging Face Llama through shardfn's ZeRO-3, tensor parallel and pipeline, against torch's own.

One model (``transformers.LlamaForCausalLM`` from a config, random init, no download:
8 decoder layers, d=512, 8 heads with 4 key/value heads, SwiGLU 1376, vocabulary 8192,
``attn_implementation="sdpa"``, untied head: 31.6M parameters) and three comparisons on N
local CPU ranks (gloo, one thread per rank), every system starting from the same weights
and stepping on the same batches (8 x 64 tokens, the labels are the ids):

* ``zero3``: ``sf.shard_params(sf.functional(hf), mesh, "dp",
  reshard_after_forward="units")`` (default units: the model's ``_no_split_modules``, its
  ``LlamaDecoderLayer`` s; the root kept gathered for backward, as FSDP2 keeps its root),
  a torch.func step and the
  donated ``sf.optim.adamw``, against FSDP2 ``fully_shard`` on each decoder layer and then
  on the root (torch's recipe) with ``torch.optim.AdamW(foreach=True)``. A step is forward
  + backward + AdamW; each rank trains on its half of the batch.
* ``tp``: ``sf.tensor_split(sf.functional(hf), mesh, "tp", plan="auto")`` (the model's own
  ``tp_plan``), as a torch.func step and as an autograd step over the same ``tp.apply``,
  against ``parallelize_module`` with the same plan in torch's styles (``colwise`` ->
  ``ColwiseParallel()``, ``rowwise`` -> ``RowwiseParallel()``, ``embedding_rowwise`` ->
  ``RowwiseParallel(input_layouts=Replicate())``, ``colwise_gather_output`` ->
  ``ColwiseParallel(output_layouts=Replicate())``). A step is forward + backward of HF's own
  loss (``labels=``) on the whole batch; no optimizer.
* ``pp``: ``sf.pipeline_stages(hf, mesh, "pp", balance=[5, 5], microbatches=4)`` (1F1B)
  against ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``) over the
  same units (shardfn's ``hf_units``: the embedding with rotary, mask and positions, the
  layers, norm + head), the same split and HF's loss per micro-batch. Forward + backward.

Before timing, each system runs a *checked step* (``_hf_systems.checked_step``): its loss
must equal the unsharded HF module's on the same rows, else the row fails, and its full
gradients are compared with the peer's (the last column: the final parameters for ZeRO-3,
the last step's gradients for TP and PP).
A second step counts the bytes this rank sends, for torch and shardfn alike
(``_hf_comm.CountCollectives``: every process-group call and functional collective, ring
formulas of ``sf.comm_stats``), with shardfn's own ``sf.comm_stats()`` beside it (the
first step also sends what is sent once, such as activation shapes). Then each comparison runs
interleaved (``_common.run_interleaved``, the order rotating every round): the ratio is
the median over rounds of shardfn's step over torch's in the same round.

Run (about 2-3 minutes on 2 idle cores):
    .venv/bin/python benchmarks/bench_hf.py
    .venv/bin/python benchmarks/bench_hf.py --quick              # tiny Llama, a smoke test
    .venv/bin/python benchmarks/bench_hf.py --groups tp --steps 5
    .venv/bin/python benchmarks/bench_hf.py --quick --groups zero3 --wrong  # a wrong row
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from _common import BenchOutput, MiB, Result, machine_info, max_over_ranks, run_interleaved
from _hf_systems import QUICK, SYSTEMS, Config, Context, make_hf
from bench_pp import paired_ratio

#: comparison -> (title, torch's key, shardfn's keys)
GROUPS = {"zero3": ("HF ZeRO-3 vs fully_shard", "fsdp2", ("sf-zero3",)),
          "tp": ("HF TP plan=auto vs parallelize_module", "torch-tp", ("sf-tp-autograd",
                                                                       "sf-tp")),
          "pp": ("HF PP 1F1B vs pipelining", "torch-pp", ("sf-pp",))}


def rank_main(args: argparse.Namespace) -> tuple[dict, dict, float]:
    """Every comparison on this rank: ``({group: [Result, ...]}, checks, seconds)``."""
    torch.set_num_threads(1)
    ctx = Context(QUICK if args.quick else Config(), args.warmup + args.steps)
    log = (lambda msg: print(msg, flush=True)) if ctx.rank == 0 else (lambda msg: None)
    t0, results = time.perf_counter(), {}
    for group in args.groups:
        _, peer, ours = GROUPS[group]
        ours += ("sf-zero3-wrong",) if args.wrong and group == "zero3" else ()
        results[group] = run_interleaved(ctx, SYSTEMS, [peer, *ours], warmup=args.warmup,
                                         steps=args.steps, reference=peer, log=log)
        ctx.trees.clear()
        for key in (peer, *ours):  # the median CPU time of the timed rounds, max over ranks
            timed = ctx.cpu.get(key, [])[args.warmup:]
            cpu = max_over_ranks(statistics.median(timed) if timed else -1.0)
            ctx.checks.setdefault(key, {})["cpu"] = cpu if cpu >= 0 else None
    return results, ctx.checks, time.perf_counter() - t0


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / MiB:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "—"


def _row(title: str, r: Result, peer: Result, checks: dict) -> str:
    if r.error or not r.times_s:
        return f"| {title} | {r.label} | failed: {r.error or 'no steps'} " + "| " * 11 + "|"
    q = statistics.quantiles(r.times_s, n=4, method="inclusive") if len(r.times_s) > 1 \
        else r.times_s * 3
    check, peer_check = checks.get(r.key, {}), checks.get(peer.key, {})
    mine = r is not peer and peer.times_s and not peer.error
    ratio = f"{paired_ratio(r.times_s, peer.times_s):.3f}" if mine else "—"
    cpu = "—" if check.get("cpu") is None else f"{check['cpu'] * 1e3:.0f}"
    if mine and check.get("cpu") is not None:
        cpu += f" ({_ratio(check['cpu'], peer_check.get('cpu'))})"
    sent = _ratio(check.get("sent"), peer_check.get("sent")) if mine else "—"
    memory = _ratio(sum(r.memory.values()), sum(peer.memory.values())) if mine else "—"
    loss = f"{check['loss']:.5f} ({check['reference']:.5f})" if check else "—"
    diff = "—" if check.get("diff") is None else f"{check['diff']:.1e}"
    end = "—" if r is peer or r.max_rel_diff is None else f"{r.max_rel_diff:.1e}"
    return (f"| {title} | {r.label} | {statistics.median(r.times_s) * 1e3:.0f} "
            f"| {q[0] * 1e3:.0f}–{q[2] * 1e3:.0f} | {ratio} | {cpu} | {_mib(check.get('sent'))} "
            f"| {sent} | {_mib(check.get('comm_stats'))} | {sum(r.memory.values()) / MiB:.1f} "
            f"| {memory} | {loss} | {diff} | {end} |")


def table(results: dict, checks: dict) -> str:
    """The markdown table: one row per system, shardfn's ratios against its peer's."""
    lines = ["| comparison | system | median ms | p25–p75 ms | ratio sf/torch (target ≤ 1.0) "
             "| CPU ms/step/rank (ratio) | sent MiB/step/rank (max) | sent ratio sf/torch "
             "| sf.comm_stats MiB "
             "| MiB/rank p+g+opt | memory ratio sf/torch | first loss (HF's) "
             "| rel diff vs torch after the checked step | at the end |",
             "|---" * 2 + "|---:" * 12 + "|"]
    for group, group_results in results.items():
        peer = group_results[0]
        lines += [_row(GROUPS[group][0], r, peer, checks) for r in group_results]
    return "\n".join(lines)


def details(results: dict, checks: dict) -> str:
    """Per system: the collectives of its counted step and its memory per rank (a table)."""
    lines = ["| system | collectives of the counted step, rank 0 (calls x op: KiB sent) "
             "| sf.comm_stats (op: KiB) | memory per rank p + g + opt (KiB) |",
             "|---|---|---|---|"]
    for r in (r for group in results.values() for r in group):
        check = checks.get(r.key, {})
        ops = ", ".join(f"{calls} x {op}: {nbytes / 1024:.1f}" for op, (calls, nbytes)
                        in sorted(check.get("by_op", {}).items()))
        own = ", ".join(f"{op}: {nbytes / 1024:.1f}" for op, nbytes
                        in sorted((check.get("comm_stats_by_op") or {}).items()))
        memory = " + ".join(f"{v / 1024:.0f}" for v in r.memory.values())
        lines.append(f"| {r.label} | {ops or '—'} | {own or '—'} | {memory or '—'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local CPU ranks (gloo)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per system")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS),
                        help="comparisons to run, in table order")
    parser.add_argument("--quick", action="store_true", help="tiny Llama and 1+3 steps")
    parser.add_argument("--wrong", action="store_true",
                        help="add a deliberately wrong ZeRO-3 row (gradients summed, not "
                             "averaged) to show the gradient column catches it")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import bench_hf  # the ranks unpickle bench_hf.rank_main by reference, not __main__'s copy

    from shardfn.testing import local_world

    cfg = QUICK if args.quick else Config()
    n_params = sum(p.numel() for p in make_hf(cfg).parameters())
    out = BenchOutput("hf")
    print(f"$ {out.command}")
    print(machine_info())
    out.setup(f"Model: HF LlamaForCausalLM, {cfg.layers} layers, d={cfg.hidden}, {cfg.heads} "
              f"heads ({cfg.kv_heads} kv), mlp {cfg.intermediate}, vocab {cfg.vocab}, sdpa: "
              f"{n_params / 1e6:.2f}M params; batch {cfg.batch}x{cfg.seq} tokens (ZeRO-3: "
              f"split over the ranks), {cfg.microbatches} micro-batches (pp); {args.ranks} "
              f"ranks, {args.warmup}+{args.steps} steps per system, interleaved.")
    with local_world(args.ranks, timeout=600.0, check=False) as world:
        results, checks, seconds = world.run(bench_hf.rank_main, args)[0]
    print()
    out.table(table(results, checks),
              "Each comparison: torch's system first, then shardfn's on the same model, "
              "batches and split: step time on rank 0, CPU time per rank, bytes sent per rank "
              "per step (counted at the process group, and by sf.comm_stats), memory per rank, "
              "the first loss (HF's own in brackets) and the parameters' relative difference "
              "from torch's.",
              ratio="ratio sf/torch", peer="torch's system of the same comparison",
              quantity="step time", label=(1,))
    out.table(details(results, checks),
              "The collectives of the counted step on rank 0 and the memory per rank.")
    print(f"\nRun took {seconds:.0f} s.")
    out.save(args.results)


if __name__ == "__main__":
    main()
