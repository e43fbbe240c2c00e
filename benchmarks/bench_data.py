"""Data loader throughput: ``sf.data.loader`` against the demo's step and torch's DataLoader.

Issue #25 asks that the loader not be the bottleneck: it must deliver tokens faster
than the demo's training step consumes them. On N local CPU ranks (default 2):

* **the step**: the demo's model and plan (``examples/demo.py --plan fsdp``: the
  character GPT, d_model 64, 2 blocks, 4 heads, vocabulary 96, seq 64, global batch 16;
  ``shard_params`` per block, AdamW) on a fixed batch: tokens consumed per rank per second;
* **sf.data.loader** over a ``TokenFile`` of uint16 ids (written once, 4 MB, the same
  global batch laid out over ``dp``) with ``num_workers`` 0 and 2: tokens delivered
  per rank per second, the loader alone (nothing consumes the batches);
* **the peer**: a plain ``torch.utils.data.DataLoader`` with a ``DistributedSampler``
  over the same file and batch, also with 0 and 2 workers.

Every round runs each system once, in rotating order, barrier to barrier on every rank
(``_common.round_order``): the step ``--steps`` times, each loader ``--batches`` batches
from an iterator kept across rounds (an epoch's end restarts it inside the timing, as in
training). Before a loader's timed batches the ones its workers prefetched while other
systems ran are taken untimed, so a round times batches loaded in it. The columns
``loader / step`` and ``sf / torch`` are medians of the per-round ratios (each pair
measured in the same round).

Run (about 40 s on 2 busy cores):
    .venv/bin/python benchmarks/bench_data.py
    .venv/bin/python benchmarks/bench_data.py --quick     # a smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from _common import BenchOutput, round_order

VOCAB, SEQ, GLOBAL_BATCH = 96, 64, 16  # examples/demo.py: its 96 characters, --seq, --batch
TOKENS = 2_000_000  # 4 MB of uint16 ids, 31,249 windows
WORKERS = (0, 2)
PREFETCH = 2  # the DataLoader's prefetch_factor (its default)

#: (key, label) in table order: the step first, then each sf loader beside its torch peer
SYSTEMS = (("step", "demo step (fsdp, GPT d=64, 2 blocks) consumes"),
           *((f"{kind}{w}", f"{label}, num_workers={w}") for w in WORKERS
             for kind, label in (("sf", "sf.data.loader (TokenFile)"),
                                 ("torch", "torch DataLoader + DistributedSampler (TokenFile)"))))


def _worker_options(workers: int) -> dict:
    """Persistent workers, forked where the platform has fork (torchrun's default on Linux;
    a local-world rank's own default is spawn, which re-imports torch in every worker)."""
    if not workers:
        return {}
    methods = multiprocessing.get_all_start_methods()
    return {"persistent_workers": True, "prefetch_factor": PREFETCH,
            "multiprocessing_context": "fork" if "fork" in methods else "spawn"}


def _forever(loader, set_epoch: Callable[[int], None] | None = None) -> Iterator:
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1


def _demo_step(mesh, local_batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    """examples/demo.py's fsdp step on ``local_batch`` (this rank's share of the batch)."""
    import torch.nn.functional as F

    import shardfn as sf
    from shardfn.models import GPT, Block, GPTConfig

    cfg = GPTConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, seq_len=SEQ,
                    dropout=0.0, tied_embeddings=True, bias=False)
    model = sf.shard_params(sf.functional(GPT(cfg)), mesh, "dp", units=Block)
    opt = sf.optim.adamw(3e-3, weight_decay=0.01)
    params = model.init(0)
    carry = {"params": params, "opt": opt.init(params)}
    x, y = local_batch

    def loss_fn(p):
        return F.cross_entropy(model.apply(p, x).flatten(0, -2), y.flatten())

    def step() -> None:
        grads, _ = torch.func.grad_and_value(loss_fn)(carry["params"])
        updates, carry["opt"] = opt.update(grads, carry["opt"], carry["params"])
        carry["params"] = sf.optim.apply_updates(carry["params"], updates)

    return step


def rank_main(args: argparse.Namespace, path: str) -> dict:
    from torch.utils.data import DataLoader, DistributedSampler

    import shardfn as sf
    from shardfn import data as sfd

    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = sf.Mesh({"dp": n})
    tokens = sfd.TokenFile(path, seq_len=SEQ)
    local = GLOBAL_BATCH // n
    streams: dict[str, Iterator] = {}
    for w in WORKERS:
        streams[f"sf{w}"] = _forever(sfd.loader(tokens, mesh, global_batch=GLOBAL_BATCH,
                                                seed=0, num_workers=w, **_worker_options(w)))
        sampler = DistributedSampler(tokens, num_replicas=n, rank=rank, shuffle=True, seed=0,
                                     drop_last=True)
        streams[f"torch{w}"] = _forever(DataLoader(tokens, batch_size=local, sampler=sampler,
                                                   drop_last=True, num_workers=w,
                                                   **_worker_options(w)), sampler.set_epoch)
    first = next(streams["sf0"])
    step = _demo_step(mesh, first)

    def run(key: str) -> float:
        if key == "step":
            count, fn = args.steps, step
        else:
            stream = streams[key]
            w = int(key.removeprefix("sf").removeprefix("torch"))
            for _ in range(w * PREFETCH):  # what the workers prefetched meanwhile: untimed
                next(stream)
            count = args.batches

            def fn() -> None:
                x, y = next(stream)
                if x.shape != (local, SEQ) or y.shape != (local, SEQ):
                    raise AssertionError(f"{key}: a batch of {tuple(x.shape)}, expected "
                                         f"{(local, SEQ)}")
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        dist.barrier()
        return local * SEQ * count / (time.perf_counter() - t0)

    keys = [k for k, _ in SYSTEMS]
    rates: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(args.warmup + args.rounds):
        for key in round_order(keys, r):
            rate = run(key)
            if r >= args.warmup:
                rates[key].append(rate)
    streams.clear()  # the workers stop with their iterators
    return {"rates": rates, "windows": len(tokens), "local": local}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def _cell(values: list[float], fmt: str = "{:,.0f}") -> str:
    p25, median, p75 = _quartiles(values)
    return f"{fmt.format(median)} ({fmt.format(p25)}–{fmt.format(p75)})"


def _paired(a: list[float], b: list[float]) -> str:
    """Median (p25–p75) of the per-round ratios a / b."""
    return _cell([x / y for x, y in zip(a, b, strict=True)], "{:.2f}")


def table(rates: dict[str, list[float]]) -> str:
    """The results as a markdown table (tokens/s per rank; ratios per round)."""
    lines = ["| system | tokens/s per rank: median (p25–p75) | loader / step (target >= 1) "
             "| sf / torch (same workers) |", "|---|---:|---:|---:|"]
    for key, label in SYSTEMS:
        if key == "step":
            lines.append(f"| {label} | {_cell(rates[key])} | — | — |")
            continue
        peer = key.replace("sf", "torch") if key.startswith("sf") else None
        vs_torch = _paired(rates[key], rates[peer]) if peer else "—"
        lines.append(f"| {label} | {_cell(rates[key])} | {_paired(rates[key], rates['step'])}"
                     f" | {vs_torch} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    parser.add_argument("--steps", type=int, default=10, help="demo steps per round")
    parser.add_argument("--batches", type=int, default=200, help="loader batches per round")
    parser.add_argument("--quick", action="store_true", help="3 rounds of fewer batches")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.batches = 3, 3, 50
    if GLOBAL_BATCH % args.ranks:
        raise SystemExit(f"--ranks {args.ranks} must divide the global batch {GLOBAL_BATCH}")
    from shardfn.data import write_tokens
    from shardfn.testing import local_world

    root = tempfile.mkdtemp(prefix="bench_data-")
    start = time.perf_counter()
    try:
        path = os.path.join(root, "train.bin")
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(0))
        write_tokens(path, ids)
        with local_world(args.ranks, timeout=600.0, check=False) as world:
            out = world.run(rank_main, args, path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    o = out[0]
    report = BenchOutput("data")
    print(f"$ {report.command}")
    report.setup(f"{args.ranks} ranks, 1 thread each; a TokenFile of {TOKENS:,} uint16 ids "
                 f"({TOKENS * 2 / 2**20:.1f} MiB, {o['windows']:,} windows of {SEQ}); "
                 f"global batch {GLOBAL_BATCH}, {o['local']} x {SEQ} tokens per rank; "
                 f"{args.rounds} rounds after {args.warmup} warm-up, each: {args.steps} demo "
                 f"steps and {args.batches} batches of every loader, rotating order, barrier "
                 f"to barrier (rank 0's clock); {time.perf_counter() - start:.0f} s in all.")
    report.table(table(o["rates"]),
                 "Tokens per second per rank that each loader delivers, against what the demo's "
                 "training step consumes and against torch's DataLoader with as many workers "
                 "(median and p25–p75 of the per-round ratios).",
                 ratio="sf / torch", peer="torch DataLoader, same workers", quantity="tokens/s")
    report.save(args.results)


if __name__ == "__main__":
    main()
