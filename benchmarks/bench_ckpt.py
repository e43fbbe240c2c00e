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
    for rep in range(args.reps):
        paths = {k: os.path.join(root, f"{k}-{rep}") for k in ("torch", "sf", "async")}
        saves = [("torch save", dcp.save, (torch_sd,), {"checkpoint_id": paths["torch"]}),
                 ("sf save", ck.save, (paths["sf"], state, mesh, layouts), {})]
        for key, fn, a, kw in saves[::1 if rep % 2 == 0 else -1]:  # alternate who goes first
            times[key].append(_timed(fn, *a, **kw))
        dist.barrier()
        t0 = time.perf_counter()
        handle = ck.save(paths["async"], state, mesh, layouts, async_=True)
        times["sf async (blocking)"].append(time.perf_counter() - t0)
        handle.wait()
        times["sf async (total)"].append(time.perf_counter() - t0)
        times["staging copy"].append(_timed(lambda: [
            x.to("cpu", copy=True) for x in sf.pytree.tree_leaves(state)
            if isinstance(x, torch.Tensor)]))
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
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "sizes": sizes,
            "params": sum(p.numel() for p in MLPModel(cfg).parameters())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from shardfn.testing import local_world

    root = tempfile.mkdtemp(prefix="bench_ckpt-")
    try:
        with local_world(args.ranks, timeout=600.0, check=False) as world:
            out = world.run(rank_main, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    psi = out[0]["params"]
    print(f"$ {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(f"model: {psi / 1e6:.2f}M params + AdamW state, fp32; {args.ranks} ranks; median of "
          f"{args.reps} interleaved repetitions (rank 0's times, barrier to barrier)\n")
    t = out[0]["times"]
    print("| | torch DCP + FSDP2 | sf.checkpoint (ZeRO-3) | ratio sf/torch |")
    print("|---|---:|---:|---:|")
    print(f"| save (s) | {t['torch save']:.3f} | {t['sf save']:.3f} | "
          f"{t['sf save'] / t['torch save']:.2f} |")
    print(f"| load (s) | {t['torch load']:.3f} | {t['sf load']:.3f} | "
          f"{t['sf load'] / t['torch load']:.2f} |")
    for r, o in enumerate(out):
        print(f"| bytes written, rank {r} (MiB) | {o['sizes']['torch'] / MiB:.1f} | "
              f"{o['sizes']['sf'] / MiB:.1f} | {o['sizes']['sf'] / o['sizes']['torch']:.3f} |")
    print(f"\nsf async save: blocks {t['sf async (blocking)']:.3f} s (a plain copy of the local "
          f"state to CPU memory: {t['staging copy']:.3f} s), done after "
          f"{t['sf async (total)']:.3f} s. sf load without checksum verification: "
          f"{t['sf load (no verify)']:.3f} s.")


if __name__ == "__main__":
    main()
