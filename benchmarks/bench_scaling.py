"""Memory per rank and bytes sent per step against world size, beside the ZeRO formulas.

For DP, ZeRO-1, ZeRO-2 and ZeRO-3 (shardfn's ``pmean``, ``shard_opt_state``,
``shard_opt_state(shard_grads=True)`` with autograd, ``shard_params``), on 1, 2
and 4 local CPU ranks, one AdamW step of the same MLP; each rank reports the
bytes it holds of parameters, gradients (what reaches the optimizer, plus any
``.grad`` left) and optimizer state, and ``sf.comm_stats()``'s bytes sent in the
step. The formulas (Rajbhandari et al., ZeRO, 2020, with fp32 everywhere:
``Ψ`` parameters of 4 bytes, Adam's two moments ``8Ψ``):

| strategy | params | grads | optimizer state | sent per step |
|---|---|---|---|---|
| DP | 4Ψ | 4Ψ | 8Ψ | 2·4Ψ(N-1)/N |
| ZeRO-1 | 4Ψ | 4Ψ | 8Ψ/N | 2·4Ψ(N-1)/N |
| ZeRO-2 | 4Ψ | 4Ψ/N | 8Ψ/N | 2·4Ψ(N-1)/N |
| ZeRO-3 | 4Ψ/N | 4Ψ/N | 8Ψ/N | 3·4Ψ(N-1)/N |

Run: .venv/bin/python benchmarks/bench_scaling.py [--json out.json] [--plots docs/img]
[--results out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from _common import BenchOutput, MiB, machine_info, storage_bytes
from torch import nn

STRATEGIES = ("dp", "zero1", "zero2", "zero3")
WORLDS = (1, 2, 4)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def make_module(d: int, blocks: int) -> nn.Module:
    return nn.Sequential(*[Block(d) for _ in range(blocks)])


def formula(strategy: str, n: int, psi: int) -> dict[str, float]:
    """The ZeRO paper's bytes per rank (fp32) and bytes sent per step."""
    b = 4 * psi
    shard = {"dp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}
    p, g, o = shard[strategy]
    sent = (3 if strategy == "zero3" else 2) * b * (n - 1) / n
    return {"params": b / p, "grads": b / g, "opt_state": 2 * b / o, "sent": sent}


def measure(strategy: str, n: int, d: int, blocks: int) -> dict[str, int]:
    """One AdamW step of ``strategy`` on this rank; the bytes it holds and sent."""
    import shardfn as sf

    torch.manual_seed(0)
    mesh = sf.Mesh({"dp": n})
    fmodel = sf.functional(make_module(d, blocks))
    opt = sf.optim.adamw(1e-3)
    x = torch.randn(8 * n, d, generator=torch.Generator().manual_seed(1)).chunk(n)[
        mesh.index("dp")]

    def loss_of(apply):
        return lambda p: apply(p, x).square().mean()

    sf.reset_comm_stats()
    if strategy == "zero3":
        model = sf.shard_params(fmodel, mesh, "dp", units=Block)
        params = model.init(0)
        state = opt.init(params)
        sf.reset_comm_stats()
        grads = torch.func.grad(loss_of(model.apply))(params)
        grad_bytes = storage_bytes(grads.values())
        updates, state = opt.update(grads, state, params)
    elif strategy == "zero2":
        sharded = sf.shard_opt_state(opt, mesh, "dp", shard_grads=True)
        params = {k: v.requires_grad_() for k, v in fmodel.init(0).items()}
        state = sharded.init(params)
        sf.reset_comm_stats()
        with sharded.overlap(params) as sync:
            loss_of(fmodel.apply)(params).backward()
        reduced = sync.grads()
        left = [p.grad for p in params.values() if p.grad is not None]
        grad_bytes = storage_bytes(list(sf.pytree.tree_leaves(reduced)) + left)
        with torch.no_grad():
            updates, state = sharded.update(reduced, state, params)
    else:
        inner = sf.shard_opt_state(opt, mesh, "dp") if strategy == "zero1" else opt
        params = fmodel.init(0)
        state = inner.init(params)
        sf.reset_comm_stats()
        grads = torch.func.grad(loss_of(fmodel.apply))(params)
        if strategy == "dp":
            grads = sf.pmean(grads, "dp", mesh=mesh)
        grad_bytes = storage_bytes(grads.values())  # ZeRO-1 reduces inside update
        updates, state = inner.update(grads, state, params)
    sent = sf.comm_stats().total_bytes
    tensors = [t for t in sf.pytree.tree_leaves(state) if isinstance(t, torch.Tensor)
               and t.dim() > 0]
    return {"params": storage_bytes(params.values()), "grads": grad_bytes,
            "opt_state": storage_bytes(tensors), "sent": sent}


def run(d: int, blocks: int) -> dict:
    from shardfn.testing import local_world

    psi = sum(p.numel() for p in make_module(d, blocks).parameters())
    rows = []
    for n in WORLDS:
        with local_world(n, timeout=300.0, check=False) as world:
            for strategy in STRATEGIES:
                per_rank = world.run(measure, strategy, n, d, blocks)
                worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
                rows.append({"strategy": strategy, "n": n, "measured": worst,
                             "formula": formula(strategy, n, psi)})
    return {"bench": "scaling", "machine": machine_info(), "num_params": psi, "rows": rows}


def table(result: dict) -> str:
    lines = ["| strategy | N | params+grads+opt MiB/rank (measured) | formula | ratio "
             "| sent MiB/step (measured) | formula |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        m, f = row["measured"], row["formula"]
        mem = m["params"] + m["grads"] + m["opt_state"]
        fmem = f["params"] + f["grads"] + f["opt_state"]
        lines.append(f"| {row['strategy']} | {row['n']} | {mem / MiB:.2f} | {fmem / MiB:.2f} "
                     f"| {mem / fmem:.3f} | {m['sent'] / MiB:.2f} | {f['sent'] / MiB:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plots", default=None, help="folder for the PNGs")
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--results", default=None,
                        help="also write the table as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    d, blocks = (32, 2) if args.quick else (args.d, args.blocks)
    result = run(d, blocks)
    out = BenchOutput("scaling")
    print(machine_info())
    out.setup(f"Model: {blocks} blocks of d={d} ({result['num_params']:,} parameters); one "
              f"AdamW step of each strategy on {', '.join(map(str, WORLDS))} ranks; the "
              "largest value over the ranks.")
    out.table(table(result),
              "Memory per rank and bytes sent per step, measured, beside the ZeRO formulas "
              "(fp32: Ψ parameters of 4 bytes, Adam's two moments 8Ψ).",
              ratio="ratio", peer="ZeRO formula", quantity="memory per rank",
              labels=[f"{r['strategy']}, N={r['n']}" for r in result["rows"]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plots:
        from _plots import scaling_plots

        for path, caption in zip(scaling_plots(out.tables[0].rows, args.plots),
                                 ("memory per rank", "bytes sent per step"), strict=True):
            out.plot(path, caption)
    out.save(args.results)


if __name__ == "__main__":
    main()
