"""Whole pure steps under ``torch.compile`` against the same steps run eagerly, and their peers.

Each row is one pure training step ``(params, opt_state, x, y) -> (params, opt_state)``
made of ``torch.func.grad_and_value``, the transform's reductions and the AdamW
update, run two ways from the same start on the same batches: eagerly, and as
``torch.compile(step, fullgraph=True, dynamic=False)`` (inductor by default; on a
CPU its C++ backend). Rows:

* ``pmean``: the gradients averaged with ``sf.pmean`` (no bucketing);
* ``dp`` / ``dp-pure``: ``sf.data_parallel(...).reduce_grads``, donated / not donated;
* ``zero1``: ``sf.shard_opt_state`` (ZeRO-1, donated);
* ``zero3``: ``sf.shard_params`` per block (ZeRO-3, donated);
* ``tp-sp``: ``sf.tensor_split`` of the reference GPT with sequence parallelism
  (``gpt_tp_plan(sequence_parallel=True)``) and a vocab-parallel loss;
* ``pmean-autocast`` (not run by default; ``gpu.sh`` runs it): the ``pmean`` step with
  the forward under ``torch.autocast(device, bfloat16)`` (its peer: DDP in float32).

The model and batches of the data-parallel rows are those of ``bench_dp.py``
(peer: torch DDP + ``torch.optim.AdamW``); the TP row's are ``bench_tp.py``'s
GPT + SP (peer: torch ``parallelize_module`` with its SP plan). Peers run eagerly.

How it is measured: the first call of a compiled step (tracing and code
generation) runs in the first unmeasured round, on copies of the initial state,
once every system is built; its time, the largest over the ranks, is the "compile
s" column and is left out of the step times. Every system runs ``--warmup`` (at
least 1) unmeasured and ``--steps`` measured steps,
interleaved in rotating rounds with a barrier around each step (``_common.
run_interleaved``); a table cell is the median step time on rank 0. "recompiles"
counts the graphs dynamo compiled after that first call (0 is the goal: one
graph for every step). "max rel diff" compares the compiled run's final
parameters with the eager run's (``max|a-b| / max|b|`` per leaf, the largest):
inductor's fused kernels round differently, and AdamW's normalisation makes
round-off grow over the steps (the TP row leaves out the key part of each fused qkv
bias, as ``bench_tp.py`` does: its true gradient is zero, so Adam turns round-off
into steps of about ``lr`` there). A step that does not compile yet is shown as
"does not compile: <the error's first line>"; the other rows still run.

Run (2 CPU ranks):
    .venv/bin/python benchmarks/bench_compile.py --quick                 # tiny model, smoke test
    .venv/bin/python benchmarks/bench_compile.py --systems pmean zero3
    .venv/bin/python benchmarks/bench_compile.py --backend aot_eager     # no code generation
    .venv/bin/python benchmarks/bench_compile.py --systems zero1 zero3 --profile   # + top ops
    .venv/bin/python benchmarks/bench_compile.py --systems zero1 zero3 tp-sp --overlap  # + options
    .venv/bin/python benchmarks/bench_compile.py --device cuda --world 1 # one GPU (NCCL group of 1)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_dp
import bench_tp
import torch
import torch.distributed as dist
from _common import BenchOutput, Registry, Result, System, machine_info, max_over_ranks, rel_diff

SYSTEMS = Registry()
COMPILED = "+compiled"  # suffix of a compiled system's key
OVERLAP = "+overlap"  # suffix of a compiled system's key with sf.overlap_options()


class Variant(NamedTuple):
    """One row: a pure step, built on every rank by ``build(ctx) -> PureStep``."""

    key: str
    label: str
    peer: str  # the key of the torch system it is compared with
    build: Callable[[Any], PureStep]
    default: bool = True


class PureStep(NamedTuple):
    """A pure step and what it starts from.

    Attributes:
        step: ``step(params, opt_state, x, y) -> (params, opt_state)``.
        params: the initial parameters (full or this rank's shards).
        state: the initial optimizer state.
        batch: ``batch(i) -> (x, y)`` of this rank for step ``i``.
        full: ``full(params) -> {name: full tensor}``, the same on every rank.
    """

    step: Callable
    params: Any
    state: Any
    batch: Callable[[int], tuple]
    full: Callable[[Any], dict[str, torch.Tensor]]


# ----------------------------------------------------------------------------- context


class Context(bench_dp.Context):
    """``bench_dp.Context`` on ``device``, with the TP model, compile options and what the
    compiled systems record (compile seconds and graphs compiled after the first call)."""

    def __init__(self, args: argparse.Namespace):
        cfg = bench_dp.QUICK if args.quick else bench_dp.Config()
        super().__init__(cfg, args.warmup + args.steps)
        self.device = torch.device(args.device)
        self.batches = [(x.to(self.device), y.to(self.device)) for x, y in self.batches]
        self.backend = args.backend
        self.tp_settings = bench_tp.QUICK if args.quick else bench_tp.FULL
        self.total_steps = args.warmup + args.steps
        self._tp_model = None
        self._tp_mesh = None
        self.built: dict[str, System] = {}
        self.keep: list[PureStep] = []  # every model built, alive to the end
        self.compile_s: dict[str, float] = {}
        self.recompiles: dict[str, int] = {}

    def make_module(self) -> bench_dp.MLPModel:
        return super().make_module().to(self.device)

    @property
    def tp_model(self):
        """``bench_tp``'s GPT + SP model: factory, batches (every rank all of them)."""
        if self.device.type != "cpu":
            raise NotImplementedError("the TP rows run on CPU only (bench_tp's torch peer "
                                      "builds a CPU device mesh)")
        if self._tp_model is None:
            self._tp_model = bench_tp.build_model("gpt-sp", self.tp_settings, self.total_steps)
        return self._tp_model

    @property
    def tp_mesh(self):
        import shardfn as sf

        if self._tp_mesh is None:
            self._tp_mesh = sf.Mesh({"tp": self.world})
        return self._tp_mesh


# ----------------------------------------------------------------------------- pure steps


def make_step(loss_fn: Callable, reduce: Callable, opt, donate: bool) -> Callable:
    """``step(params, opt_state, x, y)``: gradients of ``loss_fn``, ``reduce``d, ``opt``'s
    update, ``apply_updates`` (donating the old parameters when ``donate``)."""
    import shardfn as sf

    def step(params, state, x, y):
        grads, _ = torch.func.grad_and_value(loss_fn)(params, x, y)
        grads = reduce(grads)
        updates, state = opt.update(grads, state, params)
        return sf.optim.apply_updates(params, updates, donate=donate), state

    return step


def _identity(tree):
    return tree


def _dp_step(ctx: Context, kind: str, autocast: bool = False) -> PureStep:
    """The pure steps of the data-parallel family on ``bench_dp``'s model; ``autocast``:
    the forward under ``torch.autocast(device, bfloat16)``, the loss in float32."""
    import shardfn as sf

    model = sf.functional(ctx.make_module())
    params = ctx.initial_params()
    with torch.no_grad():  # the first apply fills the model's caches outside any trace
        model.apply(params, ctx.batch(0)[0])
    device_type = ctx.device.type

    def loss_fn(p, x, y):
        if not autocast:
            return bench_dp.loss_of(model.apply(p, x), y)
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = model.apply(p, x)
        return bench_dp.loss_of(out.float(), y)

    if kind == "pmean":
        opt, donate = bench_dp._adamw(ctx), False
        mesh = ctx.mesh  # made here: a Mesh is not built inside a traced step

        def reduce(grads):
            return sf.pmean(grads, "dp", mesh=mesh)
    elif kind in ("dp", "dp-pure"):
        donate = kind == "dp"
        opt = bench_dp._adamw(ctx, donate=donate)
        reduce = sf.data_parallel(ctx.mesh, "dp", donate=donate).reduce_grads
    elif kind == "zero1":
        opt = sf.shard_opt_state(bench_dp._adamw(ctx), ctx.mesh, "dp", donate=True)
        reduce, donate = _identity, True
    else:
        raise ValueError(f"unknown data-parallel step {kind!r}")
    return PureStep(make_step(loss_fn, reduce, opt, donate), params, opt.init(params),
                    ctx.batch, lambda p: p)


def _zero3_step(ctx: Context) -> PureStep:
    """``bench_dp``'s ZeRO-3 row: shard_params per Block, donated AdamW on the shards."""
    import shardfn as sf

    model = sf.shard_params(sf.functional(ctx.make_module()), ctx.mesh, "dp",
                            units=bench_dp.Block)
    shards = model.shard(ctx.initial_params())
    with torch.no_grad():
        model.apply(shards, ctx.batch(0)[0])
    opt = bench_dp._adamw(ctx, donate=True)

    def loss_fn(s, x, y):
        return bench_dp.loss_of(model.apply(s, x), y)

    return PureStep(make_step(loss_fn, _identity, opt, True), shards, opt.init(shards),
                    ctx.batch, lambda s: sf.gather(s, model.specs, ctx.mesh))


def _tp_step(ctx: Context) -> PureStep:
    """``bench_tp``'s GPT + SP torch.func step (donated AdamW, vocab-parallel loss)."""
    import shardfn as sf
    from shardfn.models import gpt_tp_plan

    model, mesh = ctx.tp_model, ctx.tp_mesh
    tp = sf.tensor_split(sf.functional(model.make_module()), mesh, "tp",
                         gpt_tp_plan(sequence_parallel=True))
    params = tp.shard_params_tree(bench_tp.initial_params(model))
    with torch.no_grad():
        tp.apply(params, model.batches[0][0])
    settings = model.settings
    opt = sf.optim.donating(sf.optim.adamw(settings.lr, weight_decay=settings.weight_decay))

    def loss_fn(p, x, y):  # the logits stay vocab-split
        return sf.vocab_parallel_cross_entropy(tp.apply(p, x), y, "tp", mesh=mesh)

    def full(p):  # the key bias left out: its true gradient is 0, Adam amplifies round-off
        with torch.no_grad():
            return bench_tp.without_key_bias(tp.gather_params(p))

    return PureStep(make_step(loss_fn, _identity, opt, True), params, opt.init(params),
                    lambda i: model.batches[i], full)


def _graph_break_step(ctx: Context) -> PureStep:
    """The pmean step with a graph break in it: its compiled row must say so."""
    pure = _dp_step(ctx, "pmean")

    def step(params, state, x, y):
        torch._dynamo.graph_break()
        return pure.step(params, state, x, y)

    return pure._replace(step=step)


VARIANTS = (
    Variant("pmean", "pmean (grads averaged by sf.pmean)", "ddp",
            lambda ctx: _dp_step(ctx, "pmean")),
    Variant("dp", "data_parallel (donated)", "ddp", lambda ctx: _dp_step(ctx, "dp")),
    Variant("dp-pure", "data_parallel (not donated)", "ddp", lambda ctx: _dp_step(ctx, "dp-pure")),
    Variant("zero1", "ZeRO-1 shard_opt_state (donated)", "ddp", lambda ctx: _dp_step(ctx, "zero1")),
    Variant("zero3", "ZeRO-3 shard_params per block (donated)", "ddp", _zero3_step),
    Variant("tp-sp", "TP + SP tensor_split (GPT, donated)", "torch-tp", _tp_step),
    Variant("pmean-autocast", "pmean, forward under autocast(bfloat16)", "ddp",
            lambda ctx: _dp_step(ctx, "pmean", autocast=True), default=False),
    Variant("broken-graph-break", "check: pmean step with a graph break", "ddp",
            _graph_break_step, default=False),
)
BY_KEY = {v.key: v for v in VARIANTS}
PEERS = {"ddp": "torch DDP", "torch-tp": "torch parallelize_module (SP)"}


# ----------------------------------------------------------------------------- systems


def _clone(tree):
    import shardfn as sf

    return sf.pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def _sync(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


class DoesNotCompile(RuntimeError):
    """The first call of a compiled step failed (tracing or code generation)."""


def compile_error(error: BaseException) -> str:
    """The error's type and first line, and the last line of user code dynamo names
    (file name only: the report names no path of the machine).

    Example:
        >>> compile_error(RuntimeError('Unsupported: x\\nfrom user code:\\n  File "/a/mesh.py", '
        ...                            'line 70, in __init__'))
        'RuntimeError: Unsupported: x (at mesh.py:70, in __init__)'
    """
    text = str(error).strip()
    first = (text.splitlines() or [""])[0]
    where = ""
    if "from user code:" in text:
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)',
                            text.split("from user code:", 1)[1])
        if frames:
            path, line, fn = frames[-1]
            where = f" (at {os.path.basename(path)}:{line}, in {fn})"
    return f"{type(error).__name__}: {first}"[:100] + where  # the row shows 160 characters


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def pure_system(ctx: Context, variant: Variant, compiled: bool,
                overlap: bool = False) -> System:
    """``variant``'s step as a :class:`System`, eager or compiled (``overlap``: with
    ``sf.overlap_options()``, inductor only).

    A compiled step is compiled by its first call, in the first (unmeasured) round, once
    every system is built, on copies of the initial state: its time is ``compile s``.
    Every model built stays alive to the end of the run, failed ones included: freeing a
    functional model changes a global that dynamo guards in shardfn (``_functional_swap.
    _FLAGGED``), which makes every compiled step recompile, and the benchmark should not
    cause that itself.
    """
    key = variant.key + (COMPILED + (OVERLAP if overlap else "") if compiled else "")
    pure = variant.build(ctx)
    ctx.keep.append(pure)
    fn = pure.step
    if compiled:
        import shardfn as sf

        fn = torch.compile(pure.step, fullgraph=True, dynamic=False, backend=ctx.backend,
                           options=sf.overlap_options() if overlap else None)
    holder = {"params": pure.params, "state": pure.state, "compiled": not compiled}

    def compile_now() -> None:
        params, state = _clone(pure.params), _clone(pure.state)
        t0 = time.perf_counter()
        try:
            fn(params, state, *pure.batch(0))
            _sync(ctx)
        except Exception as e:  # noqa: BLE001 - the row says why, the others go on
            raise DoesNotCompile(compile_error(e)) from e
        ctx.compile_s[key] = time.perf_counter() - t0
        ctx.recompiles[key] = 0
        holder["compiled"] = True

    def step(i: int) -> None:
        if not holder["compiled"]:
            compile_now()
        x, y = pure.batch(i)
        before = _graphs() if compiled else 0
        holder["params"], holder["state"] = fn(holder["params"], holder["state"], x, y)
        _sync(ctx)
        if compiled:
            ctx.recompiles[key] += _graphs() - before

    system = System(step, lambda: {}, lambda: pure.full(holder["params"]))
    ctx.built[key] = system
    return system


def _register() -> None:
    for variant in VARIANTS:
        for compiled, overlap in ((False, False), (True, False), (True, True)):
            key = variant.key + (COMPILED + (OVERLAP if overlap else "") if compiled else "")
            how = ("compiled, overlap options" if overlap else "compiled") if compiled \
                else "eager"
            SYSTEMS.register(key, f"{variant.label}, {how}", default=variant.default)(
                lambda ctx, variant=variant, compiled=compiled, overlap=overlap:
                pure_system(ctx, variant, compiled, overlap))


_register()


@SYSTEMS.register("ddp", PEERS["ddp"])
def setup_ddp(ctx: Context) -> System:
    """``bench_dp``'s DDP peer (AdamW foreach), on ``ctx.device``."""
    system = bench_dp.setup_ddp(ctx)
    if ctx.device.type != "cuda":
        return system

    def step(i: int) -> None:
        system.step(i)
        _sync(ctx)

    return system._replace(step=step)


@SYSTEMS.register("torch-tp", PEERS["torch-tp"])
def setup_torch_tp(ctx: Context) -> System:
    """``bench_tp``'s torch TP peer on the GPT with sequence parallelism."""
    tp = bench_tp.setup_torch(ctx.tp_model, sequence_parallel=True)
    return System(tp.step, lambda: {}, tp.params)


# ----------------------------------------------------------------------------- running


def system_keys(variants: list[str], peers: bool, overlap: bool = False) -> list[str]:
    """The systems to run: each variant eager then compiled (then compiled with the overlap
    options), then the peers they need."""
    keys = [k for v in variants
            for k in (v, v + COMPILED, *([v + COMPILED + OVERLAP] if overlap else []))]
    if peers:
        keys += list(dict.fromkeys(BY_KEY[v].peer for v in variants))
    return keys


class RankOutput(NamedTuple):
    results: list[Result]
    compile_s: dict[str, float]
    recompiles: dict[str, int]
    diff: dict[str, float | None]  # variant -> compiled vs eager, max over ranks
    seconds: float
    profiles: dict[str, dict[str, tuple[float, int]]] = {}  # key -> op -> (self ms, calls)


def profile_step(ctx: Context, key: str, i: int) -> dict[str, tuple[float, int]]:
    """One more step of system ``key`` under ``torch.profiler`` (CPU): every op's self time
    (ms, this rank's main thread) and calls. The compiled graph's own C++ kernels count as
    the self time of its ``## Call CompiledFxGraph ...`` event (renamed ``compiled graph``).
    """
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("bench:step"):
            ctx.built[key].step(i)
    events = prof.profiler.function_events
    main = next(e.thread for e in events if e.name == "bench:step")
    out: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.thread != main or e.name == "bench:step":
            continue
        name = "compiled graph" if e.name.startswith("## Call CompiledFxGraph") else e.name
        ms, calls = out.get(name, (0.0, 0))
        out[name] = (ms + e.self_cpu_time_total / 1e3, calls + 1)
    return out


def rank_main(args: argparse.Namespace) -> RankOutput:
    """On every rank: build, compile and time the systems; compare compiled with eager."""
    import torch._dynamo
    from _common import run_interleaved

    torch.set_num_threads(1)
    torch._dynamo.reset()
    for name in ("recompile_limit", "cache_size_limit"):  # every row compiles the same step code
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    ctx = Context(args)
    log = (lambda msg: print(msg, flush=True)) if ctx.rank == 0 else (lambda msg: None)
    t0 = time.perf_counter()
    keys = system_keys(args.systems, not args.no_peers, args.overlap)
    results = run_interleaved(ctx, SYSTEMS, keys, warmup=args.warmup, steps=args.steps,
                              reference=None, log=log)
    ok = {r.key for r in results if r.error is None and r.times_s}
    diff: dict[str, float | None] = {}
    for variant in args.systems:  # the same collectives on every rank: `ok` is agreed
        diff[variant] = None
        if variant in ok and variant + COMPILED in ok:
            eager = ctx.built[variant].params()
            compiled = ctx.built[variant + COMPILED].params()
            diff[variant] = max_over_ranks(rel_diff(compiled, eager))
        if args.overlap:  # the reordered schedule must compute the same step
            diff[variant + OVERLAP] = None
            if variant in ok and variant + COMPILED + OVERLAP in ok:
                diff[variant + OVERLAP] = max_over_ranks(rel_diff(
                    ctx.built[variant + COMPILED + OVERLAP].params(),
                    ctx.built[variant].params()))
    compile_s = {k: max_over_ranks(ctx.compile_s.get(k, -1.0)) for k in keys if COMPILED in k}
    recompiles = {k: int(max_over_ranks(ctx.recompiles.get(k, -1))) for k in keys
                  if COMPILED in k}
    profiles = {}
    if args.profile:  # after the comparison: one more step of every system that ran
        for key in keys:
            if key in ok:
                profiles[key] = profile_step(ctx, key, ctx.total_steps - 1)
    return RankOutput(results, compile_s, recompiles, diff, time.perf_counter() - t0,
                      profiles)


def profile_table(out: RankOutput, top: int = 15) -> str:
    """Rank 0's top ops by self time in the profiled step, one column per system."""
    keys = list(out.profiles)
    ranked: dict[str, float] = {}
    for key in keys:
        for op, (ms, _) in out.profiles[key].items():
            ranked[op] = max(ranked.get(op, 0.0), ms)
    lines = ["| op (self ms / calls) | " + " | ".join(keys) + " |",
             "|---|" + "---:|" * len(keys)]
    for op in sorted(ranked, key=lambda o: -ranked[o])[:top]:
        cells = " | ".join("{:.1f} / {}".format(*out.profiles[k].get(op, (0.0, 0)))
                           for k in keys)
        lines.append(f"| `{op}` | {cells} |")
    totals = " | ".join(f"{sum(ms for ms, _ in out.profiles[k].values()):.0f}" for k in keys)
    lines.append(f"| all ops | {totals} |")
    return "\n".join(lines)


def run_world_of_one(args: argparse.Namespace) -> RankOutput:
    """:func:`rank_main` in this process, in a process group of one (NCCL on CUDA)."""
    import shardfn as sf

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    sf.check_consistency(False)  # as in the local world (check=False): eager rows unchecked
    try:
        return rank_main(args)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- table


@dataclasses.dataclass(frozen=True)
class Cells:
    """Rank 0's numbers of one system, as the table shows them."""

    median: float | None
    text: str  # the step-time cell: ms, or why there is none


def _cells(result: Result | None, compiled: bool) -> Cells:
    if result is None:
        return Cells(None, "not run")
    if result.error:
        mark = "DoesNotCompile: "
        text = (f"does not compile: {result.error.split(mark, 1)[1]}"
                if compiled and mark in result.error else f"failed: {result.error}")
        return Cells(None, text)
    if not result.times_s:
        return Cells(None, "no steps")
    median = statistics.median(result.times_s)
    return Cells(median, f"{median * 1e3:.1f}")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "—"


HEADER = ["step", "peer", "eager ms", "compiled ms", "compiled / eager", "eager / peer",
          "compiled / peer", "compile s", "recompiles", "max rel diff compiled vs eager"]
OVERLAP_HEADER = ["overlap options ms", "overlap / compiled", "max rel diff overlap vs eager"]


def table(variants: list[str], out: RankOutput, overlap: bool = False) -> str:
    """The markdown table: one row per variant (medians of rank 0's step times); with
    ``overlap`` two more columns: the step compiled with ``sf.overlap_options()``."""
    by_key = {r.key: r for r in out.results}
    header = HEADER + (OVERLAP_HEADER if overlap else [])
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for key in variants:
        variant = BY_KEY[key]
        eager = _cells(by_key.get(key), False)
        compiled = _cells(by_key.get(key + COMPILED), True)
        peer = _cells(by_key.get(variant.peer), False)
        seconds = out.compile_s.get(key + COMPILED, -1.0)
        recompiles = out.recompiles.get(key + COMPILED, -1)
        diff = out.diff.get(key)
        lines.append("| " + " | ".join([
            variant.label, PEERS[variant.peer], eager.text, compiled.text,
            _ratio(compiled.median, eager.median), _ratio(eager.median, peer.median),
            _ratio(compiled.median, peer.median),
            f"{seconds:.1f}" if seconds >= 0 and compiled.median else "—",
            str(recompiles) if recompiles >= 0 and compiled.median else "—",
            "—" if diff is None else f"{diff:.1e}",
            *_overlap_cells(by_key.get(key + COMPILED + OVERLAP), compiled, overlap,
                            out.diff.get(key + OVERLAP))]) + " |")
    return "\n".join(lines)


def _overlap_cells(result: Result | None, compiled: Cells, overlap: bool,
                   diff: float | None) -> list[str]:
    if not overlap:
        return []
    cells = _cells(result, True)
    return [cells.text, _ratio(cells.median, compiled.median),
            "—" if diff is None else f"{diff:.1e}"]


# ----------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", "--ranks", type=int, default=None, dest="world",
                        help="ranks (default: 2 local CPU ranks over gloo; 1 on --device cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend (inductor; aot_eager: no code generation)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per system")
    parser.add_argument("--systems", nargs="+", default=[v.key for v in VARIANTS if v.default],
                        choices=list(BY_KEY), metavar="ROW",
                        help=f"rows, in table order (all: {list(BY_KEY)}); each runs eager "
                             "and compiled")
    parser.add_argument("--no-peers", action="store_true", help="leave out DDP / torch TP")
    parser.add_argument("--overlap", action="store_true",
                        help="each row also compiled with sf.overlap_options() (inductor's "
                             "compute/communication reordering passes): two more columns")
    parser.add_argument("--quick", action="store_true", help="tiny models, 1+3 steps")
    parser.add_argument("--profile", action="store_true",
                        help="then one more step of every system under torch.profiler: "
                             "rank 0's top ops by self time")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    if args.world is None:
        args.world = 1 if args.device == "cuda" else 2
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda})")
        if args.world != 1:
            parser.error("--device cuda runs in one process (--world 1); more GPUs: torchrun")
        if "tp-sp" in args.systems:
            args.systems = [k for k in args.systems if k != "tp-sp"]
            print("note: the TP row runs on CPU only; left out on --device cuda", flush=True)
    if args.overlap and args.backend != "inductor":
        parser.error("--overlap sets inductor options: --backend inductor only")
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    args.warmup = max(args.warmup, 1)  # the compiling call is in the first round
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = BenchOutput("compile")
    print(f"$ {out.command}")
    print(machine_info())
    cfg = bench_dp.QUICK if args.quick else bench_dp.Config()
    gpt = (bench_tp.QUICK if args.quick else bench_tp.FULL).gpt
    psi = bench_dp.num_params(cfg)
    where = (f"{args.world} CPU rank{'s' if args.world > 1 else ''} (gloo, one thread each)"
             if args.device == "cpu" else "one CUDA device (a process group of one, NCCL)")
    out.setup(f"Data-parallel rows: bench_dp's model ({cfg.blocks} blocks, d={cfg.d}, "
              f"hidden={cfg.hidden}, {psi / 1e6:.2f}M params, global batch "
              f"{cfg.batch}x{cfg.tokens}); TP row: bench_tp's GPT (vocab {gpt.vocab_size}, "
              f"d={gpt.d_model}, {gpt.n_layers} layers, {gpt.n_heads} heads, seq {gpt.seq_len}, "
              f"batch {gpt.batch}) with sequence parallelism. AdamW; {where}; torch.compile("
              f"fullgraph=True, dynamic=False, backend={args.backend!r}); {args.warmup}+"
              f"{args.steps} steps per system after the compiling call, interleaved.")
    if args.world == 1:
        output = run_world_of_one(args)
    else:
        from shardfn.testing import local_world

        with local_world(args.world, timeout=900.0, check=False) as world:
            output = world.run(rank_main, args)[0]
    print()
    out.table(table(args.systems, output, args.overlap),
              "Each pure step eager and compiled (median step time on rank 0, between "
              "barriers), their ratio, each against its torch peer (eager), the compiling "
              "call's time (left out of the medians), graphs compiled after it, and the "
              "compiled run's parameters against the eager run's after the same steps.",
              ratio="compiled / eager", peer="the same step, eager", quantity="step time")
    if output.profiles:
        print("\nOne profiled step per system (torch.profiler, CPU, rank 0's main thread; "
              "the compiled graph's C++ kernels are its own self time; gloo runs the "
              "transfers on its own threads, so `wait_tensor` and `c10d::` ops hold the "
              "time spent waiting for them):\n")
        print(profile_table(output))
    print(f"\nRun took {output.seconds:.0f} s.")
    out.save(args.results)


if __name__ == "__main__":
    main()
