"""Pipeline step time and bubble: shardfn's pipeline_stages against torch.distributed.pipelining.

The same model (8 residual MLP blocks of bench_dp.py, d=512, and the final projection:
9 units, 17M parameters), the same split into stages (balanced by parameter count),
the same batch (8 x 64 x 512, 4 micro-batches) and the same schedule, on N local CPU
ranks (gloo, one thread per rank), measured in one run, interleaved in rounds: in
every round each schedule's two systems run back to back, in alternating order. A
step is the forward and backward of the whole batch (MSE loss), no optimizer.

Per schedule (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank, ZB-H1) the table
gives: median step time, shardfn's ratio to torch on the same schedule (target <= 1:
the median over the timed rounds of the paired ratio, shardfn's step over torch's in
the same round, so that load drifting on a shared machine cancels out), the measured
bubble (idle fraction of the span from the first to the last compute on any rank,
median over the timed steps), the textbook bubble, the bubble simulated with
the measured median F/B/W times, and the largest relative difference of the last
step's gradients from torch GPipe's. Timelines of the last step are written as PNGs.

Run (a few minutes on 2 idle cores):
    .venv/bin/python benchmarks/bench_pp.py
    .venv/bin/python benchmarks/bench_pp.py --quick            # tiny model, smoke test
    .venv/bin/python benchmarks/bench_pp.py --schedules 1f1b   # a subset

torch's rows: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``, and ``ScheduleInterleavedZeroBubble`` with one stage per
rank (its ZB1P order is ZB-H1's). Their F/B/W times come from wrapping each stage's
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    MALLOC_CACHE_ENV,
    BenchOutput,
    Registry,
    System,
    machine_info,
    run_interleaved,
    storage_bytes,
)
from torch import nn

from shardfn.transforms.pipeline.balance import balance_units
from shardfn.transforms.pipeline.schedules import make_schedule
from shardfn.transforms.pipeline.simulate import simulate, theoretical_bubble
from shardfn.transforms.pipeline.timeline import (
    COMPUTE,
    TimelineEvent,
    from_actions,
    gather_events,
    measured_bubble,
    plot,
)

SYSTEMS = Registry()
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1")
TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                 "interleaved": "ScheduleInterleaved1F1B",
                 "zb-h1": "ScheduleInterleavedZeroBubble"}
IMG_DIR = Path(__file__).resolve().parents[1] / "docs" / "img"


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and batch shared by every system."""

    d: int = 512
    hidden: int = 2048
    blocks: int = 8
    batch: int = 8
    tokens: int = 64
    microbatches: int = 4
    virtual: int = 2  # stages per rank for the interleaved schedule
    seed: int = 0


QUICK = Config(d=32, hidden=64, blocks=4, batch=8, tokens=8)


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` (bench_dp.py's block)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def schedule_of(key: str) -> str:
    """The schedule a system key runs (``"sf-1f1b"`` -> ``"1f1b"``)."""
    return "1f1b" if key == "sf-wrong" else key.split("-", 1)[1]


def virtual_of(name: str, cfg: Config) -> int:
    return cfg.virtual if name == "interleaved" else 1


class Context:
    """The config, the batches (the whole batch on every rank), the units, the records."""

    def __init__(self, cfg: Config, warmup: int, total_steps: int):
        self.cfg, self.warmup = cfg, warmup
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.batches = []
        for i in range(total_steps):
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randn(cfg.batch, cfg.tokens, cfg.d, generator=g)
            self.batches.append((x, torch.randn(cfg.batch, cfg.tokens, cfg.d, generator=g)))
        #: key -> one list of this rank's events per timed step
        self.records: dict[str, list[list[TimelineEvent]]] = {}

    def make_units(self) -> nn.Sequential:
        """The model's units with the same initial weights for every system."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return nn.Sequential(*[Block(self.cfg.d, self.cfg.hidden)
                                   for _ in range(self.cfg.blocks)],
                                 nn.Linear(self.cfg.d, self.cfg.d))

    def balance(self, name: str, units: nn.Sequential) -> tuple[int, ...]:
        return balance_units(units, self.world * virtual_of(name, self.cfg), "params")

    def record(self, key: str, step: int, events: list[TimelineEvent]) -> None:
        if step >= self.warmup:
            self.records.setdefault(key, []).append(events)


def _full_tree(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``{full name: tensor}`` merged, on every rank."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach() for k, v in local.items()})
    return {k: v for part in parts for k, v in part.items()}


def _memory(params, grads) -> dict[str, int]:
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "opt_state": 0}


# ----------------------------------------------------------------------------- torch


def _timed(method, events: list, rank: int, kind: str, stage: int):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
            events.append(TimelineEvent(rank, kind, stage, int(mb), start, time.perf_counter()))

    return wrapper


def _torch_system(ctx: Context, name: str) -> System:
    from torch.distributed import pipelining

    units, p, rank = ctx.make_units(), ctx.world, ctx.rank
    v = virtual_of(name, ctx.cfg)
    counts = ctx.balance(name, units)
    bounds = [sum(counts[:s]) for s in range(len(counts) + 1)]
    events: list[TimelineEvent] = []
    stages, local = [], {}
    for s in range(rank, p * v, p):
        sub = nn.Sequential(*units[bounds[s]:bounds[s + 1]])
        for i in range(bounds[s], bounds[s + 1]):
            local.update({f"{i}.{n}": t for n, t in units[i].named_parameters()})
        stage = pipelining.PipelineStage(sub, s, p * v, torch.device("cpu"))
        stage.forward_one_chunk = _timed(stage.forward_one_chunk, events, rank, "F", s)
        stage.backward_one_chunk = _timed(stage.backward_one_chunk, events, rank, "B", s)
        stage.backward_weight_one_chunk = _timed(stage.backward_weight_one_chunk, events,
                                                 rank, "W", s)
        stages.append(stage)
    cls = getattr(pipelining, TORCH_CLASSES[name])
    multi = name in ("interleaved", "zb-h1")
    schedule = cls(stages if multi else stages[0], n_microbatches=ctx.cfg.microbatches,
                   loss_fn=loss_of)
    first, last = 0 in range(rank, p * v, p), (p * v - 1) % p == rank

    def step(i: int) -> None:
        for t in local.values():
            t.grad = None
        events.clear()
        x, y = ctx.batches[i]
        schedule.step(*((x,) if first else ()), target=y if last else None)
        ctx.record(f"torch-{name}", i, list(events))

    return System(step, lambda: _memory(local.values(), [t.grad for t in local.values()]),
                  lambda: _full_tree({k: t.grad for k, t in local.items()}))


# ----------------------------------------------------------------------------- shardfn


def _sf_system(ctx: Context, name: str, wrong: bool = False) -> System:
    import shardfn as sf
    from shardfn.transforms.pipeline import pipeline_stages  # sf.pipeline_stages once exported

    units = ctx.make_units()
    mesh = sf.Mesh({"pp": ctx.world})
    pp = pipeline_stages(units, mesh, "pp", balance=list(ctx.balance(name, units)),
                            schedule=name, microbatches=ctx.cfg.microbatches, loss_fn=loss_of,
                            virtual=virtual_of(name, ctx.cfg),
                            # declared like torch's stages, which infer them once: one message
                            # per activation instead of a shape header and then the payload
                            shapes=(ctx.cfg.batch // ctx.cfg.microbatches, ctx.cfg.tokens,
                                    ctx.cfg.d))
    state = dict(units.named_parameters())
    names = sorted(pp.init(ctx.cfg.seed))
    missing = [n for n in names if n not in state]
    if missing:
        raise KeyError(f"pipeline leaves {missing[:3]} are not the module's parameter names")
    params = {n: state[n].detach().clone() for n in names}
    last: dict[str, dict] = {"grads": {}}

    def step(i: int) -> None:
        x, y = ctx.batches[i]
        last["grads"] = {}  # freed before the step, as torch's rows set .grad = None
        _, grads, report = pp.value_and_grad(params, x, y, report=True)
        if wrong:  # the micro-batch sum without the 1/m: the gradient column must show it
            grads = {k: g * ctx.cfg.microbatches for k, g in grads.items()}
        last["grads"] = grads
        ctx.record("sf-wrong" if wrong else f"sf-{name}", i, from_actions(ctx.rank, report.events,
                                                 offset=report.start))

    return System(step, lambda: _memory(params.values(), last["grads"].values()),
                  lambda: _full_tree(last["grads"]), counts_comm=True)


def _register(name: str) -> None:
    SYSTEMS.register(f"torch-{name}", f"torch {TORCH_CLASSES[name]}")(
        lambda ctx: _torch_system(ctx, name))
    SYSTEMS.register(f"sf-{name}", f"shardfn pipeline_stages(schedule={name!r})")(
        lambda ctx: _sf_system(ctx, name))


for _name in SCHEDULE_NAMES:
    _register(_name)
SYSTEMS.register("sf-wrong", "deliberately wrong: shardfn 1F1B gradients times m",
                 default=False)(lambda ctx: _sf_system(ctx, "1f1b", wrong=True))


# ----------------------------------------------------------------------------- analysis


def _bubbles(ctx: Context, keys: list[str], img_dir: Path | None) -> dict[str, dict]:
    """Per system (rank 0): measured bubble (median over steps), median action times, PNG."""
    out: dict[str, dict] = {}
    for key in keys:
        steps = ctx.records.get(key, [])
        n = torch.tensor([len(steps)])
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        merged = [gather_events(steps[k]) for k in range(int(n.item()))]
        if ctx.rank != 0 or not merged or not any(merged[-1]):
            continue
        bubbles = [measured_bubble(events, ctx.world) for events in merged if events]
        times = {kind: statistics.median([e.end - e.start for events in merged for e in events
                                          if e.kind == kind] or [0.0]) for kind in COMPUTE}
        info = {"bubble": statistics.median(bubbles), "times": times,
                "per_rank": {(r, kind): statistics.median(
                    [sum(e.end - e.start for e in events if e.kind == kind and e.rank == r)
                     for events in merged] or [0.0])
                    for r in range(ctx.world) for kind in COMPUTE + ("recv",)}}
        if img_dir is not None and key != "sf-wrong":
            name = schedule_of(key)
            file = f"pipeline_timeline_{name}.png" if key.startswith("sf-") else \
                f"pipeline_timeline_torch_{name}.png"
            title = (f"{SYSTEMS.label(key)}: {ctx.world} ranks, {ctx.cfg.microbatches} "
                     f"micro-batches, last step\nmeasured bubble "
                     f"{info['bubble']:.1%} (median over the timed steps)")
            info["png"] = str(plot(merged[-1], img_dir / file, title=title, n_ranks=ctx.world))
        out[key] = info
    return out


def _theory(name: str, cfg: Config, p: int, times: dict[str, float]) -> tuple[float, float]:
    """(textbook bubble, bubble simulated with the measured median F / B (+W) times)."""
    v = virtual_of(name, cfg)
    textbook = theoretical_bubble(name, p, cfg.microbatches, v)
    schedule = make_schedule(name, p, cfg.microbatches, v)
    t_f, t_b, t_w = times["F"], times["B"], times["W"]
    if not t_f or not t_b:
        return textbook, float("nan")
    if schedule.split_backward:
        if not 0 < t_w:
            return textbook, float("nan")
        return textbook, simulate(schedule, t_f, t_b + t_w, t_w).bubble
    return textbook, simulate(schedule, t_f, t_b).bubble


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of ``ours[k] / theirs[k]`` over the rounds both ran (round ``k`` of each).

    Example:
        >>> paired_ratio([1.0, 2.0, 3.0], [1.0, 1.0, 3.0])
        1.0
    """
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=False))


def table(results, bubbles: dict[str, dict], cfg: Config, p: int) -> str:
    """The markdown table (times in ms)."""
    medians = {r.key: statistics.median(r.times_s) for r in results if r.times_s and not r.error}
    times = {r.key: r.times_s for r in results if r.times_s and not r.error}
    lines = ["| schedule | system | median ms | p25–p75 ms | ratio to torch | measured bubble "
             "| theory | simulated (measured F/B/W) | max rel diff of grads vs torch GPipe |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        name = schedule_of(r.key)
        if r.error or not r.times_s:
            lines.append(f"| {name} | {r.label} | failed: {r.error or 'no steps'} "
                         "| | | | | | |")
            continue
        q = statistics.quantiles(r.times_s, n=4, method="inclusive") if len(r.times_s) > 1 \
            else [r.times_s[0]] * 3
        peer = times.get(f"torch-{name}")
        ratio = f"{paired_ratio(r.times_s, peer):.3f}" if r.key.startswith("sf-") and peer \
            else "—"
        info = bubbles.get(r.key, {})
        textbook, simulated = _theory(name, cfg, p, info.get("times", {"F": 0, "B": 0, "W": 0}))
        measured = f"{info['bubble']:.1%}" if "bubble" in info else "—"
        diff = "—" if r.max_rel_diff is None else f"{r.max_rel_diff:.1e}"
        sim = "—" if simulated != simulated else f"{simulated:.1%}"
        lines.append(f"| {name} | {r.label} | {medians[r.key] * 1e3:.0f} | {q[0] * 1e3:.0f}–"
                     f"{q[2] * 1e3:.0f} | {ratio} | {measured} | {textbook:.1%} | {sim} "
                     f"| {diff} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def rank_main(args: argparse.Namespace):
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else Config()
    ctx = Context(cfg, args.warmup, args.warmup + args.steps)
    log = (lambda msg: print(msg, flush=True)) if ctx.rank == 0 else (lambda msg: None)
    t0 = time.perf_counter()
    keys = [f"{side}-{name}" for name in args.schedules for side in ("torch", "sf")]
    keys += ["sf-wrong"] if args.wrong else []
    reference = "torch-gpipe" if "gpipe" in args.schedules else keys[0]
    results = run_interleaved(ctx, SYSTEMS, keys, warmup=args.warmup, steps=args.steps,
                              reference=reference, log=log, pairs=True)
    bubbles = _bubbles(ctx, keys, Path(args.img_dir))
    return results, bubbles, time.perf_counter() - t0, ctx.balance("1f1b", ctx.make_units()), \
        ctx.balance("interleaved", ctx.make_units())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local CPU ranks (gloo)")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per system")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULE_NAMES),
                        choices=SCHEDULE_NAMES, help="schedules to run, in table order")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    parser.add_argument("--wrong", action="store_true",
                        help="add a deliberately wrong row (1F1B gradients times m) to show "
                             "the gradient column catches it")
    parser.add_argument("--malloc-cache", action="store_true",
                        help="start the ranks with glibc malloc keeping freed memory (no mmap, "
                             "no trim), so fresh large tensors do not page-fault (both systems)")
    parser.add_argument("--detail", action="store_true",
                        help="also print each rank's summed F/B/W and receive-wait times")
    parser.add_argument("--img-dir", default=None,
                        help="where the timeline PNGs go (default docs/img; --quick: a "
                             "temporary directory)")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    if args.img_dir is None:
        args.img_dir = tempfile.mkdtemp(prefix="bench_pp_") if args.quick else str(IMG_DIR)
    Path(args.img_dir).mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from shardfn.testing import local_world

    cfg = QUICK if args.quick else Config()
    n_params = sum(p.numel() for p in nn.Sequential(
        *[Block(cfg.d, cfg.hidden) for _ in range(cfg.blocks)], nn.Linear(cfg.d, cfg.d))
        .parameters())
    if args.malloc_cache:  # read by glibc when the spawned ranks start
        os.environ.update(MALLOC_CACHE_ENV)
    malloc = " ".join(f"{k}={os.environ[k]}" for k in MALLOC_CACHE_ENV if k in os.environ)
    out = BenchOutput("pp")
    print(f"$ {out.command}")
    print(machine_info())
    out.setup(f"Model: {cfg.blocks} blocks + projection, d={cfg.d}, hidden={cfg.hidden}, "
              f"{n_params / 1e6:.2f}M params; batch {cfg.batch}x{cfg.tokens}x{cfg.d}, "
              f"{cfg.microbatches} micro-batches; {args.ranks} ranks; "
              f"{args.warmup}+{args.steps} steps per system, interleaved; a step = forward + "
              f"backward, no optimizer; malloc: {malloc or 'glibc defaults'}.")
    with local_world(args.ranks, timeout=900.0, check=False) as world:
        results, bubbles, seconds, balance, balance_v = world.run(rank_main, args)[0]
    out.setup(f"Stages balanced by parameter count: {list(balance)} (interleaved, "
              f"{cfg.virtual} per rank: {list(balance_v)}).")
    out.table(table(results, bubbles, cfg, args.ranks),
              "Each shardfn schedule against torch's on the same stages, run back to back in "
              "every round: step time on rank 0, the median of the per-round ratios, the "
              "pipeline bubble measured on the last step's timeline beside the textbook "
              "value and a simulation with the measured forward/backward times, and the "
              "gradients' largest relative difference from torch GPipe's.",
              ratio="ratio to torch", peer="torch.distributed.pipelining, same schedule",
              quantity="step time", label=(1,))
    if args.detail:
        print("\nper rank, median over steps of the step's summed F / B / W / recv-wait ms:")
        for key, info in bubbles.items():
            cells = "  ".join(f"r{r}: " + "/".join(f"{info['per_rank'][(r, k)] * 1e3:.1f}"
                                                   for k in ("F", "B", "W", "recv"))
                              for r in range(args.ranks))
            print(f"  {key:16s} {cells}")
    for key, info in bubbles.items():
        if "png" in info:
            out.plot(info["png"], f"{SYSTEMS.label(key)}: the last step's timeline")
    print(f"Run took {seconds:.0f} s.")
    out.save(args.results)


if __name__ == "__main__":
    main()
