"""Tensor-parallel step time and memory: shardfn tensor_split against torch parallelize_module.

Each model is trained by every system (shardfn twice, torch once) from the same
weights on the same batches (every rank gets the whole batch, as tensor
parallelism wants), with AdamW; all are measured in one run, interleaved step
by step. Models:

* ``mlp``: the data-parallel benchmark's model (``bench_dp.MLPModel``: residual
  blocks ``x + fc2(gelu(fc1(norm(x))))`` and a final projection), ``fc1``
  colwise and ``fc2`` rowwise; MSE loss.
* ``gpt``: the reference GPT (``shardfn.models.GPT``, tied embeddings) with
  Megatron's plan: ``tok`` vocab-split, ``qkv``/``fc1`` colwise, ``proj``/``fc2``
  rowwise, the head colwise with its logits left vocab-split, and a
  vocab-parallel cross entropy (shardfn: ``gpt_tp_plan()`` +
  ``sf.vocab_parallel_cross_entropy``; torch: ``RowwiseParallel`` on the
  embedding, ``ColwiseParallel(output_layouts=Shard(-1))`` on the head, the
  loss under ``loss_parallel()``).
* ``gpt-sp``: the same with sequence parallelism (shardfn:
  ``gpt_tp_plan(sequence_parallel=True)``; torch: ``SequenceParallel`` on the
  LayerNorms, ``PrepareModuleInput`` before attention and MLP, rowwise outputs
  ``Shard(1)``). A system whose setup raises NotImplementedError is shown as
  "n/a (not available)".

shardfn is measured twice: its usual pure step (``torch.func.grad_and_value``
over ``tp.apply``) and the same ``tp.apply`` with leaf tensors and
``loss.backward()`` (torch.func's ``grad`` keeps more memory alive during the
backward than autograd does, see docs/benchmarks.md). Both use the donated
``sf.optim.adamw``.

Fairness: before timing, each system's loss on the first batch must equal the
unsplit model's (``assert_close``), otherwise its row fails. torch's
``ColwiseParallel`` cuts a fused ``[q|k|v]`` weight into contiguous rows, which
would give rank 0 all of q and half of k; its copy of the model gets the qkv
rows permuted to ``[q_r|k_r|v_r]`` per rank (the same heads per rank as
shardfn's fused split, so the same function), and its attention reads the local
head count from the local weight (torch users set ``n_heads // tp``). After the
run, the final parameters of the two are compared (max rel diff).

Measured per system: median step time (rank 0, between barriers; the step is
forward + backward + AdamW), the median CPU time of a step (``process_time``
of the rank, all its threads; max over ranks: less sensitive than the wall
clock to other jobs on a shared machine), the persistent bytes per rank (params + grads +
optimizer state, distinct storages of the local tensors) and the peak resident
memory of one more step above what was resident before it (``VmHWM`` after
``malloc_trim`` and a reset of the high-water mark; the same method for all,
max over ranks).

Run (about 2-3 minutes on 2 idle cores):
    .venv/bin/python benchmarks/bench_tp.py
    .venv/bin/python benchmarks/bench_tp.py --quick          # tiny models, a smoke test
    .venv/bin/python benchmarks/bench_tp.py --models gpt --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import importlib.util
import os
import statistics
import sys
import time
import types
from collections.abc import Callable

if importlib.util.find_spec("shardfn") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import einops
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import BenchOutput, MiB, all_ok, machine_info, max_over_ranks, rel_diff, storage_bytes
from bench_dp import Config as MLPConfig
from bench_dp import MLPModel
from torch import nn

# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class GPTBench:
    """The reference GPT's shape and the batch (every rank gets all of it)."""

    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    seq_len: int = 128
    batch: int = 8


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures."""

    mlp: MLPConfig = MLPConfig()
    gpt: GPTBench = GPTBench()
    lr: float = 1e-3
    weight_decay: float = 0.1


FULL = Settings()
QUICK = Settings(mlp=MLPConfig(d=64, hidden=256, blocks=2, batch=4, tokens=8),
                 gpt=GPTBench(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16,
                              batch=2))


class Model(types.SimpleNamespace):
    """One model of the run: ``make_module()``, ``batches``, ``loss_reference`` (unsplit)."""


def _gpt_config(g: GPTBench):
    from shardfn.models import GPTConfig

    return GPTConfig(vocab_size=g.vocab_size, d_model=g.d_model, n_layers=g.n_layers,
                     n_heads=g.n_heads, seq_len=g.seq_len, dropout=0.0)


def build_model(kind: str, settings: Settings, total_steps: int) -> Model:
    """The module factory (same weights every call), the batches and the unsplit first loss."""
    from shardfn.models import GPT

    if kind == "mlp":
        cfg = settings.mlp

        def make() -> nn.Module:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return MLPModel(cfg)

        def batch(g: torch.Generator):
            return (torch.randn(cfg.batch, cfg.tokens, cfg.d, generator=g),
                    torch.randn(cfg.batch, cfg.tokens, cfg.d, generator=g))

        def unsplit_loss(module, x, y):
            return F.mse_loss(module(x), y)
    else:
        g_cfg = settings.gpt
        config = _gpt_config(g_cfg)

        def make() -> nn.Module:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return GPT(config)

        def batch(g: torch.Generator):
            shape = (g_cfg.batch, g_cfg.seq_len)
            return (torch.randint(0, g_cfg.vocab_size, shape, generator=g),
                    torch.randint(0, g_cfg.vocab_size, shape, generator=g))

        def unsplit_loss(module, x, y):
            return F.cross_entropy(module(x).flatten(0, 1), y.flatten())

    batches = [batch(torch.Generator().manual_seed(1000 + i)) for i in range(total_steps)]
    with torch.no_grad():
        first = unsplit_loss(make(), *batches[0])
    return Model(kind=kind, make_module=make, batches=batches, loss_reference=first,
                 settings=settings)


def initial_params(model: Model) -> dict[str, torch.Tensor]:
    """The full initial parameters (tied ones once, by their first name)."""
    return {k: v.detach().clone() for k, v in model.make_module().named_parameters()}


@dataclasses.dataclass
class TPSystem:
    """One trainer on this rank: ``step(i)``, ``loss(i)`` (no grad), ``state()`` tensors,
    ``params()`` full tensors by module name."""

    step: Callable[[int], None]
    loss: Callable[[int], torch.Tensor]
    state: Callable[[], dict[str, list[torch.Tensor]]]
    params: Callable[[], dict[str, torch.Tensor]]


# ----------------------------------------------------------------------------- shardfn


def mlp_plan() -> dict[str, str]:
    return {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


def setup_shardfn(model: Model, sequence_parallel: bool, autograd: bool = False,
                  engine: bool = False) -> TPSystem:
    """``sf.tensor_split`` + torch.func ``grad_and_value`` + donated ``sf.optim.adamw``.

    ``autograd``: the parameters are leaf tensors and the gradients come from
    ``loss.backward()`` (the same ``tp.apply``), the rest unchanged. ``engine``: the
    gradient from ``sf.grad_and_value`` (first order on the autograd engine).
    """
    import shardfn as sf
    from shardfn.models import gpt_tp_plan

    mesh = sf.Mesh({"tp": dist.get_world_size()})
    fmodel = sf.functional(model.make_module())
    plan = mlp_plan() if model.kind == "mlp" else gpt_tp_plan(sequence_parallel)
    tp = sf.tensor_split(fmodel, mesh, "tp", plan)
    settings = model.settings
    opt = sf.optim.donating(sf.optim.adamw(settings.lr, weight_decay=settings.weight_decay))
    holder = {"params": tp.shard_params_tree(initial_params(model)), "grads": {}}
    holder["opt"] = opt.init(holder["params"])

    if model.kind == "mlp":
        def loss_fn(params, x, y):
            return F.mse_loss(tp.apply(params, x), y)
    else:
        def loss_fn(params, x, y):  # the logits stay vocab-split
            return sf.vocab_parallel_cross_entropy(tp.apply(params, x), y, "tp", mesh=mesh)

    grad_and_value = (sf.grad_and_value if engine else torch.func.grad_and_value)(loss_fn)
    if autograd:
        holder["params"] = {n: t.requires_grad_() for n, t in holder["params"].items()}

    def gradients(params, x, y):
        if not autograd:
            return grad_and_value(params, x, y)[0]
        for leaf in params.values():
            leaf.grad = None
        loss_fn(params, x, y).backward()
        return {n: leaf.grad for n, leaf in params.items()}

    def step(i: int) -> None:
        holder["grads"] = {}  # as torch's zero_grad(set_to_none=True): last step's are freed
        params = holder["params"]
        grads = gradients(params, *model.batches[i])
        with torch.no_grad():
            updates, holder["opt"] = opt.update(grads, holder["opt"], params)
        holder["params"] = sf.optim.apply_updates(params, updates, donate=True)
        holder["grads"] = grads  # donated into the updates: the same storage

    def loss(i: int) -> torch.Tensor:
        with torch.no_grad():
            return loss_fn(holder["params"], *model.batches[i])

    def state() -> dict[str, list[torch.Tensor]]:
        return {"params": list(holder["params"].values()),
                "grads": list(holder["grads"].values()),
                "opt_state": sf.pytree.tree_leaves(holder["opt"])}

    def params() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return tp.gather_params(holder["params"])

    return TPSystem(step, loss, state, params)


def setup_shardfn_autograd(model: Model, sequence_parallel: bool) -> TPSystem:
    """:func:`setup_shardfn` with ``loss.backward()`` instead of torch.func."""
    return setup_shardfn(model, sequence_parallel, autograd=True)


def setup_shardfn_engine(model: Model, sequence_parallel: bool) -> TPSystem:
    """:func:`setup_shardfn` with ``sf.grad_and_value`` instead of torch.func's."""
    return setup_shardfn(model, sequence_parallel, engine=True)


# ----------------------------------------------------------------------------- torch


def _torch_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``shardfn.models.Attention.forward`` reading the local head count from the local
    (DTensor) weight: what torch users do by setting ``n_heads // tp``."""
    weight = self.qkv.weight
    rows = (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]
    local_heads = rows // (3 * self.head_dim)
    batch = x.shape[:-1]
    q, k, v = (t.unflatten(-1, (local_heads, self.head_dim)).transpose(-3, -2)
               for t in self.qkv(x).chunk(3, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(-3, -2).reshape(*batch, local_heads * self.head_dim)
    return self.resid_dropout(self.proj(y))


def _qkv_rows(tensor: torch.Tensor, tp: int, to_rank_major: bool) -> torch.Tensor:
    """``[q|k|v]`` rows to ``[q_0|k_0|v_0|q_1|...]`` (rank-major, so a contiguous split
    gives each rank whole heads of q, k and v) or back."""
    if to_rank_major:
        return einops.rearrange(tensor, "(part tp rows) ... -> (tp part rows) ...", part=3, tp=tp)
    return einops.rearrange(tensor, "(tp part rows) ... -> (part tp rows) ...", part=3, tp=tp)


def torch_gpt_plan(n_layers: int, sequence_parallel: bool) -> dict:
    """torch's usual GPT plan (as in torchtitan), with or without sequence parallelism."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        plan = {"tok": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(n_layers):
            plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                         f"blocks.{i}.attn.proj": RowwiseParallel(),
                         f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                         f"blocks.{i}.mlp.fc2": RowwiseParallel()})
        return plan
    # the embeddings' outputs are reduce-scattered on the sequence ([B, T, d] dim 1 and the
    # positions' [T, d] dim 0, both vocab-split so their gradients stay exact)
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                    use_local_output=False)}
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),))
    for i in range(n_layers):
        plan.update({f"blocks.{i}.ln1": SequenceParallel(),
                     f"blocks.{i}.attn": gather_sequence,
                     f"blocks.{i}.attn.qkv": ColwiseParallel(),
                     f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                     f"blocks.{i}.ln2": SequenceParallel(),
                     f"blocks.{i}.mlp": gather_sequence,
                     f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                     f"blocks.{i}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def setup_torch(model: Model, sequence_parallel: bool) -> TPSystem:
    """``parallelize_module`` + ``loss.backward()`` + ``torch.optim.AdamW(foreach=True)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    tp = dist.get_world_size()
    device_mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    module = model.make_module()
    if model.kind == "mlp":
        plan = {}
        for i in range(len(module.blocks)):
            plan.update({f"blocks.{i}.fc1": ColwiseParallel(),
                         f"blocks.{i}.fc2": RowwiseParallel()})
    else:
        with torch.no_grad():
            for block in module.blocks:
                for p in (block.attn.qkv.weight, block.attn.qkv.bias):
                    p.copy_(_qkv_rows(p, tp, to_rank_major=True))
                block.attn.forward = types.MethodType(_torch_attention_forward, block.attn)
        plan = torch_gpt_plan(len(module.blocks), sequence_parallel)
    parallelize_module(module, device_mesh, plan)
    # (not ``module.config``: cloudpickle would take that name for torch.distributed.config)
    if model.kind != "mlp" and _gpt_config(model.settings.gpt).tied_embeddings:
        module.head.weight = module.tok.weight  # parallelize_module replaced tok's parameter
    settings = model.settings
    # foreach kernels take no mix of DTensor and plain tensors: one param group of each
    groups = [[p for p in module.parameters() if hasattr(p, "to_local") == is_dtensor]
              for is_dtensor in (True, False)]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=settings.lr,
                            weight_decay=settings.weight_decay, foreach=True)

    def loss_of(i: int) -> torch.Tensor:  # inside loss_parallel() for the GPT
        x, y = model.batches[i]
        if model.kind == "mlp":
            return F.mse_loss(module(x), y)
        return F.cross_entropy(module(x).flatten(0, 1), y.flatten())

    def loss_context():
        return contextlib.nullcontext() if model.kind == "mlp" else loss_parallel()

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        with loss_context():
            loss_of(i).backward()
        opt.step()

    def loss(i: int) -> torch.Tensor:
        with torch.no_grad(), loss_context():
            value = loss_of(i)
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def state() -> dict[str, list[torch.Tensor]]:
        params = list(module.parameters())
        moments = [v for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor)]
        return {"params": [local(p) for p in params],
                "grads": [local(p.grad) for p in params if p.grad is not None],
                "opt_state": [local(t) for t in moments]}

    def params() -> dict[str, torch.Tensor]:
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for n, p in module.named_parameters()}
        for name in [n for n in full if n.endswith(("attn.qkv.weight", "attn.qkv.bias"))]:
            full[name] = _qkv_rows(full[name], tp, to_rank_major=False)
        return full

    return TPSystem(step, loss, state, params)


# ----------------------------------------------------------------------------- measuring


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def step_peak_bytes(step: Callable[[], None]) -> int:
    """Peak resident bytes of ``step()`` above what was resident just before it.

    Frees what it can first (``gc``, glibc ``malloc_trim``), then resets the kernel's
    high-water mark (``/proc/self/clear_refs`` = 5) so ``VmHWM`` is this step's peak.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _kib("VmRSS")
    step()
    return (_kib("VmHWM") - before) * 1024


def without_key_bias(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` with the key part of every fused qkv bias left out.

    Its true gradient is zero (adding a constant to every key shifts each row of the
    attention scores by a constant, which softmax ignores), so both systems' gradients
    there are round-off, which Adam scales up to steps of about ``lr``: the two drift
    apart there by design, not by a bug.
    """
    out = dict(params)
    for name in [n for n in params if n.endswith("attn.qkv.bias")]:
        q, _, v = params[name].chunk(3)
        out[name] = torch.cat([q, v])
    return out


@dataclasses.dataclass
class Row:
    """What rank 0 reports for one system."""

    times_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s: list[float] = dataclasses.field(default_factory=list)  # this rank's CPU time
    cpu_median_s: float = float("nan")  # the median of cpu_s, max over ranks
    state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    peak_bytes: int = 0
    loss: float = float("nan")
    error: str | None = None


#: the reference last: every other row is compared with it
SETUPS = {"shardfn": setup_shardfn, "shardfn-engine": setup_shardfn_engine,
          "shardfn-autograd": setup_shardfn_autograd, "torch": setup_torch}
SHARDFN_STEPS = {"shardfn": "torch.func step", "shardfn-engine": "sf.grad_and_value step",
                 "shardfn-autograd": "autograd step"}


def measure_group(kind: str, settings: Settings, warmup: int, steps: int,
                  log: Callable[[str], None]) -> dict:
    """Set up shardfn and torch on ``kind``, check their first loss, time them interleaved."""
    from torch.testing import assert_close

    model = build_model(kind, settings, warmup + steps + 1)
    sequence_parallel = kind == "gpt-sp"
    systems: dict[str, TPSystem] = {}
    rows = {name: Row() for name in SETUPS}
    for name, setup in SETUPS.items():
        error = None
        try:
            system = setup(model, sequence_parallel)
            rows[name].loss = float(system.loss(0))
            assert_close(system.loss(0), model.loss_reference, msg=lambda m: "first loss " + m)
            systems[name] = system
        except NotImplementedError:
            error = "n/a (not available)"
        except Exception as e:  # noqa: BLE001 - a broken system must not stop the run
            error = "failed: " + f"{type(e).__name__}: {e}".splitlines()[0][:150]
        if not all_ok(error is None):
            systems.pop(name, None)
            rows[name].error = error or "failed on another rank"
        log(f"  {kind} {name}: {rows[name].error or 'ok'} (first loss {rows[name].loss:.6f}, "
            f"unsplit {float(model.loss_reference):.6f})")
    order = list(systems)
    for r in range(warmup + steps):
        shift = r % max(1, len(order))
        for name in order[shift:] + order[:shift]:
            dist.barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            systems[name].step(r)
            cpu = time.process_time() - cpu0
            dist.barrier()
            if r >= warmup:
                rows[name].times_s.append(time.perf_counter() - t0)
                rows[name].cpu_s.append(cpu)
        log(f"  {kind}: round {r + 1}/{warmup + steps}")
    last = warmup + steps
    for name, system in systems.items():
        rows[name].cpu_median_s = max_over_ranks(statistics.median(rows[name].cpu_s))
        peak = step_peak_bytes(lambda system=system: system.step(last))
        rows[name].peak_bytes = int(max_over_ranks(peak))
        rows[name].state_bytes = {k: int(max_over_ranks(storage_bytes(v)))
                                  for k, v in system.state().items()}
    diff: dict[str, float | None] = dict.fromkeys(SHARDFN_STEPS)
    if "torch" in systems:
        reference = without_key_bias(systems["torch"].params())
        for name in SHARDFN_STEPS:
            if name in systems:
                got = without_key_bias(systems[name].params())
                diff[name] = max_over_ranks(rel_diff(got, reference))
    params = sum(p.numel() for p in model.make_module().parameters())
    return {"kind": kind, "rows": rows, "diff": diff, "params": params}


def rank_main(args: argparse.Namespace) -> tuple[list[dict], float]:
    torch.set_num_threads(1)
    settings = QUICK if args.quick else FULL
    log = (lambda msg: print(msg, flush=True)) if dist.get_rank() == 0 else (lambda msg: None)
    t0 = time.perf_counter()
    groups = [measure_group(kind, settings, args.warmup, args.steps, log) for kind in args.models]
    return groups, time.perf_counter() - t0


# ----------------------------------------------------------------------------- table

PLANS = {"mlp": "fc1 colwise, fc2 rowwise",
         "gpt": "vocab tok, colwise qkv/fc1/head, rowwise proj/fc2",
         "gpt-sp": "the same + sequence parallel"}


def _mib(row: Row) -> str:
    if row.error or not row.state_bytes:
        return "—"
    s = row.state_bytes
    return (f"{sum(s.values()) / MiB:.1f} ({s['params'] / MiB:.1f}+{s['grads'] / MiB:.1f}"
            f"+{s['opt_state'] / MiB:.1f}) / {row.peak_bytes / MiB:.0f}")


def _ms(row: Row) -> str:
    if row.error:
        return row.error
    return f"{statistics.median(row.times_s) * 1e3:.0f}" if row.times_s else "—"


def table(groups: list[dict]) -> str:
    lines = ["| model | plan | shardfn ms | torch ms | ratio (target ≤ 1.0) "
             "| CPU ms/step/rank shardfn / torch (ratio) "
             "| shardfn MiB/rank: state (p+g+opt) / step peak | torch MiB/rank: same "
             "| first loss (all = unsplit) | max rel diff at the end |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g, name in ((g, name) for g in groups for name in SHARDFN_STEPS):
        sf_row, torch_row = g["rows"][name], g["rows"]["torch"]
        ratio, cpu = "—", "—"
        if sf_row.times_s and torch_row.times_s:
            value = statistics.median(sf_row.times_s) / statistics.median(torch_row.times_s)
            ratio = f"{value:.3f}"
            cpu = (f"{sf_row.cpu_median_s * 1e3:.0f} / {torch_row.cpu_median_s * 1e3:.0f} "
                   f"({sf_row.cpu_median_s / torch_row.cpu_median_s:.3f})")
        diff = "—" if g["diff"][name] is None else f"{g['diff'][name]:.1e}"
        lines.append(f"| {g['kind']} ({g['params'] / 1e6:.2f}M) | {PLANS[g['kind']]}; "
                     f"shardfn {SHARDFN_STEPS[name]} "
                     f"| {_ms(sf_row)} | {_ms(torch_row)} | {ratio} | {cpu} | {_mib(sf_row)} "
                     f"| {_mib(torch_row)} | {torch_row.loss:.4f} | {diff} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local CPU ranks (gloo) = tp size")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per system")
    parser.add_argument("--models", nargs="+", default=list(PLANS), choices=list(PLANS),
                        help="which models, in table order")
    parser.add_argument("--quick", action="store_true", help="tiny models and 1+3 steps")
    parser.add_argument("--results", default=None,
                        help="also write the tables as JSON here (benchmarks/report.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from shardfn.testing import local_world

    settings = QUICK if args.quick else FULL
    out = BenchOutput("tp")
    print(f"$ {out.command}")
    print(machine_info())
    out.setup(f"Models: mlp {settings.mlp}; gpt {settings.gpt}. AdamW(lr={settings.lr}, "
              f"wd={settings.weight_decay}); {args.ranks} ranks (tp={args.ranks}), "
              f"{args.warmup}+{args.steps} steps per system, interleaved.")
    with local_world(args.ranks, timeout=600.0, check=False) as world:
        groups, seconds = world.run(rank_main, args)[0]
    print()
    out.table(table(groups),
              "Each shardfn step against torch parallelize_module on the same model and plan: "
              "step time on rank 0 (median), CPU time per rank, memory per rank (training "
              "state and the step's peak), the first loss of every system (all equal the "
              "unsplit model's) and the parameters' largest relative difference at the end.",
              ratio="ratio (target", peer="torch parallelize_module", quantity="step time",
              labels=[f"{g['kind']}: shardfn {SHARDFN_STEPS[name]}" for g in groups
                      for name in SHARDFN_STEPS])
    print(f"\nRun took {seconds:.0f} s.")
    out.save(args.results)


if __name__ == "__main__":
    main()
