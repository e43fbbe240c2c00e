"""Checkpoint save/load time and bytes per rank: sf.checkpoint against torch DCP with FSDP2.

The same model as ``bench_dp.py`` (8 MLP blocks, d=512, 17M parameters) with
an AdamW state, sharded over N local CPU ranks two ways: shardfn ZeRO-3
(``shard_params`` + ``adamw`` over the shards) saved with ``sf.checkpoint.save``,
and torch FSDP2 (``fully_shard`` per block) saved with
``torch.distributed.checkpoint.save`` of ``get_state_dict(model, optim)``. Both
fsync their files. Repetitions are interleaved (the two saves, in alternating
order, an async save, then the loads, alternating too); the table gives medians.
Also measured: how long an async save blocks the caller, against a plain copy
of the same local shards to CPU memory (the staging copy), and a load without
the checksum verification (which reads every file once more).

Run (about a minute on 2 idle cores):
    .venv/bin/python benchmarks/bench_ckpt.py
    .venv/bin/python benchmarks/bench_ckpt.py --quick     # tiny model, a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import BenchOutput
from torch import nn

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Config:
    d: int = 512
    hidden: int = 2048
    blocks: int = 8


QUICK = Config(d=64, hidden=256, blocks=2)


class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPModel(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg.d, cfg.hidden) for _ in range(cfg.blocks))
        self.proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def _rank_bytes(path: str, rank: int) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.startswith(f"__{rank}_"))


def _timed(fn, *args, **kwargs) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - t0


def rank_main(args: argparse.Namespace, root: str) -> dict:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    import shardfn as sf
    import shardfn.checkpoint as ck

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = QUICK if args.quick else Config()
    mesh = sf.Mesh({"dp": dist.get_world_size()})
    torch.manual_seed(0)
    x = torch.randn(4, 8, cfg.d)

    # shardfn ZeRO-3 + AdamW over the shards, one step so the moments are real
    model = sf.shard_params(sf.functional(MLPModel(cfg)), mesh, "dp", units=Block)
    params, opt = model.init(0), sf.optim.adamw(1e-3, weight_decay=0.1)
    grads = torch.func.grad(lambda p: model.apply(p, x).square().mean())(params)
    updates, opt_state = opt.update(grads, opt.init(params), params)
    params = sf.optim.apply_updates(params, updates)
    state = {"params": params, "opt": opt_state, "step": 1}
    layouts = {"params": model, "opt": opt}

    # torch FSDP2 + AdamW, one step
    torch.manual_seed(0)
    module = MLPModel(cfg)
    for block in module.blocks:
        fully_shard(block)
    fully_shard(module)
    torch_opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    module(x).square().mean().backward()
    torch_opt.step()
    model_sd, optim_sd = get_state_dict(module, torch_opt)
    torch_sd = {"model": model_sd, "optim": optim_sd}

    times: dict[str, list[float]] = {k: [] for k in (
        "torch save", "sf save", "sf async (blocking)", "sf async (total)", "staging copy",
        "torch load", "sf load", "sf load (no verify)")}
    sizes: dict[str, int] = {}
    ck.release_staging()
    for rep in range(args.reps):
        paths = {k: os.path.join(root, f"{k}-{rep}") for k in ("torch", "sf", "async")}
        saves = [("torch save", dcp.save, (torch_sd,), {"checkpoint_id": paths["torch"]}),
                 ("sf save", ck.save, (paths["sf"], state, mesh, layouts), {})]
        for key, fn, a, kw in saves[::1 if rep % 2 == 0 else -1]:  # alternate who goes first
            times[key].append(_timed(fn, *a, **kw))
        copies = [("staging copy", _plain_copy, state),
                  ("sf async (blocking)", _async_save, paths["async"], state, mesh, layouts)]
        for key, fn, *a in copies[::1 if rep % 2 == 0 else -1]:
            dist.barrier()  # both timed on this rank alone, from the same barrier
            t0 = time.perf_counter()
            result = fn(*a)
            times[key].append(time.perf_counter() - t0)
            if isinstance(result, ck.SaveHandle):
                result.wait()
                times["sf async (total)"].append(time.perf_counter() - t0)
            del result  # the baseline's copies are freed after its timing
        loads = [("torch load", dcp.load, (torch_sd,), {"checkpoint_id": paths["torch"]}),
                 ("sf load", ck.load, (paths["sf"], state, mesh, layouts), {})]
        for key, fn, a, kw in loads[::1 if rep % 2 == 0 else -1]:
            times[key].append(_timed(fn, *a, **kw))
        times["sf load (no verify)"].append(_timed(ck.load, paths["sf"], state, mesh, layouts,
                                                   verify=False))
        sizes = {"torch": _rank_bytes(paths["torch"], rank),
                 "sf": _rank_bytes(paths["sf"], rank)}
        dist.barrier()
        if rank == 0:
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
    ck.release_staging()
    return {"times": times, "sizes": sizes,
            "params": sum(p.numel() for p in MLPModel(cfg).parameters())}


def _plain_copy(state) -> list[torch.Tensor]:
    """The staging-copy baseline: a fresh CPU copy of every tensor, all held at once (as a
    staging copy must be), ``x.to("cpu", copy=True)``: it allocates its memory."""
    import shardfn as sf

    return [x.detach().to("cpu", copy=True) for x in sf.pytree.tree_leaves(state)
            if isinstance(x, torch.Tensor)]


def _async_save(path, state, mesh, layouts):
    import shardfn.checkpoint as ck

    return ck.save(path, state, mesh, layouts, async_=True)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """(p25, median, p75)."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def _cell(values: list[float]) -> str:
    p25, median, p75 = _quartiles(values)
    return f"{median:.3f} ({p25:.3f}-{p75:.3f})"


def _ratio(times: dict[str, list[float]], a: str, b: str, skip: int = 0) -> str:
    """Median (p25-p75) of the per-repetition ratios ``a / b`` (each pair measured side by
    side, so a slower moment of the shared machine slows both)."""
    return _cell([x / y for x, y in zip(times[a][skip:], times[b][skip:], strict=True)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    from shardfn.testing import local_world

    root = tempfile.mkdtemp(prefix="bench_ckpt-")
    try:
        with local_world(args.ranks, timeout=600.0, check=False) as world:
            out = world.run(rank_main, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    psi = out[0]["params"]
    report = BenchOutput("ckpt")
    print(f"$ {report.command}")
    report.setup(f"Model: {psi / 1e6:.2f}M params + AdamW state, fp32; {args.ranks} ranks; "
                 f"{args.reps} interleaved repetitions.")
    t = out[0]["times"]
    lines = ["| | torch DCP + FSDP2 | sf.checkpoint (ZeRO-3) | ratio sf/torch |",
             "|---|---:|---:|---:|"]
    for what in ("save", "load"):
        lines.append(f"| {what} (s) | {_cell(t[f'torch {what}'])} | {_cell(t[f'sf {what}'])} "
                     f"| {_ratio(t, f'sf {what}', f'torch {what}')} |")
    sizes = ["| | torch DCP + FSDP2 | sf.checkpoint (ZeRO-3) | ratio sf/torch |",
             "|---|---:|---:|---:|"]
    for r, o in enumerate(out):
        sizes.append(f"| bytes written, rank {r} (MiB) | {o['sizes']['torch'] / MiB:.1f} | "
                     f"{o['sizes']['sf'] / MiB:.1f} | "
                     f"{o['sizes']['sf'] / o['sizes']['torch']:.3f} |")
    report.table("\n".join(lines),
                 "Save and load of the ZeRO-3 state, rank 0's times barrier to barrier: median "
                 "(p25–p75); ratios: median (p25–p75) of the per-repetition ratios.",
                 ratio="ratio sf/torch", peer="torch DCP + FSDP2", quantity="time",
                 labels=["sf.checkpoint save", "sf.checkpoint load"])
    report.table("\n".join(sizes), "Bytes each rank writes.",
                 ratio="ratio sf/torch", peer="torch DCP + FSDP2", quantity="bytes written",
                 labels=[f"sf.checkpoint bytes written, rank {r}" for r in range(len(out))])
    first_async, first_copy = t["sf async (blocking)"][0], t["staging copy"][0]
    lines = ["| | staging copy (fresh) | sf async save, blocking | ratio async/copy |",
             "|---|---:|---:|---:|",
             f"| first call (s) | {first_copy:.4f} | {first_async:.4f} | "
             f"{first_async / first_copy:.2f} |"]
    if args.reps > 1:
        lines.append(f"| async save, blocking, later calls (s) | {_cell(t['staging copy'][1:])} "
                     f"| {_cell(t['sf async (blocking)'][1:])} | "
                     f"{_ratio(t, 'sf async (blocking)', 'staging copy', skip=1)} |")
    report.table("\n".join(lines),
                 "Async save: how long it blocks the caller, against the staging-copy "
                 "baseline: a fresh CPU copy of every tensor of the local state "
                 "(`x.to(\"cpu\", copy=True)`, which allocates). The async save copies into "
                 "CPU buffers kept from its previous call (no allocation); its first call "
                 "allocates them (first row).",
                 ratio="ratio async/copy", peer="a fresh staging copy", quantity="blocking time",
                 labels=["sf async save, first call", "sf async save, later calls"][
                     :len(lines) - 2])
    report.note(f"sf async save done after {_cell(t['sf async (total)'])} s; sf load without "
                f"checksum verification: {_cell(t['sf load (no verify)'])} s.")
    report.save(args.results)


if __name__ == "__main__":
    main()
