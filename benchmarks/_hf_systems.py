"""The systems of ``bench_hf.py``: one HF Llama trained by shardfn and by torch's own tools.

Every setup builds its system on this rank from :func:`make_hf` (the same weights for
all), then runs the *checked step* (:func:`checked_step`): one step on batch 0 whose loss
must equal the unsharded HF module's and whose full gradients are compared with the
peer's, and one more on batch 0 whose sent bytes are counted
(:class:`_hf_comm.CountCollectives`). A system's ``step(i)`` returns its loss; round ``i``
of the timed run uses batch ``i + 1``.

Example (one more row: register it, then add its key to a group of ``bench_hf.GROUPS``):
    >>> @SYSTEMS.register("sf-zero3-keep", "shardfn shard_params, reshard_after_forward=False")
    ... def setup_keep(ctx):
    ...     ...
    ...     return checked_step(ctx, "sf-zero3-keep", System(step, memory, params),
    ...                         local=True, peer="fsdp2", tree=checked_grads)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from _common import Registry, System, all_ok, max_over_ranks, rel_diff, storage_bytes
from _hf_comm import CountCollectives
from torch import nn

__all__ = ["QUICK", "SYSTEMS", "Config", "Context", "checked_step", "make_hf"]

SYSTEMS = Registry()


@dataclasses.dataclass(frozen=True)
class Config:
    """The Llama and the batch (global: ZeRO-3 splits it over the ranks, TP and PP do not)."""

    vocab: int = 8192
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1376
    batch: int = 8
    seq: int = 64
    microbatches: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.1


QUICK = Config(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
               batch=4, seq=16, microbatches=2)


def make_hf(cfg: Config) -> nn.Module:
    """The Llama, the same weights in every process and for every system (train mode)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate, max_position_embeddings=max(cfg.seq, 64))
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa").train()


class Context:
    """The config, the batches (token ids, also the labels), this rank's rows, the checks."""

    def __init__(self, cfg: Config, rounds: int):
        self.cfg, self.rank, self.world = cfg, dist.get_rank(), dist.get_world_size()
        if cfg.batch % self.world or cfg.batch % cfg.microbatches:
            raise ValueError(f"batch {cfg.batch} must divide by {self.world} ranks and "
                             f"{cfg.microbatches} micro-batches")
        gen = torch.Generator().manual_seed(1000)
        self.batches = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
                        for _ in range(rounds + 1)]
        local = cfg.batch // self.world
        self.rows = slice(self.rank * local, (self.rank + 1) * local)
        self.checks: dict[str, dict] = {}  # key -> loss, reference, bytes sent, diff
        self.trees: dict[str, dict[str, torch.Tensor]] = {}  # the peers' checked trees
        self._references: dict[bool, torch.Tensor] = {}
        self.cpu: dict[str, list[float]] = {}  # key -> CPU seconds of each round's step

    def ids(self, i: int, local: bool = False) -> torch.Tensor:
        """The batch of round ``i`` (its rows of this rank with ``local``); round -1 is the
        checked step's."""
        batch = self.batches[i + 1]
        return batch[self.rows] if local else batch

    def reference_loss(self, local: bool) -> torch.Tensor:
        """The unsharded HF module's loss on batch 0 (this rank's rows with ``local``)."""
        if local not in self._references:
            with torch.no_grad():
                ids = self.ids(-1, local)
                self._references[local] = make_hf(self.cfg)(input_ids=ids, labels=ids).loss
        return self._references[local]

    def mesh(self, axis: str):
        import shardfn as sf

        return sf.Mesh({axis: self.world})


def checked_step(ctx: Context, key: str, system: System, *, local: bool,
                 peer: str | None = None,
                 tree: Callable[[], dict[str, torch.Tensor]] | None = None) -> System:
    """Run ``system.step(-1)``: check its loss against the unsharded HF module's on the same
    rows (on every rank: raises on all if one differs); keep its tree (``tree()``, default
    ``system.params()``: the full gradients of that step), or with ``peer`` compare it
    with the peer's. Then run it once more counting the bytes sent (the first step also
    sends what is sent once, such as the pipelines' activation shapes).

    Returns:
        ``system``, its ``step`` also adding each timed round's CPU time (``process_time``:
        this rank's threads, waits excluded) to ``ctx.cpu[key]``.
    """
    import shardfn as sf

    reference = ctx.reference_loss(local)
    loss = system.step(-1).detach()
    error = None
    try:
        torch.testing.assert_close(loss, reference)
    except AssertionError as e:
        error = f"first loss {loss.item():.6f}, HF's {reference.item():.6f}: " + \
            str(e).splitlines()[-1]
    if not all_ok(error is None):
        raise AssertionError(error or "first loss differs from HF's on another rank")
    full = (tree or system.params)()
    diff = None
    if peer is None:
        ctx.trees[key] = full
    elif peer in ctx.trees:
        diff = max_over_ranks(rel_diff(full, ctx.trees[peer]))
    del full
    # the bytes of a second step: the first also sends what is sent once (shapes)
    sf.reset_comm_stats()
    dist.barrier()
    with CountCollectives(ctx.world) as counter:
        system.step(-1)
    own = sf.comm_stats() if system.counts_comm else None  # shardfn's count of that step
    ctx.checks[key] = {"loss": loss.item(), "reference": reference.item(), "diff": diff,
                       "sent": int(max_over_ranks(counter.sent_bytes)), "by_op": counter.by_op,
                       "comm_stats": own and int(max_over_ranks(own.total_bytes)),
                       "comm_stats_by_op": own and {op: b for (_, op), b in own.by_op.items()}}

    def step(i: int) -> torch.Tensor:
        start = time.process_time()
        loss = system.step(i)
        ctx.cpu.setdefault(key, []).append(time.process_time() - start)
        return loss

    return system._replace(step=step)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _memory(params, grads, opt_state=()) -> dict[str, int]:
    return {"params": storage_bytes(_local(t) for t in params),
            "grads": storage_bytes(_local(t) for t in grads if t is not None),
            "opt_state": storage_bytes(_local(t) for t in opt_state)}


def _full_tree(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``{name: tensor}`` merged, on every rank."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach() for k, v in local.items()})
    return {k: v for part in parts for k, v in part.items()}


# ----------------------------------------------------------------------------- ZeRO-3


@SYSTEMS.register("fsdp2", "torch FSDP2 fully_shard (each decoder layer, then the root)")
def setup_fsdp2(ctx: Context) -> System:
    from torch.distributed.fsdp import fully_shard

    hf, cfg = make_hf(ctx.cfg), ctx.cfg
    for layer in hf.model.layers:
        fully_shard(layer)
    fully_shard(hf)
    opt = torch.optim.AdamW(hf.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            foreach=True)

    def step(i: int) -> torch.Tensor:
        ids = ctx.ids(i, local=True)
        opt.zero_grad(set_to_none=True)
        loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    def memory() -> dict[str, int]:
        params = list(hf.parameters())
        return _memory(params, [p.grad for p in params],
                       [t for s in opt.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor)])

    system = System(step, memory, lambda: {n: _full(p) for n, p in hf.named_parameters()})
    return checked_step(ctx, "fsdp2", system, local=True,  # .grad: kept until the next step
                        tree=lambda: {n: _full(p.grad) for n, p in hf.named_parameters()})


def _sf_zero3(ctx: Context, key: str, **options) -> System:
    """``shard_params`` with its default units, a torch.func step, the donated AdamW."""
    import shardfn as sf

    hf, cfg = make_hf(ctx.cfg), ctx.cfg
    model = sf.shard_params(sf.functional(hf), ctx.mesh("dp"), "dp", **options)
    trainable, rest = model.split_trainable(model.params_from(hf))
    opt = sf.optim.donating(sf.optim.adamw(cfg.lr, weight_decay=cfg.weight_decay))
    holder = {"params": trainable, "state": opt.init(trainable), "grads": {}, "keep": True}
    grad_and_value = torch.func.grad_and_value(lambda params, ids: model.apply(
        model.merge(params, rest), input_ids=ids, labels=ids).loss)

    def step(i: int) -> torch.Tensor:
        holder["grads"] = {}  # as torch's zero_grad(set_to_none=True)
        params = holder["params"]
        grads, loss = grad_and_value(params, ctx.ids(i, local=True))
        if holder.pop("keep", False):  # the checked step's, before the update is donated
            holder["checked"] = {n: g.clone() for n, g in grads.items()}
        updates, holder["state"] = opt.update(grads, holder["state"], params)
        holder["params"] = sf.optim.apply_updates(params, updates, donate=True)
        holder["grads"] = grads  # donated into the updates: the same storage
        return loss

    def memory() -> dict[str, int]:
        return _memory(holder["params"].values(), holder["grads"].values(),
                       sf.pytree.tree_leaves(holder["state"]))

    system = System(step, memory, lambda: model.gather(holder["params"]), counts_comm=True)
    return checked_step(ctx, key, system, local=True, peer="fsdp2",
                        tree=lambda: model.gather(holder.pop("checked")))


# FSDP2 never reshards its root after forward; reshard_after_forward="units" is the same trade
SYSTEMS.register("sf-zero3", "shardfn shard_params (ZeRO-3, default units, root kept as "
                 "FSDP2's, torch.func)")(
    lambda ctx: _sf_zero3(ctx, "sf-zero3", reshard_after_forward="units"))
SYSTEMS.register("sf-zero3-wrong", "deliberately wrong: shard_params with grad_reduce='sum' "
                 "(gradients x N)", default=False)(
    lambda ctx: _sf_zero3(ctx, "sf-zero3-wrong", grad_reduce="sum",
                          reshard_after_forward="units"))


# ----------------------------------------------------------------------------- tensor parallel


def torch_tp_plan(hf: nn.Module) -> dict:
    """The model's own ``tp_plan`` in torch's styles, one entry per module path."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate())}
    paths = [p for p, _ in hf.named_modules() if p]
    plan = {}
    for pattern, style in hf.tp_plan.items():
        if style not in styles:
            raise ValueError(f"torch TP peer: no torch style for HF style {style!r} "
                             f"({pattern!r}); this benchmark maps {sorted(styles)}")
        plan.update({p: styles[style]() for p in paths if fnmatch.fnmatchcase(p, pattern)})
    return plan


@SYSTEMS.register("torch-tp", "torch parallelize_module (the model's plan in torch styles)")
def setup_torch_tp(ctx: Context) -> System:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    hf = make_hf(ctx.cfg)
    parallelize_module(hf, init_device_mesh("cpu", (ctx.world,), mesh_dim_names=("tp",)),
                       torch_tp_plan(hf))
    params = list(hf.parameters())

    def step(i: int) -> torch.Tensor:
        hf.zero_grad(set_to_none=True)
        loss = hf(input_ids=ctx.ids(i), labels=ctx.ids(i)).loss
        loss.backward()
        return loss

    system = System(step, lambda: _memory(params, [p.grad for p in params]),
                    lambda: {n: _full(p.grad) for n, p in hf.named_parameters()})
    return checked_step(ctx, "torch-tp", system, local=False)


def _sf_tp(ctx: Context, key: str, autograd: bool) -> System:
    """``tensor_split(plan="auto")``: torch.func ``grad_and_value`` or leaf tensors and
    ``loss.backward()`` over the same ``tp.apply``."""
    import shardfn as sf

    hf = make_hf(ctx.cfg)
    tp = sf.tensor_split(sf.functional(hf), ctx.mesh("tp"), "tp", plan="auto")
    trainable, rest = tp.split_trainable(tp.params_from(hf))
    if autograd:
        trainable = {n: t.requires_grad_() for n, t in trainable.items()}
    last = {"grads": {}}

    def loss_fn(params, ids):
        return tp.apply(tp.merge(params, rest), input_ids=ids, labels=ids).loss

    grad_and_value = torch.func.grad_and_value(loss_fn)

    def step(i: int) -> torch.Tensor:
        last["grads"] = {}
        if not autograd:
            last["grads"], loss = grad_and_value(trainable, ctx.ids(i))
            return loss
        for leaf in trainable.values():
            leaf.grad = None
        loss = loss_fn(trainable, ctx.ids(i))
        loss.backward()
        last["grads"] = {n: t.grad for n, t in trainable.items()}
        return loss

    system = System(step, lambda: _memory(trainable.values(), last["grads"].values()),
                    lambda: tp.gather(last["grads"]), counts_comm=True)
    return checked_step(ctx, key, system, local=False, peer="torch-tp")


SYSTEMS.register("sf-tp", "shardfn tensor_split(plan='auto'); torch.func step")(
    lambda ctx: _sf_tp(ctx, "sf-tp", autograd=False))
SYSTEMS.register("sf-tp-autograd", "shardfn tensor_split(plan='auto'); autograd step")(
    lambda ctx: _sf_tp(ctx, "sf-tp-autograd", autograd=True))


# ----------------------------------------------------------------------------- pipeline


class _Stage(nn.Module):
    """Consecutive pipeline units as one torch ``PipelineStage`` module: the boundary tuple
    arrives as separate arguments and leaves contiguous (gloo sends no views)."""

    def __init__(self, units: list[nn.Module]):
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, *x):
        x = x[0] if len(x) == 1 else x
        for unit in self.units:
            x = unit(x)
        if isinstance(x, tuple):
            return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in x)
        return x


def balance(ctx: Context) -> list[int]:
    """Units per stage: the embedding, the layers and the head (norm + lm_head) in equal
    counts, the first stages taking one more when they do not divide."""
    units = ctx.cfg.layers + 2
    return [units // ctx.world + (r < units % ctx.world) for r in range(ctx.world)]


@SYSTEMS.register("torch-pp", "torch pipelining Schedule1F1B (the same units and split)")
def setup_torch_pp(ctx: Context) -> System:
    from torch.distributed import pipelining

    from shardfn.transforms.pipeline.hf_units import hf_units, pack_inputs

    hf, cfg = make_hf(ctx.cfg), ctx.cfg
    units, bounds = list(hf_units(hf).units), [0]
    for count in balance(ctx):
        bounds.append(bounds[-1] + count)
    module = _Stage(units[bounds[ctx.rank]:bounds[ctx.rank + 1]])
    stage = pipelining.PipelineStage(module, ctx.rank, ctx.world, torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(
        stage, n_microbatches=cfg.microbatches,
        loss_fn=lambda logits, labels: hf.loss_function(logits=logits, labels=labels,
                                                        vocab_size=cfg.vocab))
    names = {id(p): n for n, p in hf.named_parameters()}
    local = {names[id(p)]: p for p in module.parameters()}
    first, last = ctx.rank == 0, ctx.rank == ctx.world - 1

    def step(i: int) -> torch.Tensor:
        for p in local.values():
            p.grad = None
        ids, losses = ctx.ids(i), []
        schedule.step(*((pack_inputs(ids),) if first else ()), target=ids if last else None,
                      losses=losses)
        # the mean of the micro-batches' losses (torch scales the gradients by 1/m), on
        # every rank as shardfn's
        loss = torch.stack(losses).mean().detach() if last else torch.zeros(())
        dist.broadcast(loss, ctx.world - 1)
        return loss

    system = System(step, lambda: _memory(local.values(), [p.grad for p in local.values()]),
                    lambda: _full_tree({n: p.grad for n, p in local.items()}))
    return checked_step(ctx, "torch-pp", system, local=False)


@SYSTEMS.register("sf-pp", "shardfn pipeline_stages(hf, schedule='1f1b')")
def setup_sf_pp(ctx: Context) -> System:
    import shardfn as sf

    hf, cfg = make_hf(ctx.cfg), ctx.cfg
    pp = sf.pipeline_stages(hf, ctx.mesh("pp"), "pp", balance=balance(ctx), schedule="1f1b",
                            microbatches=cfg.microbatches)
    params = pp.params_from(hf)
    last = {"grads": {}}

    def step(i: int) -> torch.Tensor:
        last["grads"] = {}
        ids = ctx.ids(i)
        loss, last["grads"] = pp.value_and_grad(params, {"input_ids": ids, "labels": ids})
        return loss

    system = System(step, lambda: _memory(params.values(), last["grads"].values()),
                    lambda: _full_tree(last["grads"]), counts_comm=True)
    return checked_step(ctx, "sf-pp", system, local=False, peer="torch-pp")
