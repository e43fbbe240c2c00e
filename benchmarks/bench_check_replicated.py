"""What verifying values declared replicated costs: pvary / psum_invariant, check mode off vs on.

On a local world of 2 CPU ranks (gloo, one thread per rank), each round times
``--calls`` back-to-back calls of one operation with check mode off and the same
with it on, in alternating order (off first in even rounds, on first in odd
ones), with a barrier around each block; the table gives the medians over the
rounds of the time per call and of the paired ratio (on / off of the same round).

Operations (every rank passes the same values: nothing raises):

* ``pvary``: forward only. On: the call's check plus the input's value check.
* ``psum_invariant``: forward only. On: the call's check plus the output's check.
* ``psum_invariant fwd+bwd``: ``torch.func.grad`` of ``psum_invariant(x).sum()``. On: also
  the check of the gradient reaching the output, in backward.
* ``psum``: forward only, for comparison. On: the call's check only (no value check).

Each at 16 floats and at 256K floats (1 MiB), where hashing the bytes shows.

Run (about a minute on 2 idle cores):
    .venv/bin/python benchmarks/bench_check_replicated.py
    .venv/bin/python benchmarks/bench_check_replicated.py --rounds 5 --calls 10   # quicker
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

OPS = ("pvary", "psum_invariant", "psum_invariant fwd+bwd", "psum")
SIZES = (16, 256 * 1024)


def _call(op: str, x: torch.Tensor, mesh):
    import shardfn as sf

    if op == "psum_invariant fwd+bwd":
        return torch.func.grad(lambda v: sf.psum_invariant(v, "dp", mesh=mesh).sum())(x)
    return getattr(sf, op)(x, "dp", mesh=mesh)


def _on_rank(rounds: int, calls: int, warmup: int) -> dict:
    """``(op, size) -> {"off": [s per call by round], "on": [...], "checks": checks per call}``."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.primitives import consistency

    torch.set_num_threads(1)
    mesh = sf.Mesh({"dp": dist.get_world_size()})
    before = consistency.enabled()
    out: dict = {}
    try:
        for op in OPS:
            for size in SIZES:
                x = torch.randn(size, generator=torch.Generator().manual_seed(size))
                times: dict[str, list[float]] = {"off": [], "on": []}
                for r in range(warmup + rounds):
                    for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                        consistency.check_consistency(mode == "on")
                        seq0 = sum(consistency._SEQ.values())
                        dist.barrier()
                        start = time.perf_counter()
                        for _ in range(calls):
                            _call(op, x, mesh)
                        elapsed = (time.perf_counter() - start) / calls
                        dist.barrier()
                        if r >= warmup:
                            times[mode].append(elapsed)
                        if mode == "on":
                            out.setdefault((op, size), {})["checks"] = (
                                sum(consistency._SEQ.values()) - seq0) / calls
                out[(op, size)].update(times)
    finally:
        consistency.check_consistency(before)
    return out


def _table(result: dict) -> str:
    rows = ["| operation | floats | check off: ms/call | check on: ms/call | ratio (paired "
            "median) | extra ms/call | checks/call (on) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for (op, size), t in result.items():
        off, on = statistics.median(t["off"]) * 1e3, statistics.median(t["on"]) * 1e3
        ratio = statistics.median(b / a for a, b in zip(t["off"], t["on"], strict=True))
        rows.append(f"| {op} | {size} | {off:.3f} | {on:.3f} | {ratio:.2f} | {on - off:.3f} | "
                    f"{t['checks']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    from shardfn.testing import LocalWorld

    world = LocalWorld(2)
    try:
        results = world.run(_on_rank, args.rounds, args.calls, args.warmup, timeout=600)
    finally:
        world.close()
    print(f"2 ranks, gloo, torch {torch.__version__}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}; {args.rounds} rounds x {args.calls} calls (rank 0)")
    print(_table(results[0]))


if __name__ == "__main__":
    main()
