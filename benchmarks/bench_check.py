"""What check mode costs: a small psum and a small data-parallel training step, off vs on.

Two measurements on N local CPU ranks (gloo, one thread per rank), interleaved
in rounds with the same harness as ``bench_dp.py`` (every system runs one step
per round, in rotating order, with a barrier around each step):

* ``psum``: ``--calls`` back-to-back ``sf.psum`` of a 16-float tensor; the time
  per call.
* ``dp step``: a small MLP trained with ``torch.func.grad_and_value``, one
  ``sf.pmean`` over the gradient tree and ``sf.optim.adamw``.

Each is run with check mode off and on (``sf.check_consistency(False/True)`` at
the start of every step), and on with the exchange going through a TCPStore
(what ``torchrun`` jobs, NCCL included, have as the default store) instead of
the local world's FileStore. The table gives medians, their ratio, and how many
checks one step made. If the collectives do not (yet) call the check themselves
(a probe psum makes no check), the benchmark adds the check the collective would
make, ``consistency.check_call("psum", ax, x)``, before each psum/pmean, and
says so. The final parameters of the two DP systems must be equal (check mode
must not change a number).

Run (about a minute on 2 idle cores):
    .venv/bin/python benchmarks/bench_check.py
    .venv/bin/python benchmarks/bench_check.py --steps 10 --calls 50   # quicker
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
import torch.distributed as dist
import torch.nn.functional as F
from _common import Registry, System, machine_info, run_interleaved
from torch import nn

SYSTEMS = Registry()
DEFAULT_STORE = None  # consistency._default_store, set in rank_main
D, HIDDEN, BLOCKS, BATCH, TOKENS = 128, 512, 4, 8, 16


class MLP(nn.Module):
    """``BLOCKS`` residual MLP blocks ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(D), nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
            for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class Context:
    """What a setup gets: args, mesh, this rank's batches, whether to add explicit checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        import shardfn as sf
        from shardfn.primitives import _comm

        self.args = args
        self.world = dist.get_world_size()
        self.mesh = sf.Mesh({"dp": self.world})
        self.ax = _comm.resolve("dp", self.mesh)
        self.explicit = not _library_checks(self.mesh, self.ax)
        local = BATCH // self.world
        rank = dist.get_rank()
        self.batches = []
        for i in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(1000 + i)
            x, y = (torch.randn(BATCH, TOKENS, D, generator=g) for _ in range(2))
            rows = slice(rank * local, (rank + 1) * local)
            self.batches.append((x[rows].clone(), y[rows].clone()))
        self.finals: dict[str, dict] = {}
        self.checks: dict[str, int] = {}
        self.tcp_store = _tcp_store(rank, self.world)


def _tcp_store(rank: int, world: int) -> dist.Store:
    """A TCPStore over the ranks (what ``torchrun`` gives a job), its port passed through the
    local world's store; the ``tcp`` rows route check mode's exchange through it."""
    from shardfn.primitives import consistency

    default = consistency._default_store()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        default.set("bench_check/port", str(store.port))
    else:
        port = int(default.get("bench_check/port"))
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    return dist.PrefixStore("default_pg", store)


def _check_count() -> int:
    from shardfn.primitives import consistency

    return sum(consistency._SEQ.values())


def _library_checks(mesh, ax) -> bool:
    """Whether ``sf.psum`` makes a check by itself (the collectives are wired to check mode)."""
    import shardfn as sf
    from shardfn.primitives import consistency

    consistency.check_consistency(True)
    before = _check_count()
    sf.psum(torch.ones(1), "dp", mesh=mesh)
    made = _check_count() > before
    consistency.check_consistency(False)
    return made


def _with_mode(ctx: Context, key: str, check: bool, body) -> System:
    """A system whose step turns check mode on/off first and counts the checks it made."""
    from shardfn.primitives import consistency

    def step(i: int) -> None:
        if key.endswith("-tcp"):  # the exchange through the TCPStore instead of the FileStore
            consistency._default_store = lambda: ctx.tcp_store
        consistency.check_consistency(check)
        before = _check_count()
        try:
            body(i)
        finally:
            ctx.checks[key] = _check_count() - before
            consistency.check_consistency(False)
            consistency._default_store = DEFAULT_STORE

    return System(step, lambda: {}, lambda: ctx.finals.get(key, {}), counts_comm=True)


def _psum_system(ctx: Context, key: str, check: bool) -> System:
    import shardfn as sf
    from shardfn.primitives import consistency

    x = torch.ones(16)

    def body(i: int) -> None:
        for _ in range(ctx.args.calls):
            if ctx.explicit and check:
                consistency.check_call("psum", ctx.ax, x)
            sf.psum(x, "dp", mesh=ctx.mesh)

    return _with_mode(ctx, key, check, body)


def _dp_system(ctx: Context, key: str, check: bool) -> System:
    import shardfn as sf
    from shardfn.primitives import consistency

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = sf.functional(MLP())
    holder = {"params": model.init(0)}
    opt = sf.optim.adamw(1e-3, weight_decay=0.1)
    holder["state"] = opt.init(holder["params"])
    grad_and_value = torch.func.grad_and_value(
        lambda params, x, y: F.mse_loss(model.apply(params, x), y))

    def body(i: int) -> None:
        x, y = ctx.batches[i]
        params = holder["params"]
        grads, _ = grad_and_value(params, x, y)
        if ctx.explicit and check:
            consistency.check_call("pmean", ctx.ax, grads)
        grads = sf.pmean(grads, "dp", mesh=ctx.mesh)
        updates, holder["state"] = opt.update(grads, holder["state"], params)
        holder["params"] = sf.optim.apply_updates(params, updates)
        ctx.finals[key] = holder["params"]

    return _with_mode(ctx, key, check, body)


for _mode, _check in (("off", False), ("on", True), ("on-tcp", True)):
    SYSTEMS.register(f"psum-{_mode}", f"psum, check {_mode}")(
        lambda ctx, c=_check, k=f"psum-{_mode}": _psum_system(ctx, k, c))
    SYSTEMS.register(f"dp-{_mode}", f"dp step, check {_mode}")(
        lambda ctx, c=_check, k=f"dp-{_mode}": _dp_system(ctx, k, c))


def rank_main(args: argparse.Namespace) -> dict:
    global DEFAULT_STORE
    from shardfn.primitives import consistency

    DEFAULT_STORE = consistency._default_store
    torch.set_num_threads(1)
    ctx = Context(args)
    log = (lambda msg: print(msg, flush=True)) if dist.get_rank() == 0 else (lambda msg: None)
    keys = [f"{stem}-{mode}" for stem in ("psum", "dp") for mode in ("off", "on", "on-tcp")]
    results = run_interleaved(ctx, SYSTEMS, keys, warmup=args.warmup, steps=args.steps,
                              reference=None, log=log)
    off = ctx.finals.get("dp-off", {})
    same = bool(off) and all(
        set(ctx.finals.get(key, {})) == set(off)
        and all(torch.equal(ctx.finals[key][k], off[k]) for k in off)
        for key in ("dp-on", "dp-on-tcp"))
    store = type(consistency_store()).__name__
    return {"results": results, "checks": ctx.checks, "explicit": ctx.explicit,
            "same_params": same, "store": store}


def consistency_store():
    from shardfn.primitives import consistency

    store = consistency._default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _spread(times: list[float], per: int, scale: float, unit: str) -> str:
    """``median (p25-p75) unit`` of ``times / per``."""
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    return (f"{statistics.median(times) / per * scale:.1f} ({q[0] / per * scale:.0f}–"
            f"{q[2] / per * scale:.0f}) {unit}")


def table(out: dict, calls: int) -> str:
    by_key = {r.key: r for r in out["results"]}
    lines = ["| measurement | check off: median (p25–p75) | check on, FileStore | ratio of "
             "medians | check on, TCPStore | ratio of medians | checks per step (on) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, stem, per, unit, scale in (
            ("small psum (16 floats), per call", "psum", calls, "µs", 1e6),
            (f"MLP dp step ({BLOCKS}x{D}x{HIDDEN}, grad + pmean + adamw)", "dp", 1, "ms", 1e3)):
        runs = [by_key[f"{stem}-{mode}"] for mode in ("off", "on", "on-tcp")]
        if any(r.error or not r.times_s for r in runs):
            lines.append(f"| {name} | " + " | ".join(r.error or "" for r in runs) + " | | | |")
            continue
        m_off, m_on, m_tcp = (statistics.median(r.times_s) / per for r in runs)
        t_off, t_on, t_tcp = (_spread(r.times_s, per, scale, unit) for r in runs)
        checks = out["checks"].get(f"{stem}-on", 0)
        if out["explicit"]:
            checks = f"{checks} (explicit)"
        lines.append(f"| {name} | {t_off} | {t_on} | {m_on / m_off:.2f} | {t_tcp} "
                     f"| {m_tcp / m_off:.2f} | {checks} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local CPU ranks (gloo)")
    parser.add_argument("--steps", type=int, default=20, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured rounds")
    parser.add_argument("--calls", type=int, default=100, help="psums per psum step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from shardfn.testing import local_world

    print(f"$ {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(machine_info())
    print(f"{args.ranks} ranks, {args.warmup}+{args.steps} rounds, interleaved", flush=True)
    t0 = time.perf_counter()
    with local_world(args.ranks, timeout=600.0) as world:
        out = world.run(rank_main, args)[0]
    print(f"\ncheck-mode store: {out['store']}; DP parameters equal with check on and off: "
          f"{out['same_params']}; run took {time.perf_counter() - t0:.0f} s\n")
    print(table(out, args.calls))


if __name__ == "__main__":
    main()
