"""Data-parallel, ZeRO-1/2 and ZeRO-3 step time and memory: shardfn against torch and FairScale.

Every system trains the same model (same initial weights, same batches, AdamW)
on N local CPU ranks (gloo, one thread per rank); all are measured in one run,
interleaved in rounds. Prints a markdown table: median step time and its ratio
to torch DDP, params+grads+optimizer-state bytes per rank, bytes sent per rank
per step (shardfn systems, from ``sf.comm_stats()``) and the largest relative
difference of the final parameters from DDP's.

Run (about 2.5 minutes on 2 idle cores):
    .venv/bin/python benchmarks/bench_dp.py
    .venv/bin/python benchmarks/bench_dp.py --quick                 # tiny model, smoke test
    .venv/bin/python benchmarks/bench_dp.py --systems ddp sf-zero1  # a subset
    .venv/bin/python benchmarks/bench_dp.py --breakdown             # phases of the DP/ZeRO steps
    .venv/bin/python benchmarks/bench_dp.py --breakdown-zero3       # what a shard_params step costs

Adding a row: write ``setup(ctx) -> System`` and decorate it with
``@SYSTEMS.register(key, label)``; see :mod:`_common`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    MALLOC_CACHE_ENV,
    BenchOutput,
    MiB,
    Registry,
    System,
    machine_info,
    markdown_table,
    run_interleaved,
    storage_bytes,
    write_json,
)
from torch import nn

SYSTEMS = Registry()


# ----------------------------------------------------------------------------- model and data


@dataclasses.dataclass(frozen=True)
class Config:
    """Model, batch and optimizer shared by every system."""

    d: int = 512
    hidden: int = 2048
    blocks: int = 8
    batch: int = 8  # global batch (sequences); each rank gets batch / N
    tokens: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0


QUICK = Config(d=64, hidden=256, blocks=2, batch=8, tokens=8)


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPModel(nn.Module):
    """``blocks`` residual MLP blocks and a final projection."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg.d, cfg.hidden) for _ in range(cfg.blocks))
        self.proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class Context:
    """What a setup function gets: the config, this rank's batches, a model factory, the mesh."""

    def __init__(self, cfg: Config, total_steps: int):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if cfg.batch % self.world:
            raise ValueError(f"global batch {cfg.batch} is not divisible by {self.world} ranks")
        local = cfg.batch // self.world
        self.batches = []
        for i in range(total_steps):
            g = torch.Generator().manual_seed(1000 + i)
            x = torch.randn(cfg.batch, cfg.tokens, cfg.d, generator=g)
            y = torch.randn(cfg.batch, cfg.tokens, cfg.d, generator=g)
            rows = slice(self.rank * local, (self.rank + 1) * local)
            self.batches.append((x[rows].clone(), y[rows].clone()))
        self._mesh = None

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(input, target)`` for step ``i``."""
        return self.batches[i]

    def make_module(self) -> MLPModel:
        """A fresh model with the same initial weights on every rank and for every system."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return MLPModel(self.cfg)

    def initial_params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.make_module().named_parameters()}

    @property
    def mesh(self):
        import shardfn as sf

        if self._mesh is None:
            self._mesh = sf.Mesh({"dp": self.world})
        return self._mesh


def num_params(cfg: Config) -> int:
    return sum(p.numel() for p in MLPModel(cfg).parameters())


# ----------------------------------------------------------------------------- torch peers


def _torch_memory(module: nn.Module, state_tensors) -> dict[str, int]:
    params = list(module.parameters())
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "opt_state": storage_bytes(state_tensors()),
    }


def _state_tensors(state) -> list[torch.Tensor]:
    return [v for per_param in state.values() for v in per_param.values()
            if isinstance(v, torch.Tensor)]


def _module_params(module: nn.Module):
    return lambda: {k: v.detach() for k, v in module.named_parameters()}


@SYSTEMS.register("ddp", "torch DDP")
def setup_ddp(ctx: Context) -> System:
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = ctx.make_module()
    # gradient_as_bucket_view: .grad are views of DDP's buckets, so the grads counted
    # below are everything DDP holds for gradients (the default keeps a second copy).
    ddp = DDP(module, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(module.parameters(), lr=ctx.cfg.lr,
                            weight_decay=ctx.cfg.weight_decay, foreach=True)

    def step(i: int) -> None:
        x, y = ctx.batch(i)
        opt.zero_grad(set_to_none=False)
        loss_of(ddp(x), y).backward()
        opt.step()

    return System(step, lambda: _torch_memory(module, lambda: _state_tensors(opt.state)),
                  _module_params(module))


@SYSTEMS.register("zero", "torch ZeroRedundancyOptimizer + DDP")
def setup_zero(ctx: Context) -> System:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = ctx.make_module()
    ddp = DDP(module, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=ctx.cfg.lr, weight_decay=ctx.cfg.weight_decay, foreach=True)

    def step(i: int) -> None:
        x, y = ctx.batch(i)
        opt.zero_grad(set_to_none=False)
        loss_of(ddp(x), y).backward()
        opt.step()

    return System(step, lambda: _torch_memory(module, lambda: _state_tensors(opt.optim.state)),
                  _module_params(module))


@SYSTEMS.register("fairscale", "fairscale OSS + ShardedDataParallel")
def setup_fairscale(ctx: Context) -> System:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    module = ctx.make_module()
    opt = OSS(module.parameters(), optim=torch.optim.AdamW, lr=ctx.cfg.lr,
              weight_decay=ctx.cfg.weight_decay, foreach=True)
    sdp = ShardedDataParallel(module, opt)

    def step(i: int) -> None:
        x, y = ctx.batch(i)
        sdp.zero_grad(set_to_none=True)
        loss_of(sdp(x), y).backward()
        opt.step()

    return System(step, lambda: _torch_memory(module, lambda: _state_tensors(opt.optim.state)),
                  _module_params(module))


# ----------------------------------------------------------------------------- shardfn


def _tree_memory(params, grads, state) -> dict[str, int]:
    import shardfn as sf

    return {
        "params": storage_bytes(sf.pytree.tree_leaves(params)),
        "grads": storage_bytes(sf.pytree.tree_leaves(grads)),
        "opt_state": storage_bytes(sf.pytree.tree_leaves(state)),
    }


def _pure_step_system(ctx: Context, reduce, opt, *, donate: bool = False,
                      grads_kept=None, engine: bool = False, grad_and_value=None) -> System:
    """A torch.func step: grad_and_value, ``reduce`` (grads -> grads), ``opt``, apply_updates.

    ``donate``: ``apply_updates(..., donate=True)`` (the optimizer and ``reduce`` are built
    donating by the caller). ``grads_kept(grads) -> bytes`` overrides how the gradient
    memory is counted. ``engine``: the gradient from ``sf.grad_and_value`` (first order
    on the autograd engine) instead of ``torch.func.grad_and_value``. ``grad_and_value``:
    the maker of the gradient function itself (``dp.grad_and_value``: reduced already).
    """
    import shardfn as sf

    model = sf.functional(ctx.make_module())
    holder = {"params": ctx.initial_params(), "grads": None}
    holder["state"] = opt.init(holder["params"])

    def loss_fn(params, x, y):
        return loss_of(model.apply(params, x), y)

    if grad_and_value is None:
        grad_and_value = sf.grad_and_value if engine else torch.func.grad_and_value
    grad_and_value = grad_and_value(loss_fn)

    def step(i: int) -> None:
        x, y = ctx.batch(i)
        params = holder["params"]
        grads, _ = grad_and_value(params, x, y)
        grads = reduce(grads)
        updates, holder["state"] = opt.update(grads, holder["state"], params)
        holder["params"] = sf.optim.apply_updates(params, updates, donate=donate)
        holder["grads"] = grads

    def memory() -> dict[str, int]:
        out = _tree_memory(holder["params"], holder["grads"], holder["state"])
        if grads_kept is not None:
            out["grads"] = grads_kept(holder["grads"])
        return out

    return System(step, memory, lambda: holder["params"], counts_comm=True)


def _adamw(ctx: Context, donate: bool = False):
    import shardfn as sf

    opt = sf.optim.adamw(ctx.cfg.lr, weight_decay=ctx.cfg.weight_decay)
    return sf.optim.donating(opt) if donate else opt


def _autograd_step_system(ctx: Context, sync_of, opt, reduced_memory) -> System:
    """An autograd step: leaf tensors, ``loss.backward()`` inside ``sync_of(params)``,
    ``opt.update(sync.grads(), ...)``, ``apply_updates(..., donate=True)``.

    ``reduced_memory(params leaves, reduced grads) -> bytes`` counts the gradient memory.
    """
    import shardfn as sf

    model = sf.functional(ctx.make_module())
    params = {k: v.requires_grad_() for k, v in ctx.initial_params().items()}
    leaves = sf.pytree.tree_leaves(params)
    sync_params = sync_of(params)
    holder = {"state": opt.init(params), "grads": None}

    def step(i: int) -> None:
        x, y = ctx.batch(i)
        for p in leaves:
            p.grad = None
        with sync_params as sync:
            loss_of(model.apply(params, x), y).backward()
        grads = sync.grads()
        with torch.no_grad():
            updates, holder["state"] = opt.update(grads, holder["state"], params)
        sf.optim.apply_updates(params, updates, donate=True)
        holder["grads"] = grads

    def memory() -> dict[str, int]:
        return {"params": storage_bytes(leaves), "grads": reduced_memory(leaves, holder["grads"]),
                "opt_state": storage_bytes(sf.pytree.tree_leaves(holder["state"]))}

    return System(step, memory, lambda: {k: v.detach() for k, v in params.items()},
                  counts_comm=True)


@SYSTEMS.register("sf-dp", "shardfn data_parallel (torch.func, donated)")
def setup_sf_dp(ctx: Context) -> System:
    import shardfn as sf

    dp = sf.data_parallel(ctx.mesh, "dp", donate=True)
    return _pure_step_system(ctx, dp.reduce_grads, _adamw(ctx, donate=True), donate=True)


@SYSTEMS.register("sf-dp-engine", "shardfn data_parallel (sf.grad_and_value, donated)")
def setup_sf_dp_engine(ctx: Context) -> System:
    import shardfn as sf

    dp = sf.data_parallel(ctx.mesh, "dp", donate=True)
    return _pure_step_system(ctx, dp.reduce_grads, _adamw(ctx, donate=True), donate=True,
                             engine=True)


@SYSTEMS.register("sf-dp-grad", "shardfn data_parallel (dp.grad_and_value, overlapped, donated)")
def setup_sf_dp_grad(ctx: Context) -> System:
    import shardfn as sf

    dp = sf.data_parallel(ctx.mesh, "dp")
    return _pure_step_system(ctx, lambda grads: grads, _adamw(ctx, donate=True), donate=True,
                             grad_and_value=dp.grad_and_value)


@SYSTEMS.register("sf-dp-grad-pure",
                  "shardfn data_parallel (dp.grad_and_value, overlapped, no donation)")
def setup_sf_dp_grad_pure(ctx: Context) -> System:
    import shardfn as sf

    dp = sf.data_parallel(ctx.mesh, "dp")
    return _pure_step_system(ctx, lambda grads: grads, _adamw(ctx),
                             grad_and_value=dp.grad_and_value)


@SYSTEMS.register("sf-dp-pure", "shardfn data_parallel (torch.func, no donation)")
def setup_sf_dp_pure(ctx: Context) -> System:
    import shardfn as sf

    dp = sf.data_parallel(ctx.mesh, "dp")
    return _pure_step_system(ctx, dp.reduce_grads, _adamw(ctx))


@SYSTEMS.register("sf-dp-overlap", "shardfn data_parallel (autograd overlap, donated)")
def setup_sf_dp_overlap(ctx: Context) -> System:
    import shardfn as sf

    dp = sf.data_parallel(ctx.mesh, "dp")
    # sync.grads() are the .grad tensors, averaged in place: count them once
    return _autograd_step_system(ctx, dp.overlap, _adamw(ctx, donate=True),
                                 lambda leaves, grads: storage_bytes(p.grad for p in leaves))


@SYSTEMS.register("sf-zero1", "shardfn ZeRO-1 (torch.func, donated)")
def setup_sf_zero1(ctx: Context) -> System:
    import shardfn as sf

    opt = sf.shard_opt_state(_adamw(ctx), ctx.mesh, "dp", donate=True)
    return _pure_step_system(ctx, lambda grads: grads, opt, donate=True)


@SYSTEMS.register("sf-zero1-pure", "shardfn ZeRO-1 (torch.func, no donation)")
def setup_sf_zero1_pure(ctx: Context) -> System:
    import shardfn as sf

    opt = sf.shard_opt_state(_adamw(ctx), ctx.mesh, "dp")
    return _pure_step_system(ctx, lambda grads: grads, opt)


@SYSTEMS.register("sf-zero1-overlap", "shardfn ZeRO-1 (autograd overlap, donated)")
def setup_sf_zero1_overlap(ctx: Context) -> System:
    import shardfn as sf

    opt = sf.shard_opt_state(_adamw(ctx), ctx.mesh, "dp", donate=True)

    def reduced_memory(leaves, reduced) -> int:  # ZeRO-1 keeps .grad, plus the reduced part
        return storage_bytes([p.grad for p in leaves] + sf.pytree.tree_leaves(reduced.local))

    return _autograd_step_system(ctx, opt.overlap, opt, reduced_memory)


@SYSTEMS.register("sf-zero2", "shardfn ZeRO-2 (autograd overlap, donated)")
def setup_sf_zero2(ctx: Context) -> System:
    import shardfn as sf

    opt = sf.shard_opt_state(_adamw(ctx), ctx.mesh, "dp", shard_grads=True, donate=True)

    def reduced_memory(leaves, reduced) -> int:  # .grad are all freed; the reduced part stays
        return storage_bytes([p.grad for p in leaves] + sf.pytree.tree_leaves(reduced.local))

    return _autograd_step_system(ctx, opt.overlap, opt, reduced_memory)


@SYSTEMS.register("sf-shard-params", "shardfn shard_params (ZeRO-3, torch.func, donated)")
def setup_sf_shard_params(ctx: Context) -> System:
    return _shard_params_system(ctx)


def _shard_params_system(ctx: Context, **options) -> System:
    """ZeRO-3: shard_params per Block, AdamW on the shards, a torch.func step (donated)."""
    import shardfn as sf

    model = sf.shard_params(sf.functional(ctx.make_module()), ctx.mesh, "dp", units=Block,
                            **options)
    opt = _adamw(ctx, donate=True)
    holder = {"shards": model.shard(ctx.initial_params()), "grads": None}
    holder["state"] = opt.init(holder["shards"])
    grad_and_value = torch.func.grad_and_value(
        lambda shards, x, y: loss_of(model.apply(shards, x), y))

    def step(i: int) -> None:
        x, y = ctx.batch(i)
        shards = holder["shards"]
        grads, _ = grad_and_value(shards, x, y)  # shard gradients, already reduce-scattered
        updates, holder["state"] = opt.update(grads, holder["state"], shards)
        holder["shards"] = sf.optim.apply_updates(shards, updates, donate=True)
        holder["grads"] = grads

    def params() -> dict[str, torch.Tensor]:
        return sf.gather(holder["shards"], model.specs, ctx.mesh)

    return System(step, lambda: _tree_memory(holder["shards"], holder["grads"], holder["state"]),
                  params, counts_comm=True)


@SYSTEMS.register("sf-shard-params-keep",
                  "shardfn shard_params, reshard_after_forward=False (2Ψ)")
def setup_sf_shard_params_keep(ctx: Context) -> System:
    """shard_params keeping each unit's full parameters from forward to backward (one
    all-gather per unit and step; the whole model is gathered during the step)."""
    return _shard_params_system(ctx, reshard_after_forward=False)


@SYSTEMS.register("sf-shard-params-recompute",
                  "shardfn shard_params, remat=nothing_saveable (units recomputed)",
                  default=False)
def setup_sf_shard_params_recompute(ctx: Context) -> System:
    """shard_params with activation checkpointing at unit boundaries: least activation
    memory (not counted in the table), one more forward per step."""
    import shardfn as sf

    return _shard_params_system(ctx, remat=sf.checkpoint_policies.nothing_saveable)


@SYSTEMS.register("fsdp2", "torch FSDP2 fully_shard per block")
def setup_fsdp2(ctx: Context) -> System:
    return _fsdp2_system(ctx, reshard_after_forward=True)


@SYSTEMS.register("fsdp2-keep", "torch FSDP2, reshard_after_forward=False")
def setup_fsdp2_keep(ctx: Context) -> System:
    return _fsdp2_system(ctx, reshard_after_forward=False)


def _fsdp2_system(ctx: Context, reshard_after_forward: bool) -> System:
    """torch FSDP2: ``fully_shard`` on each block, then on the root; torch AdamW."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns that the root's output is a view (of the last Linear's output); the step
    # makes no in-place op on it, as the correctness column confirms
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    module = ctx.make_module()
    for block in module.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(module, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(module.parameters(), lr=ctx.cfg.lr,
                            weight_decay=ctx.cfg.weight_decay, foreach=True)

    def step(i: int) -> None:
        x, y = ctx.batch(i)
        opt.zero_grad(set_to_none=True)
        loss_of(module(x), y).backward()
        opt.step()

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def memory() -> dict[str, int]:
        params = list(module.parameters())
        return {"params": storage_bytes(local(p) for p in params),
                "grads": storage_bytes(local(p.grad) for p in params if p.grad is not None),
                "opt_state": storage_bytes(local(t) for t in _state_tensors(opt.state))}

    def params() -> dict[str, torch.Tensor]:
        return {name: p.full_tensor().detach() for name, p in module.named_parameters()}

    return System(step, memory, params)


@SYSTEMS.register("broken-no-reduce", "check: shardfn without gradient averaging (wrong)",
                  default=False)
def setup_broken(ctx: Context) -> System:
    """Deliberately wrong (each rank steps on its own gradients): the diff column must flag it."""
    return _pure_step_system(ctx, lambda grads: grads, _adamw(ctx))


# ----------------------------------------------------------------------------- breakdown


def rank_breakdown(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """Time the phases of the shardfn steps and their torch counterparts (best of a few).

    Donated phases run in place on scratch copies (the values drift, the work does not).
    Returns ``(phase, ms, minor page faults in the last repetition)`` per phase.
    """

    import shardfn as sf
    from shardfn.transforms.shard_opt_state import _all_gather  # the ZeRO all-gather alone

    torch.set_num_threads(1)
    cfg = QUICK if args.quick else Config()
    ctx = Context(cfg, 1)
    x, y = ctx.batch(0)
    model = sf.functional(ctx.make_module())
    params = ctx.initial_params()
    opt, opt_donating = _adamw(ctx), _adamw(ctx, donate=True)
    state = opt.init(params)
    scratch_state = opt.init(params)
    dp, dp_donating = sf.data_parallel(ctx.mesh, "dp"), sf.data_parallel(ctx.mesh, "dp",
                                                                           donate=True)
    zero = sf.shard_opt_state(opt, ctx.mesh, "dp")
    zero_donating = sf.shard_opt_state(opt, ctx.mesh, "dp", donate=True)
    zero_state, zero_scratch_state = zero.init(params), zero.init(params)
    part = zero.partition(params)
    grad_and_value = torch.func.grad_and_value(lambda p, x, y: loss_of(model.apply(p, x), y))
    module = ctx.make_module()
    torch_opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  foreach=True)

    def torch_fwd_bwd():
        torch_opt.zero_grad(set_to_none=False)
        loss_of(module(x), y).backward()

    torch_fwd_bwd()
    grads, _ = grad_and_value(params, x, y)
    scratch = sf.pytree.tree_map(torch.clone, grads)
    scratch_params = sf.pytree.tree_map(torch.clone, params)
    averaged = dp.reduce_grads(grads)
    updates, _ = opt.update(averaged, state, params)
    local_grads = zero.reduce_grads(grads, params)
    local_params = part.local(params)
    local_updates, _ = opt.update(local_grads, zero_state.inner, local_params)
    param_leaves = sf.pytree.tree_leaves(params)
    plain = torch.cat([g.reshape(-1) for g in sf.pytree.tree_leaves(grads)])

    def zero_own_update_donated():
        with sf.optim.donated(updates=True, state=True):
            return opt.update(local_grads, zero_scratch_state.inner, local_params)

    phases = {
        "torch: forward+backward (nn.Module)": torch_fwd_bwd,
        "torch: AdamW.step (foreach, in place)": torch_opt.step,
        "torch: dist.all_reduce in place (one flat)": lambda: dist.all_reduce(plain),
        "shardfn: torch.func.grad_and_value": lambda: grad_and_value(params, x, y),
        "shardfn: data_parallel.reduce_grads": lambda: dp.reduce_grads(grads),
        "shardfn: data_parallel.reduce_grads (donated)": lambda: dp_donating.reduce_grads(scratch),
        "shardfn: adamw update (full tree)": lambda: opt.update(averaged, state, params),
        "shardfn: adamw update (full tree, donated)":
            lambda: opt_donating.update(scratch, scratch_state, params),
        "shardfn: apply_updates": lambda: sf.optim.apply_updates(params, updates),
        "shardfn: apply_updates (donated)":
            lambda: sf.optim.apply_updates(scratch_params, updates, donate=True),
        "shardfn: shard_opt_state update (total)": lambda: zero.update(grads, zero_state, params),
        "shardfn: shard_opt_state update (total, donated)":
            lambda: zero_donating.update(scratch, zero_scratch_state, params),
        "  ZeRO: reduce-scatter (reduce_grads)": lambda: zero.reduce_grads(grads, params),
        "  ZeRO: adamw update (own part)": lambda: opt.update(local_grads, zero_state.inner,
                                                              local_params),
        "  ZeRO: adamw update (own part, donated)": zero_own_update_donated,
        "  ZeRO: all-gather of the updates (new tensors)":
            lambda: _all_gather(part, sf.pytree.tree_leaves(local_updates), param_leaves,
                                ctx_axis(ctx), None),
        "  ZeRO: all-gather of the updates (into donated)":
            lambda: _all_gather(part, sf.pytree.tree_leaves(local_updates), param_leaves,
                                ctx_axis(ctx), sf.pytree.tree_leaves(scratch)),
    }
    return _time_phases(phases, args.warmup + args.steps)


def rank_breakdown_zero3(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """Time what a shard_params (ZeRO-3) step is made of, against the unsharded step.

    Returns ``(phase, ms, minor page faults in the last repetition)`` per phase.
    """

    import shardfn as sf

    torch.set_num_threads(1)
    cfg = QUICK if args.quick else Config()
    ctx = Context(cfg, 1)
    x, y = ctx.batch(0)
    ax = ctx_axis(ctx)
    fmodel = sf.functional(ctx.make_module())
    params = ctx.initial_params()
    variants = {
        "default": {},
        "reshard_after_forward=False": {"reshard_after_forward": False},
        "remat=nothing_saveable": {"remat": sf.checkpoint_policies.nothing_saveable},
        "prefetch=0": {"prefetch": 0},
    }
    models = {k: sf.shard_params(fmodel, ctx.mesh, "dp", units=Block, **kw)
              for k, kw in variants.items()}
    shards = models["default"].shard(params)

    def grad_of(model):
        g = torch.func.grad_and_value(lambda s, x, y: loss_of(model.apply(s, x), y))
        return lambda: g(shards, x, y)

    plain = torch.func.grad_and_value(lambda p, x, y: loss_of(fmodel.apply(p, x), y))
    block = {k: v for k, v in params.items() if k.startswith("blocks.0.")}
    unit_flat = torch.cat([v.reshape(-1) for v in block.values()])
    unit_shard = unit_flat[: unit_flat.numel() // ax.size].clone()
    ops = getattr(torch, "ops")._c10d_functional  # noqa: B009 - cloudpickle by value chokes on torch.ops
    phases = {
        "unsharded: torch.func.grad_and_value": lambda: plain(params, x, y),
        "unsharded: forward only (no grad)": lambda: _no_grad(fmodel.apply, params, x),
        **{f"shard_params {k}: grad_and_value": grad_of(m) for k, m in models.items()},
        "shard_params default: forward only (no grad)":
            lambda: _no_grad(models["default"].apply, shards, x),
        "one unit (2.1M params): all_gather_into_tensor (functional)":
            lambda: ops.wait_tensor(ops.all_gather_into_tensor(unit_shard, ax.size,
                                                               ax.group_name)),
        "one unit: reduce_scatter_tensor (functional)":
            lambda: ops.wait_tensor(ops.reduce_scatter_tensor(unit_flat, "sum", ax.size,
                                                              ax.group_name)),
        "one unit: dist.all_reduce in place (for scale)": lambda: dist.all_reduce(unit_flat),
    }
    return _time_phases(phases, args.warmup + args.steps)


def _time_phases(phases: dict, repetitions: int) -> list[tuple[str, float, int]]:
    """Run every phase ``repetitions`` times, each between two barriers.

    Returns ``(phase, best ms, minor page faults in the last repetition)`` per phase.
    """
    import resource

    best = dict.fromkeys(phases, float("inf"))
    faults = dict.fromkeys(phases, 0)
    for _ in range(repetitions):
        for name, fn in phases.items():
            dist.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            best[name] = min(best[name], time.perf_counter() - t0)
            faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return [(name, best[name] * 1e3, faults[name]) for name in phases]


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def ctx_axis(ctx: Context):
    """The resolved "dp" axis (what the internal collectives take)."""
    from shardfn.primitives import _comm

    return _comm.resolve("dp", ctx.mesh)


# ----------------------------------------------------------------------------- driver


def pin_to_core(rank: int) -> None:
    """Pin every thread of this rank (compute, gloo's, and those started later, which
    inherit it) to core ``rank % cores``."""
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[rank % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:  # a thread that just ended
            pass


def rank_main(args: argparse.Namespace) -> tuple[list, float]:
    torch.set_num_threads(1)
    if args.pin:
        pin_to_core(dist.get_rank())
    cfg = QUICK if args.quick else Config()
    ctx = Context(cfg, args.warmup + args.steps)
    log = (lambda msg: print(msg, flush=True)) if ctx.rank == 0 else (lambda msg: None)
    t0 = time.perf_counter()
    reference = "ddp" if "ddp" in args.systems else args.systems[0]
    results = run_interleaved(ctx, SYSTEMS, args.systems, warmup=args.warmup, steps=args.steps,
                              reference=reference, log=log)
    return results, time.perf_counter() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local CPU ranks (gloo)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per system")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS.defaults(),
                        choices=list(SYSTEMS.entries), metavar="KEY",
                        help=f"systems to run, in table order (all: {list(SYSTEMS.entries)})")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test")
    parser.add_argument("--json", default=None, help="also write the results here (report.py)")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of the table, time the phases of the shardfn steps "
                             "(best of --warmup + --steps repetitions)")
    parser.add_argument("--breakdown-zero3", action="store_true",
                        help="instead of the table, time what a shard_params step is made of")
    parser.add_argument("--pin", action="store_true",
                        help="pin each rank (all its threads) to its own core")
    parser.add_argument("--malloc-cache", action="store_true",
                        help="start the ranks with glibc malloc keeping freed memory (no mmap, "
                             "no trim), so fresh large tensors do not page-fault")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from shardfn.testing import local_world

    cfg = QUICK if args.quick else Config()
    psi = num_params(cfg)
    if args.malloc_cache:  # read by glibc when the spawned ranks start
        os.environ.update(MALLOC_CACHE_ENV)
    malloc = " ".join(f"{k}={os.environ[k]}" for k in MALLOC_CACHE_ENV if k in os.environ)
    out = BenchOutput("dp")
    print(f"$ {out.command}")
    print(machine_info())
    out.setup(f"Model: {cfg.blocks} blocks, d={cfg.d}, hidden={cfg.hidden}, "
              f"{psi / 1e6:.2f}M params ({psi * 4 / MiB:.1f} MiB fp32); global batch "
              f"{cfg.batch}x{cfg.tokens}x{cfg.d}; AdamW(lr={cfg.lr}, wd={cfg.weight_decay}); "
              f"{args.ranks} ranks, {args.warmup}+{args.steps} steps per system, interleaved; "
              f"malloc: {malloc or 'glibc defaults'}; ranks "
              f"{'pinned to a core each' if args.pin else 'unpinned'}.")
    if args.breakdown or args.breakdown_zero3:
        fn = rank_breakdown if args.breakdown else rank_breakdown_zero3
        with local_world(args.ranks, timeout=600.0, check=False) as world:
            rows = world.run(fn, args)[0]
        print("\n| phase (rank 0, best of the repetitions) | ms | minor page faults |")
        print("|---|---:|---:|")
        for name, ms, faults in rows:
            print(f"| {name} | {ms:.1f} | {faults} |")
        return
    with local_world(args.ranks, timeout=600.0, check=False) as world:
        outputs = world.run(rank_main, args)
    results, seconds = outputs[0]
    reference = "ddp" if "ddp" in args.systems else args.systems[0]
    print()
    out.table(markdown_table(results, reference, psi),
              "Step time on rank 0 between barriers (median, p25–p75 and min over the timed "
              "steps), memory per rank (max over ranks) and the parameters' largest relative "
              "difference from DDP's after the run.",
              ratio="ratio to DDP", peer=SYSTEMS.label(reference), quantity="step time")
    write_json(args.json, "dp", results, reference, num_params=psi, ranks=args.ranks)
    zero_formula = (4 + 4 + 8 / args.ranks) * psi
    out.note(f"ZeRO-1 formula 4Ψ+4Ψ+8Ψ/N = {zero_formula / MiB:.0f} MiB "
             f"({zero_formula / psi:.0f} B/param); ZeRO-2 4Ψ+(4Ψ+8Ψ)/N = "
             f"{(4 + 12 / args.ranks) * psi / MiB:.0f} MiB; ring volume 2Ψ(N-1)/N = "
             f"{2 * 4 * psi * (args.ranks - 1) / args.ranks / MiB:.1f} MiB/step.")
    print(f"Run took {seconds:.0f} s.")
    out.save(args.results)


if __name__ == "__main__":
    main()
