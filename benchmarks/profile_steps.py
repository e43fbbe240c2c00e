"""Where the pure step's time and memory go (#27): profiles of shardfn steps against their peers.

Builds the systems of ``bench_dp.py`` (torch DDP; shardfn ``data_parallel`` donated and
not; ``shard_params`` ZeRO-3) and of ``bench_tp.py`` (the GPT: torch
``parallelize_module`` and shardfn's torch.func step) with those scripts' own setup
code, on N local CPU ranks, and measures on rank 0, interleaving the systems step by step:

* timed rounds (no profiler): wall and CPU time of a step (``process_time``) and the
  minor page faults of a step (``getrusage`` ``ru_minflt`` deltas), medians;
* profiled rounds (``torch.profiler``, CPU): the self time of every op by phase
  (forward, backward, gradient reduction, optimizer, Python outside any op), the
  collectives, allocations (``aten::empty*`` and bytes allocated), copies
  (``copy_``/``clone``/``cat``/``_to_copy``) and the top ops by self time;
* one step per system under ``shardfn.memory.track`` with every allocation tagged
  ``phase:op`` (deterministic): the step's peak live bytes and what is alive at it.

Two *lever* variants of every torch.func step are measured beside it, built by the
same setup code with one thing changed, to split the cost of ``torch.func``:
``+nocg``: ``torch.func.grad_and_value`` whose inner ``autograd.grad`` runs with
``create_graph=False`` (torch.func always passes True: the backward then records a
double-backward graph and keeps every saved tensor until the step ends);
``+engine``: ``shardfn._functional_grad.grad_and_value`` in its place (the gradient
taken by the autograd engine on detached leaves, ``torch.autograd.grad`` first order,
the same loss function; no functorch at all).
Their final parameters are compared with the torch.func row's.

Run (a few minutes on 2 cores; results in docs/benchmarks.md, section #27):
    .venv/bin/python benchmarks/profile_steps.py
    .venv/bin/python benchmarks/profile_steps.py --quick                 # tiny models
    .venv/bin/python benchmarks/profile_steps.py --groups tp --profiled 2
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 2**20

#: per group: (key, what it is, the peer's key or None for a peer)
GROUPS: dict[str, list[tuple[str, str, str | None]]] = {
    "dp": [("ddp", "torch DDP", None),
           ("sf-dp", "data_parallel, torch.func, donated", "ddp"),
           ("sf-dp+nocg", "  the same, create_graph=False", "ddp"),
           ("sf-dp+engine", "  the same, autograd engine", "ddp"),
           ("sf-dp-pure", "data_parallel, torch.func, no donation", "ddp"),
           ("sf-dp-pure+nocg", "  the same, create_graph=False", "ddp"),
           ("sf-dp-pure+engine", "  the same, autograd engine", "ddp"),
           ("sf-shard-params", "shard_params (ZeRO-3), torch.func, donated", "ddp"),
           ("sf-shard-params+nocg", "  the same, create_graph=False", "ddp"),
           ("sf-shard-params+engine", "  the same, autograd engine", "ddp")],
    "tp": [("torch-tp", "torch TP (GPT)", None),
           ("sf-tp", "tensor_split GPT, torch.func", "torch-tp"),
           ("sf-tp+nocg", "  the same, create_graph=False", "torch-tp"),
           ("sf-tp+engine", "  the same, autograd engine", "torch-tp")],
}

COLLECTIVE_PREFIXES = ("c10d::", "gloo:", "_c10d_functional::", "c10d_functional::")
COPY_OPS = ("aten::copy_", "aten::clone", "aten::cat", "aten::_to_copy")
PHASES = ("forward", "backward", "reduce", "optimizer", "python")


# ----------------------------------------------------------------------------- phase labels

_PHASE: list[str] = []  # innermost last; read by the memory categories
_NO_CREATE_GRAPH = [False]


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A profiler label ``phase:<name>`` that also tags allocations (see :class:`_OpCategory`)."""
    _PHASE.append(name)
    try:
        with torch.profiler.record_function(f"phase:{name}"):
            yield
    finally:
        _PHASE.pop()


def labelled(name: str, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        with phase(name):
            return fn(*args, **kwargs)
    return call


def install_labels() -> None:
    """Label the phases of every system (on this rank, once): torch.func's backward,
    ``torch.Tensor.backward``, shardfn's optimizers, ``apply_updates`` and
    ``data_parallel``'s reduction; torch's optimizer steps through its global hooks."""
    from torch._functorch import eager_transforms

    import shardfn as sf
    import shardfn.optim as sf_optim

    if getattr(eager_transforms, "_profile_steps_labelled", False):
        return
    autograd_grad = eager_transforms._autograd_grad

    def grad_with_label(*args, **kwargs):
        if _NO_CREATE_GRAPH[0]:
            kwargs["create_graph"] = False
        with phase("backward"):
            return autograd_grad(*args, **kwargs)

    eager_transforms._autograd_grad = grad_with_label
    eager_transforms._profile_steps_labelled = True
    torch.Tensor.backward = labelled("backward", torch.Tensor.backward)
    torch.autograd.grad = labelled("backward", torch.autograd.grad)
    adamw, donating, apply_updates = sf_optim.adamw, sf_optim.donating, sf_optim.apply_updates
    sf_optim.adamw = lambda *a, **k: (lambda o: o._replace(
        update=labelled("optimizer", o.update)))(adamw(*a, **k))
    sf_optim.donating = lambda o: (lambda d: d._replace(
        update=labelled("optimizer", d.update)))(donating(o))
    sf_optim.apply_updates = labelled("optimizer", apply_updates)
    data_parallel = sf.data_parallel
    sf.data_parallel = lambda *a, **k: (lambda dp: dp._replace(
        reduce_grads=labelled("reduce", dp.reduce_grads)))(data_parallel(*a, **k))

    def pre(*_):
        _PHASE.append("optimizer")

    def post(*_):
        _PHASE.pop()

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


# ----------------------------------------------------------------------------- systems


class Built(NamedTuple):
    step: Callable[[int], None]
    params: Callable[[], dict[str, torch.Tensor]]


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def build(key: str, quick: bool, total_steps: int, cache: dict, tp_model: str = "gpt") -> Built:
    """Set up ``key`` with bench_dp's / bench_tp's own setup code (``+engine``: with
    ``torch.func.grad_and_value`` swapped for shardfn's engine ``grad_and_value`` during the
    setup; ``+nocg``: its steps run with ``create_graph=False``)."""
    import bench_dp
    import bench_tp

    base, _, lever = key.partition("+")
    from shardfn._functional_grad import grad_and_value as engine_grad_and_value

    swap = (_swapped(torch.func, "grad_and_value", engine_grad_and_value) if lever == "engine"
            else contextlib.nullcontext())
    with swap:
        if base.endswith("tp"):
            if "tp" not in cache:
                cache["tp"] = bench_tp.build_model(tp_model, bench_tp.QUICK if quick else
                                                   bench_tp.FULL, total_steps)
            setup = bench_tp.setup_torch if base == "torch-tp" else bench_tp.setup_shardfn
            system = setup(cache["tp"], False)
        else:
            if "dp" not in cache:
                cache["dp"] = bench_dp.Context(bench_dp.QUICK if quick else bench_dp.Config(),
                                               total_steps)
            system = bench_dp.SYSTEMS.setup(base)(cache["dp"])
    step = system.step
    if lever == "nocg":
        def step(i: int, inner=system.step) -> None:
            _NO_CREATE_GRAPH[0] = True
            try:
                inner(i)
            finally:
                _NO_CREATE_GRAPH[0] = False
    return Built(step, system.params)


# ----------------------------------------------------------------------------- profiles


def _phase_of(event) -> str:
    """The innermost labelled phase around ``event`` (``forward`` when none)."""
    e = event
    while e is not None:
        name = e.name
        if name.startswith("phase:") and name not in ("phase:grad", "phase:step"):
            return name[len("phase:"):]
        if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            return "optimizer"
        e = e.cpu_parent
    return "forward"


def summarize_profile(events, main_thread: int) -> dict[str, Any]:
    """Self times (ms) by phase and op, counts of collectives, allocations, copies."""
    out: dict[str, Any] = {"phase_ms": collections.Counter(), "op_ms": collections.Counter(),
                           "op_count": collections.Counter(), "alloc_bytes": 0, "allocs": 0,
                           "aten_ops": 0, "other_threads_ms": 0.0}
    for e in events:
        if e.name == "[memory]":  # a free outside any op
            continue
        if e.self_cpu_memory_usage > 0:  # what the op allocated (less what it freed itself)
            out["alloc_bytes"] += e.self_cpu_memory_usage
            out["allocs"] += 1
        ms = e.self_cpu_time_total / 1e3
        if e.thread != main_thread:
            out["other_threads_ms"] += ms
            continue
        label = e.name.startswith(("phase:", "Optimizer.step#", "Optimizer.zero_grad#",
                                   "DistributedDataParallel.forward"))
        out["phase_ms"]["python" if label else _phase_of(e)] += ms
        if label:
            continue
        out["op_ms"][e.name] += ms
        out["op_count"][e.name] += 1
        out["aten_ops"] += e.name.startswith("aten::")
    return out


def _merge(summaries: list[dict]) -> dict[str, Any]:
    """Medians over the profiled steps (per phase, per op; counts from the median step)."""
    def med(values):
        return statistics.median(values) if values else 0.0
    keys_phase = {k for s in summaries for k in s["phase_ms"]}
    keys_op = {k for s in summaries for k in s["op_ms"]}
    return {"phase_ms": {k: med([s["phase_ms"][k] for s in summaries]) for k in keys_phase},
            "op_ms": {k: med([s["op_ms"][k] for s in summaries]) for k in keys_op},
            "op_count": {k: med([s["op_count"][k] for s in summaries]) for k in keys_op},
            **{k: med([s[k] for s in summaries])
               for k in ("alloc_bytes", "allocs", "aten_ops", "other_threads_ms")}}


# ----------------------------------------------------------------------------- memory


def memory_of_step(step: Callable[[], None]) -> dict[str, Any]:
    """One step under ``shardfn.memory.track``, allocations tagged ``phase:op``.

    Returns the peak live bytes of the tensors the step allocates, what was alive
    at that peak by ``phase:op``, and the bytes still alive after the step.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    import shardfn.memory as mem

    class _OpCategory(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch._C._current_graph_task_id() != -1:
                where = "backward"
            else:
                where = next((p for p in reversed(_PHASE) if p != "grad"), "forward")
            with mem.category(f"{where}:{func.__name__}"):
                return func(*args, **(kwargs or {}))

    with mem.track() as tracker, _OpCategory():
        step()
    return {"peak": tracker.peak_bytes, "at_peak": dict(tracker.peak_by_category),
            "after": tracker.current_bytes}


# ----------------------------------------------------------------------------- driver


def keep_freed_memory() -> None:
    """Tell glibc malloc (this process, from now on) to serve large blocks from the heap
    and keep what is freed: ``mallopt`` ``M_MMAP_THRESHOLD`` 32 MiB (its maximum),
    ``M_TRIM_THRESHOLD`` and ``M_TOP_PAD`` 1 GiB. A freed model-sized tensor's pages are
    then reused by the next one instead of unmapped and faulted in again."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    for option, value in ((m_mmap_threshold, 32 * MiB), (m_trim_threshold, 1024 * MiB),
                          (m_top_pad, 1024 * MiB)):
        if libc.mallopt(option, value) != 1:
            raise RuntimeError(f"mallopt({option}, {value}) failed")


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    if args.keep_freed_memory:
        keep_freed_memory()
    install_labels()
    from _common import max_over_ranks, rel_diff

    keys = [key for group in args.groups for key, _, _ in GROUPS[group]
            if args.systems is None or key in args.systems]
    total = args.warmup + args.steps + args.profiled + 1
    cache: dict = {}
    systems, errors = {}, {}
    for key in keys:
        try:
            systems[key] = build(key, args.quick, total, cache, args.tp_model)
        except Exception as e:  # noqa: BLE001 - a variant that cannot be built is reported
            errors[key] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    timed = {k: {"wall": [], "cpu": [], "minflt": []} for k in systems}
    profiles: dict[str, list] = {k: [] for k in systems}
    main_thread = None
    for r in range(args.warmup + args.steps + args.profiled):
        order = list(systems)
        order = order[r % len(order):] + order[:r % len(order)]
        for key in order:
            dist.barrier()
            if r < args.warmup + args.steps:
                flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0, c0 = time.perf_counter(), time.process_time()
                systems[key].step(r)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0
                if r >= args.warmup:
                    timed[key]["wall"].append(wall * 1e3)
                    timed[key]["cpu"].append(cpu * 1e3)
                    timed[key]["minflt"].append(flt)
            else:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            profile_memory=True) as prof:
                    with torch.profiler.record_function("phase:step"):
                        systems[key].step(r)
                events = prof.profiler.function_events
                if main_thread is None:
                    main_thread = next(e.thread for e in events if e.name == "phase:step")
                profiles[key].append(summarize_profile(events, main_thread))
        if dist.get_rank() == 0:
            print(f"  round {r + 1}/{args.warmup + args.steps + args.profiled}", flush=True)
    memory = {key: memory_of_step(lambda s=systems[key]: s.step(total - 1)) for key in systems}
    from bench_tp import step_peak_bytes  # bench_tp's VmHWM method, max over ranks
    for key in systems:
        memory[key]["vmhwm"] = max_over_ranks(step_peak_bytes(
            lambda s=systems[key]: s.step(total - 1)))
    diffs = {}
    for key in systems:
        base = key.partition("+")[0]
        if base != key and base in systems:
            diffs[key] = max_over_ranks(rel_diff(systems[key].params(), systems[base].params()))
    return {"timed": {k: {m: statistics.median(v) for m, v in t.items()} for k, t in timed.items()},
            "profiles": {k: _merge(v) for k, v in profiles.items() if v},
            "memory": memory, "diffs": diffs, "errors": errors, "keys": keys}


# ----------------------------------------------------------------------------- tables


def tables(result: dict[str, Any], groups: list[str], top: int, tp_model: str = "gpt") -> str:
    """The markdown tables of one run (rank 0's numbers); ``tp_model`` names the tp rows'."""
    timed, prof, memory = result["timed"], result["profiles"], result["memory"]
    lines: list[str] = []
    for group in groups:
        rows = [(k, what.replace("GPT", tp_model.upper()) if group == "tp" else what, peer)
                for k, what, peer in GROUPS[group] if k in prof]
        failed = [(k, result["errors"][k]) for k, _, _ in GROUPS[group] if k in result["errors"]]
        lines += [f"\n#### {group}: time by phase (ms of a step, rank 0; medians)\n",
                  "| system | wall ms (ratio) | CPU ms (ratio) | minor faults | "
                  + " | ".join(PHASES) + " | collectives (self) | copies | aten ops "
                  "| allocs / MiB allocated | max rel diff vs torch.func row |",
                  "|---|" + "---:|" * (len(PHASES) + 8)]
        for key, what, peer in rows:
            t, p = timed[key], prof[key]
            ref = timed.get(peer or key)
            wall = f"{t['wall']:.0f} ({t['wall'] / ref['wall']:.2f})" if ref else f"{t['wall']:.0f}"
            cpu = f"{t['cpu']:.0f} ({t['cpu'] / ref['cpu']:.2f})" if ref else f"{t['cpu']:.0f}"
            coll = sum(ms for op, ms in p["op_ms"].items() if op.startswith(COLLECTIVE_PREFIXES))
            copies = sum(p["op_ms"].get(op, 0.0) for op in COPY_OPS)
            n_copies = sum(p["op_count"].get(op, 0) for op in COPY_OPS)
            diff = result["diffs"].get(key)
            phases = " | ".join(f"{p['phase_ms'].get(ph, 0.0):.0f}" for ph in PHASES)
            lines.append(
                f"| {what} | {wall} | {cpu} | {t['minflt']:.0f} "
                f"| {phases} | {coll:.0f} | {copies:.0f} ({n_copies:.0f}) | {p['aten_ops']:.0f} "
                f"| {p['allocs']:.0f} / {p['alloc_bytes'] / MiB:.0f} "
                f"| {'—' if diff is None else f'{diff:.1e}'} |")
        for key, error in failed:
            lines.append(f"| {key} | failed: {error} |" + " |" * (len(PHASES) + 8))
        keys = [k for k, _, _ in rows if "+" not in k]
        ranked = collections.Counter()
        for k in keys:
            for op, ms in prof[k]["op_ms"].items():
                ranked[op] = max(ranked[op], ms)
        lines += [f"\n#### {group}: top ops by self time (ms per step / calls)\n",
                  "| op | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for op, _ in ranked.most_common(top):
            cells = " | ".join(f"{prof[k]['op_ms'].get(op, 0.0):.1f} / "
                               f"{prof[k]['op_count'].get(op, 0):.0f}" for k in keys)
            lines.append(f"| `{op}` | {cells} |")
        lines += [f"\n#### {group}: step peak (`sf.memory.track`, MiB above the step's start)\n",
                  "| system | peak | alive after | VmHWM step peak (bench_tp's method) "
                  "| at the peak, by phase (MiB) | largest at the peak (phase:op MiB) |",
                  "|---|---:|---:|---:|---|---|"]
        for key, what, _ in rows:
            m = memory[key]
            by_phase = collections.Counter()
            for cat, nbytes in m["at_peak"].items():
                by_phase[cat.partition(":")[0]] += nbytes
            biggest = sorted(m["at_peak"].items(), key=lambda kv: -kv[1])[:5]
            lines.append(f"| {what} | {m['peak'] / MiB:.1f} | {m['after'] / MiB:.1f} "
                         f"| {m['vmhwm'] / MiB:.0f} | "
                         + ", ".join(f"{k} {v / MiB:.1f}" for k, v in by_phase.most_common())
                         + " | " + ", ".join(f"{k} {v / MiB:.1f}" for k, v in biggest) + " |")
    return "\n".join(lines)


def memory_diff(result: dict[str, Any], a: str, b: str, top: int) -> str:
    """What is alive at ``a``'s peak and not at ``b``'s, by ``phase:op`` (MiB)."""
    ma, mb = result["memory"].get(a), result["memory"].get(b)
    if ma is None or mb is None:
        return ""
    cats = set(ma["at_peak"]) | set(mb["at_peak"])
    rows = sorted(((c, ma["at_peak"].get(c, 0), mb["at_peak"].get(c, 0)) for c in cats),
                  key=lambda r: -abs(r[1] - r[2]))[:top]
    lines = [f"\n#### alive at the step peak: {a} against {b} (MiB)\n",
             f"| phase:op | {a} | {b} | difference |", "|---|---:|---:|---:|"]
    lines += [f"| `{c}` | {x / MiB:.1f} | {y / MiB:.1f} | {(x - y) / MiB:+.1f} |"
              for c, x, y in rows]
    lines.append(f"| total | {ma['peak'] / MiB:.1f} | {mb['peak'] / MiB:.1f} "
                 f"| {(ma['peak'] - mb['peak']) / MiB:+.1f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local CPU ranks (gloo)")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (no profiler)")
    parser.add_argument("--profiled", type=int, default=3, help="profiled rounds")
    parser.add_argument("--top", type=int, default=12, help="rows of the op tables")
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke test")
    parser.add_argument("--tp-model", choices=["gpt", "mlp"], default="gpt",
                        help="the tp group's model (bench_tp's, without sequence parallelism)")
    parser.add_argument("--systems", nargs="+", default=None,
                        help="only these systems (keys of GROUPS), e.g. ddp sf-dp-pure")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="glibc mallopt on every rank: large blocks from the heap, freed "
                             "memory kept (see keep_freed_memory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from shardfn.testing import local_world

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from _common import machine_info

    print(machine_info())
    print(f"load average at start: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} "
          f"{os.getloadavg()[2]:.1f}", flush=True)
    t0 = time.perf_counter()
    with local_world(args.ranks, timeout=900.0, check=False) as world:
        result = world.run(rank_main, args)[0]
    print(tables(result, args.groups, args.top, args.tp_model))
    if "tp" in args.groups:
        print(memory_diff(result, "sf-tp", "torch-tp", args.top))
        print(memory_diff(result, "sf-tp", "sf-tp+nocg", args.top))
        print(memory_diff(result, "sf-tp+engine", "torch-tp", args.top))
    if "dp" in args.groups:
        print(memory_diff(result, "sf-dp-pure", "ddp", args.top))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; the run took "
          f"{time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
