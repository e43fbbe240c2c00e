"""shardfn demo: a short sharded training run on local CPU processes or under torchrun.

Four ranks train a small MLP on a synthetic regression task, written as a pure
step: per-rank gradients with torch.func, then an AdamW optimizer whose state is
sharded over the data-parallel axis (ZeRO-1/2, `sf.shard_opt_state`). Every step
prints the loss; at the end each rank reports its memory (parameters, optimizer
state) and the bytes it sent, and the result is checked against the same
training on one process with the whole batch. The last line prints the final
loss and a checksum of the parameters: the same world size gives the same line
under either launcher.

Run: make demo   (or: python examples/demo.py [--ranks 4] [--steps 12])
     torchrun --nproc-per-node 2 examples/demo.py [--steps 12]
Under torchrun the script joins the launched world (sf.distributed.initialize(): gloo
on CPU, NCCL with one GPU per local rank) and only rank 0 prints; see docs/launching.md.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import shardfn as sf


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 1))


def make_batch(step: int, size: int = 64):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 32, generator=gen)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    return x, y


def train_on_rank(steps: int, sharded: bool, device: str = "cpu"):
    """One rank's training loop (also the single-process reference when unsharded)."""
    import torch.distributed as dist

    n = dist.get_world_size() if sharded and dist.is_initialized() else 1
    rank = dist.get_rank() if sharded and dist.is_initialized() else 0
    # the unsharded reference may run inside a launched world: a mesh of this process alone
    mesh = sf.Mesh({"dp": n}) if sharded else sf.Mesh({"dp": 1}, ranks=[_global_rank()])
    model = sf.functional(make_model())
    params = {name: value.to(device) for name, value in model.init(seed=0).items()}
    opt = sf.optim.adamw(1e-2, weight_decay=0.01)
    if sharded:
        opt = sf.shard_opt_state(opt, mesh, axis="dp")
    state = opt.init(params)

    def loss_fn(params, x, y):
        return ((model.apply(params, x) - y) ** 2).mean()

    losses = []
    sf.reset_comm_stats()
    for step in range(steps):
        x, y = make_batch(step % 4)  # a small fixed data set, visited in turn
        x, y = x.chunk(n)[rank].to(device), y.chunk(n)[rank].to(device)  # this rank's share
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        losses.append(float(sf.pmean(loss, "dp", mesh=mesh)))
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    state_bytes = sum(t.numel() * t.element_size() for t in sf.pytree.tree_leaves(state)
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
    params = {name: value.cpu() for name, value in params.items()}
    return losses, params, param_bytes, state_bytes, sf.comm_stats().total_bytes


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def checksum(params: dict[str, torch.Tensor]) -> float:
    """One number that changes with any parameter: the float64 sum of |values|."""
    return float(sum(value.double().abs().sum() for value in params.values()))


def run_launched(steps: int, ranks: int | None) -> list | None:
    """Under torchrun: join the world, train this rank; rank 0 gets every rank's results."""
    import torch.distributed as dist

    info = sf.distributed.initialize()
    if ranks is not None and ranks != info.world_size:
        raise SystemExit(f"--ranks {ranks} but torchrun started {info.world_size} processes; "
                         "under torchrun the world size is --nproc-per-node x --nnodes")
    if info.rank == 0:
        print(f"joined a torchrun world of {info.world_size} processes ({info.backend}, "
              f"{info.device}) ...", flush=True)
    mine = train_on_rank(steps, True, str(info.device))
    results = [None] * info.world_size if info.rank == 0 else None
    dist.gather_object(mine, results, dst=0)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None,
                        help="local CPU processes (default 4); under torchrun: its world size")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()

    launched = sf.distributed.launch_environment() is not None
    if launched:
        results = run_launched(args.steps, args.ranks)
        if results is None:  # ranks other than 0 only train
            return
    else:
        ranks = 4 if args.ranks is None else args.ranks
        print(f"starting a local world of {ranks} CPU processes (gloo) ...", flush=True)
        with sf.testing.local_world(ranks) as world:
            results = world.run(train_on_rank, args.steps, True)
    reference = train_on_rank(args.steps, sharded=False)

    losses = results[0][0]
    for step, loss in enumerate(losses):
        single = reference[0][step]
        print(f"step {step:2d}  loss {loss:.5f}  (one process, full batch: {single:.5f})")
    print("\nper-rank memory (fp32):")
    for rank, (_, _, param_bytes, state_bytes, sent) in enumerate(results):
        print(f"  rank {rank}: params {param_bytes / 2**20:6.2f} MiB   AdamW state "
              f"{state_bytes / 2**20:6.2f} MiB   sent {sent / 2**20:6.2f} MiB")
    print(f"  one process, unsharded AdamW state: {reference[3] / 2**20:6.2f} MiB")
    final = results[0][1]
    for name, value in reference[1].items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5)
    print("\nsharded training matches single-process training: OK")
    print(f"final: world {len(results)}  loss {losses[-1]:.8f}  "
          f"param checksum {checksum(final):.10f}")


if __name__ == "__main__":
    main()
