"""Shared harness for the benchmarks: a registry of systems, interleaved timing, tables.

A *system* is one way of training the same model (torch DDP, a shardfn
transform, ...). Each is registered with a setup function that builds it on
every rank and returns a :class:`System`: a step closure plus accessors for
its memory and parameters. :func:`run_interleaved` then runs all systems in
rounds (one step of each per round, in rotating order, with a barrier before
and after every step), so that noise from a shared machine spreads evenly over
the systems instead of landing on whichever ran last.

Example (one extra row, in the benchmark script):
    >>> @SYSTEMS.register("fsdp2", "torch FSDP2 fully_shard")
    ... def setup_fsdp2(ctx):
    ...     module = fully_shard(ctx.make_module())
    ...     ...
    ...     return System(step, memory, params)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "BenchOutput",
    "MiB",
    "Table",
    "all_ok",
    "max_over_ranks",
    "Registry",
    "Result",
    "System",
    "machine",
    "machine_info",
    "parse_markdown_table",
    "markdown_table",
    "rel_diff",
    "round_order",
    "run_interleaved",
    "storage_bytes",
    "write_json",
]

MiB = 2**20


class System(NamedTuple):
    """One trainer built on this rank.

    Attributes:
        step: ``step(i)`` runs training step ``i`` (on the batch for ``i``).
        memory: ``memory() -> {"params": bytes, "grads": bytes, "opt_state": bytes}`` held
            by this rank after a step.
        params: ``params() -> {name: full tensor}`` with the module's parameter names,
            for the correctness check (every rank must be able to return the full tree).
        counts_comm: True when its traffic goes through shardfn (``sf.comm_stats``).
    """

    step: Callable[[int], None]
    memory: Callable[[], dict[str, int]]
    params: Callable[[], dict[str, torch.Tensor]]
    counts_comm: bool = False


SetupFn = Callable[[Any], System]


class Registry:
    """Ordered ``key -> (label, setup)``; ``default=False`` keeps a system out of default runs."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, SetupFn, bool]] = {}

    def register(self, key: str, label: str, *, default: bool = True):
        """Decorator adding ``setup(ctx) -> System`` under ``key`` (shown as ``label``)."""

        def add(setup: SetupFn) -> SetupFn:
            if key in self.entries:
                raise ValueError(f"system {key!r} is registered twice")
            self.entries[key] = (label, setup, default)
            return setup

        return add

    def defaults(self) -> list[str]:
        return [k for k, (_, _, default) in self.entries.items() if default]

    def label(self, key: str) -> str:
        return self.entries[key][0]

    def setup(self, key: str) -> SetupFn:
        return self.entries[key][1]


class Result(NamedTuple):
    """What rank 0 reports for one system."""

    key: str
    label: str
    times_s: list[float]
    memory: dict[str, int]  # max over ranks
    sent_bytes: int | None  # bytes sent per rank in the last step (shardfn systems), max over ranks
    max_rel_diff: float | None  # vs the reference system, max over ranks
    error: str | None


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def rel_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Largest per-leaf ``max|a - b| / max|b|`` (missing or misshapen leaves give inf)."""
    worst = 0.0
    if set(a) != set(b):
        return float("inf")
    for name, ref in b.items():
        got = a[name]
        if got.shape != ref.shape:
            return float("inf")
        scale = ref.abs().max().item() or 1.0
        worst = max(worst, (got.double() - ref.double()).abs().max().item() / scale)
    return worst


def all_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a MIN all-reduce)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the ranks (a MAX all-reduce)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _short_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:160]


def round_order(order: list[str], r: int, pairs: bool = False) -> list[str]:
    """The systems of round ``r``: ``order`` rotated by ``r``; with ``pairs`` the
    consecutive pairs (``order[0:2]``, ``order[2:4]``, ...) stay side by side, the pairs
    rotate, and each pair's two systems swap places every round.

    Example:
        >>> round_order(["a", "A", "b", "B"], 1, pairs=True)
        ['B', 'b', 'A', 'a']
    """
    if not pairs:
        shift = r % max(1, len(order))
        return order[shift:] + order[:shift]
    groups = [order[i:i + 2] for i in range(0, len(order), 2)]
    shift = r % max(1, len(groups))
    groups = groups[shift:] + groups[:shift]
    return [key for group in groups for key in (group if r % 2 == 0 else group[::-1])]


def run_interleaved(ctx: Any, registry: Registry, keys: list[str], *, warmup: int, steps: int,
                    reference: str | None, log: Callable[[str], None] = print,
                    pairs: bool = False) -> list[Result]:
    """Set up ``keys`` on this rank, run them in rotating rounds, check them against ``reference``.

    Must be called on every rank with the same arguments. A system whose setup or
    step raises on every rank (an import or API breakage) is dropped from the rounds
    and reported with its error. One that raises on some ranks only, while the
    others wait in a collective, hangs until the local world's timeout.

    Args:
        ctx: passed to every setup function.
        registry: where the systems are registered.
        keys: which systems, in table order.
        warmup: unmeasured rounds first.
        steps: measured rounds.
        reference: key of the system the others' parameters are compared with.
        log: progress printer (rank 0 only is a good choice).
        pairs: run ``keys[0:2]``, ``keys[2:4]``, ... back to back in every round, in
            alternating order (:func:`round_order`), for paired ratios of systems
            measured moments apart.

    Returns:
        One :class:`Result` per key (meaningful on rank 0).
    """
    from shardfn import comm_stats, reset_comm_stats

    systems: dict[str, System] = {}
    errors: dict[str, str] = {}
    for key in keys:
        error = None
        try:
            systems[key] = registry.setup(key)(ctx)
        except Exception as e:  # noqa: BLE001 - a broken peer must not stop the benchmark
            error = _short_error(e)
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        if not all_ok(error is None):
            systems.pop(key, None)
            errors[key] = error or "failed on another rank"
            log(f"  setup {key}: FAILED ({errors[key]})")
        else:
            log(f"  setup {key}: ok")

    times: dict[str, list[float]] = {k: [] for k in keys}
    sent: dict[str, int] = {}
    order = [k for k in keys if k in systems]
    t_start = time.perf_counter()
    for r in range(warmup + steps):
        for key in round_order(order, r, pairs):
            if key not in systems:
                continue
            error = None
            reset_comm_stats()
            dist.barrier()
            t0 = time.perf_counter()
            try:
                systems[key].step(r)
            except Exception as e:  # noqa: BLE001
                error = _short_error(e)
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            sent[key] = comm_stats().total_bytes
            if not all_ok(error is None):
                errors[key] = f"step {r}: " + (error or "failed on another rank")
                del systems[key]
                log(f"  {key}: FAILED at step {r} ({errors[key]})")
                continue
            if r >= warmup:
                times[key].append(elapsed)
        log(f"  round {r + 1}/{warmup + steps} done ({time.perf_counter() - t_start:.0f} s)")

    ref_params = None
    if reference in systems:
        ref_params = {k: v.detach().clone() for k, v in systems[reference].params().items()}
    results = []
    for key in keys:
        memory: dict[str, int] = {}
        diff = None
        if key in systems:
            try:
                local = systems[key].memory()
                memory = {k: int(max_over_ranks(v)) for k, v in local.items()}
                if ref_params is not None:
                    diff = max_over_ranks(rel_diff(systems[key].params(), ref_params))
            except Exception as e:  # noqa: BLE001
                errors[key] = "after the run: " + _short_error(e)
        counts = key in systems and systems[key].counts_comm
        sent_bytes = int(max_over_ranks(sent.get(key, 0))) if counts else None
        results.append(Result(key, registry.label(key), times[key], memory, sent_bytes, diff,
                              errors.get(key)))
    return results


def markdown_table(results: list[Result], reference: str | None, num_params: int) -> str:
    """The results as a markdown table (times in ms, memory in MiB)."""
    ref = next((r for r in results if r.key == reference and r.times_s), None)
    ref_median = statistics.median(ref.times_s) if ref else None
    lines = [
        "| system | median ms | p25–p75 ms | min ms | ratio to DDP "
        "| MiB per rank (params+grads+opt) | bytes/param | sent MiB/step | max rel diff vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error or not r.times_s:
            lines.append(f"| {r.label} | failed: {r.error or 'no steps'} | | | | | | | |")
            continue
        med = statistics.median(r.times_s)
        if len(r.times_s) >= 2:
            q = statistics.quantiles(r.times_s, n=4, method="inclusive")
            spread = f"{q[0] * 1e3:.0f}–{q[2] * 1e3:.0f}"
        else:
            spread = "—"
        ratio = f"{med / ref_median:.3f}" if ref_median else "—"
        total = sum(r.memory.values())
        mem = (f"{total / MiB:.0f} ({r.memory.get('params', 0) / MiB:.0f}+"
               f"{r.memory.get('grads', 0) / MiB:.0f}+{r.memory.get('opt_state', 0) / MiB:.0f})")
        per_param = f"{total / num_params:.2f}"
        sent = "—" if r.sent_bytes is None else f"{r.sent_bytes / MiB:.1f}"
        diff = "—" if r.max_rel_diff is None else f"{r.max_rel_diff:.1e}"
        lines.append(f"| {r.label} | {med * 1e3:.0f} | {spread} | {min(r.times_s) * 1e3:.0f} "
                     f"| {ratio} | {mem} | {per_param} | {sent} | {diff} |")
    return "\n".join(lines)


# glibc settings for --malloc-cache: serve every allocation from the heap and never give it
# back, so a freed 65 MiB buffer is reused instead of unmapped and faulted in again.
MALLOC_CACHE_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(2**32),
    "MALLOC_TRIM_THRESHOLD_": str(2**36),
    "MALLOC_TOP_PAD_": str(2**30),
}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine() -> dict[str, Any]:
    """This machine as the report's one line shows it: CPU model, cores, memory, OS, torch.

    Example:
        >>> sorted(machine())
        ['cores', 'cpu', 'memory_gib', 'os', 'python', 'torch']
    """
    model = platform.processor() or "unknown CPU"
    memory_gib = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "memory_gib": memory_gib,
            "os": f"{platform.system()} {platform.release()}", "torch": torch.__version__,
            "python": platform.python_version()}


def machine_info() -> str:
    """One line: torch version, CPU model and core count, memory, Python, OS."""
    m = machine()
    memory = f", {m['memory_gib']} GiB" if m["memory_gib"] else ""
    return (f"torch {m['torch']}, {m['cores']} cores ({m['cpu']}){memory}, Python "
            f"{m['python']}, {m['os']}")


class Table(NamedTuple):
    """One table of a benchmark's results, as the report shows it.

    Attributes:
        header: the column titles.
        rows: the cells, as text (the benchmark formats its numbers).
        caption: a sentence above the table (what it shows, how it was measured).
        ratio: the title of the column holding each row's ratio to its peer, or None.
        peer: what that ratio divides by ("torch DDP").
        quantity: what the ratio compares ("step time", "bytes sent"); a time ratio
            (lower is better) is drawn in the report's ratio plot.
        label: the columns whose cells, joined, name a row in the summary and plots.
        labels: the rows' names, given outright (instead of ``label``).
    """

    header: list[str]
    rows: list[list[str]]
    caption: str = ""
    ratio: str | None = None
    peer: str = ""
    quantity: str = ""
    label: tuple[int, ...] = (0,)
    labels: list[str] | None = None


def parse_markdown_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header cells and the rows of cells of the one markdown table in ``text``.

    Example:
        >>> parse_markdown_table("| a | b |\n|---|---:|\n| x | 1.0 |")
        (['a', 'b'], [['x', '1.0']])
    """
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    if len(cells) < 2 or not all(line.startswith("|") for line in lines):
        raise ValueError(f"not a markdown table: {text[:80]!r}")
    return cells[0], cells[2:]


class BenchOutput:
    """What a benchmark shows a reader: its setup, tables, notes and plots.

    Each call prints as before (the console stays readable) and records the piece;
    :meth:`save` writes them as JSON for ``benchmarks/report.py``, which renders the
    report from them. Paths are recorded relative to the repository, never absolute.

    Example:
        >>> out = BenchOutput("dp")
        >>> out.setup("model: 2 blocks")
        model: 2 blocks
        >>> out.table("| system | ratio to DDP |\n|---|---:|\n| ZeRO-1 | 0.97 |",
        ...           ratio="ratio to DDP", peer="torch DDP", quantity="step time")
        | system | ratio to DDP |
        |---|---:|
        | ZeRO-1 | 0.97 |
        >>> out.record()["tables"][0]["rows"]
        [['ZeRO-1', '0.97']]
    """

    def __init__(self, bench: str, argv: list[str] | None = None) -> None:
        self.bench = bench
        argv = sys.argv if argv is None else argv
        script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv else f"bench_{bench}.py"
        self.command = " ".join(["python", script, *_public_args(argv[1:])])
        self.setups: list[str] = []
        self.tables: list[Table] = []
        self.notes: list[str] = []
        self.plots: list[dict[str, str]] = []

    def setup(self, text: str) -> None:
        """A sentence on what was run (model, ranks, steps)."""
        print(text, flush=True)
        self.setups.append(text.strip())

    def table(self, markdown: str, caption: str = "", **meta: Any) -> None:
        """A markdown table; ``meta``: the :class:`Table` fields after ``caption``."""
        if caption:
            print(f"\n{caption}\n")
        print(markdown, flush=True)
        header, rows = parse_markdown_table(markdown)
        self.tables.append(Table(header, rows, caption.strip(), **meta))

    def note(self, text: str) -> None:
        """A sentence after the tables (formulas, totals)."""
        print(text, flush=True)
        self.notes.append(text.strip())

    def plot(self, path: str, caption: str) -> None:
        """A figure the benchmark drew (``path`` under the repository)."""
        relative = os.path.relpath(os.path.abspath(path), ROOT)
        print(f"wrote {relative}", flush=True)
        self.plots.append({"path": relative, "caption": caption})

    def record(self) -> dict[str, Any]:
        """The recorded pieces as one JSON-ready dict."""
        return {"bench": self.bench, "command": self.command, "setup": self.setups,
                "tables": [t._asdict() for t in self.tables], "notes": self.notes,
                "plots": self.plots, "date": datetime.date.today().isoformat()}

    def save(self, path: str | None) -> None:
        """Write :meth:`record` to ``path`` (nothing when it is None)."""
        if path is not None:
            with open(path, "w") as f:
                json.dump(self.record(), f, indent=1)


def _public_args(args: list[str]) -> list[str]:
    """The command-line arguments a reader can repeat: ``--results FILE`` (a temporary
    file of report.py) dropped, paths under the repository made relative."""
    shown, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--results":
            skip = True
            continue
        if arg.startswith("--results="):
            continue
        if os.path.isabs(arg) and arg.startswith(ROOT):
            arg = os.path.relpath(arg, ROOT)
        shown.append(arg)
    return shown


def write_json(path: str | None, bench: str, results: list[Result], reference: str | None,
               **extra: Any) -> None:
    """Write the results as JSON for ``benchmarks/report.py`` (nothing when ``path`` is None).

    Each system: key, label, median/min step ms, ratio to ``reference``, memory per rank,
    bytes sent per step and the largest relative difference of its parameters.
    """
    if path is None:
        return
    import json

    ref = next((r for r in results if r.key == reference and r.times_s), None)
    ref_median = statistics.median(ref.times_s) if ref else None
    rows = []
    for r in results:
        med = statistics.median(r.times_s) if r.times_s and not r.error else None
        rows.append({"key": r.key, "label": r.label, "median_ms": med and med * 1e3,
                     "min_ms": min(r.times_s) * 1e3 if med else None,
                     "ratio": med / ref_median if med and ref_median else None,
                     "memory": r.memory, "sent_bytes": r.sent_bytes,
                     "max_rel_diff": r.max_rel_diff, "error": r.error})
    with open(path, "w") as f:
        json.dump({"bench": bench, "reference": reference, "machine": machine_info(),
                   "systems": rows, **extra}, f, indent=1)
