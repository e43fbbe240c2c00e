"""Correct sharded steps and deliberately broken ones, for the kit's mutation test.

Four families, each a correct sharded step and its unsharded reference:

* ``dp``: data parallel, hand-written: ``pmean`` of the gradients and the loss;
* ``megatron``: a replicated input layer, then a Megatron MLP (``pvary`` into the
  colwise layer, ``psum_invariant`` out of the rowwise one) over ``"tp"``;
* ``fsdp``: ``sf.shard_params`` of a :class:`~shardfn.testing.TinyModel`, uneven dims;
* ``zero``: hand-written ZeRO-2 with momentum: gradients reduce-scattered per leaf,
  the momentum sharded, parameters all-gathered.

``MUTANTS`` maps each broken variant to ``(family, the hint it must get)``: the eight of
issue 14, and a ninth (the last shard's padding put in front of its rows).
Every function is importable, so the local world's ranks can unpickle them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

import shardfn as sf
from shardfn.testing import Trainer, loss_trainer


class Case(NamedTuple):
    """What ``assert_sharded_matches`` takes for one comparison."""

    sharded: Any  # mesh -> Trainer
    reference: Any  # () -> Trainer
    mesh: dict[str, int]
    inputs: list
    split: Any = "default"


def _normal(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- dp: hand-written data parallel ------------------------------------------------------


def mlp_params(d: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    return {"w1": _normal((d, hidden), seed) / d**0.5, "b1": _normal((hidden,), seed + 1) * 0.1,
            "w2": _normal((hidden, 1), seed + 2) / hidden**0.5}


def mlp_loss(params, batch):
    x, y = batch
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"]).squeeze(-1) - y).square().mean()


def regression_batches(rows: int, d: int, steps: int, seed: int) -> list:
    return [(_normal((rows, d), seed + 10 * s), _normal((rows,), seed + 10 * s + 1))
            for s in range(steps)]


def dp_sharded(d, hidden, seed, bug=None):
    def make(mesh):
        axes = mesh.axis_names
        rank_seed = seed + (mesh.index(axes) if bug == "rank_seed" else 0)
        reduce = {None: lambda g: sf.pmean(g, axes), "rank_seed": lambda g: sf.pmean(g, axes),
                  "psum_for_pmean": lambda g: sf.psum(g, axes), "missing_grad_mean": None}[bug]
        return loss_trainer(mlp_params(d, hidden, rank_seed), mlp_loss, opt=sf.optim.sgd(0.1),
                            reduce_grads=reduce, reduce_loss=lambda loss: sf.pmean(loss, axes))
    return make


def dp_reference(d, hidden, seed):
    return lambda: loss_trainer(mlp_params(d, hidden, seed), mlp_loss, opt=sf.optim.sgd(0.1))


def dp_case(mesh, *, d=3, hidden=5, per_rank=2, steps=2, seed=0, bug=None) -> Case:
    n = 1
    for size in mesh.values():
        n *= size
    return Case(dp_sharded(d, hidden, seed, bug), dp_reference(d, hidden, seed), dict(mesh),
                regression_batches(per_rank * n, d, steps, seed), split=tuple(mesh))


# --- megatron: a replicated layer, then colwise / rowwise ---------------------------------


def megatron_params(d: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    return {"w0": _normal((d, d), seed) / d**0.5, "w1": _normal((hidden, d), seed + 1) / d**0.5,
            "w2": _normal((d, hidden), seed + 2) / hidden**0.5}


def megatron_loss(params, batch, axis=None, pvary=True):
    x, y = batch
    h = torch.tanh(x @ params["w0"].T)
    if axis is not None and pvary:
        h = sf.pvary(h, axis)
    out = torch.nn.functional.gelu(h @ params["w1"].T) @ params["w2"].T
    if axis is not None:
        out = sf.psum_invariant(out, axis)
    return (out - y).square().mean()


MEGATRON_SPECS = {"w0": sf.P(), "w1": sf.P("tp", None), "w2": sf.P(None, "tp")}


def megatron_sharded(d, hidden, seed, bug=None):
    def make(mesh):
        specs = dict(MEGATRON_SPECS)
        if bug == "wrong_spec_dim":
            specs["w1"] = sf.P(None, "tp")  # the shards are rows: this gathers columns
        params = sf.shard(megatron_params(d, hidden, seed), MEGATRON_SPECS, mesh)

        def loss(p, batch):
            return megatron_loss(p, batch, "tp", pvary=bug != "forgotten_pvary")

        if bug == "wrong_spec_dim":  # even split: a bare P gathers the exact size
            gather = lambda values: {  # noqa: E731
                k: sf.gather(v, specs, mesh, padded=True) if k in ("params", "grads") else v
                for k, v in values.items()}
        else:
            layouts = sf.layout_of(megatron_params(d, hidden, seed), MEGATRON_SPECS)
            gather = sf.testing.gather_with({"params": layouts, "grads": layouts}, mesh)
        return loss_trainer(params, loss, opt=sf.optim.sgd(0.1), gather=gather)
    return make


def megatron_reference(d, hidden, seed):
    return lambda: loss_trainer(megatron_params(d, hidden, seed), megatron_loss,
                                opt=sf.optim.sgd(0.1))


def megatron_case(tp, *, d=4, per_tp=3, rows=4, steps=2, seed=0, bug=None) -> Case:
    hidden = per_tp * tp
    return Case(megatron_sharded(d, hidden, seed, bug), megatron_reference(d, hidden, seed),
                {"tp": tp}, [(_normal((rows, d), seed + s), _normal((rows, d), seed + 7 + s))
                             for s in range(steps)], split=None)


# --- fsdp: sf.shard_params of a tiny model --------------------------------------------------


def _trainable_loss(fmodel_apply, spec, rest_of):
    def loss(trainable, batch):
        return spec.loss(fmodel_apply, {**trainable, **rest_of(trainable)}, batch)
    return loss


def fsdp_sharded(spec, seed, bug=None):
    def make(mesh):
        model = sf.shard_params(sf.functional(spec()), mesh, "dp")
        trainable, rest = model.split_trainable(model.init(seed))
        if bug == "padding_in_front":  # the last rank's zero padding put before its rows
            trainable = {k: _pad_in_front(v, model.specs[k].shape, mesh)
                         for k, v in trainable.items()}
        loss = _trainable_loss(model.apply, spec, lambda _: rest)
        specs = {k: model.specs[k] for k in trainable}
        if bug == "padding_leaked":  # bare specs gathered at the padded size
            bare = {k: sf.P(*layout.spec) for k, layout in specs.items()}
            gather = lambda values: {  # noqa: E731
                k: sf.gather(v, bare, mesh, padded=True) if k in ("params", "grads") else v
                for k, v in values.items()}
        else:
            opt_specs = sf.testing.state_specs(sf.optim.adam(1e-2).init(trainable), specs)
            gather = sf.testing.gather_with({"params": specs, "grads": specs,
                                             "opt_state": opt_specs}, mesh)
        return loss_trainer(trainable, loss, opt=sf.optim.adam(1e-2),
                            reduce_loss=lambda value: sf.pmean(value, "dp"), gather=gather)
    return make


def _pad_in_front(shard, shape, mesh):
    n, rank = mesh.size("dp"), mesh.index("dp")
    pad = shard.shape[0] * n - shape[0] if shard.dim() else 0
    return torch.roll(shard, pad, 0) if pad and rank == n - 1 else shard


def fsdp_reference(spec, seed):
    def make():
        fmodel = sf.functional(spec())
        trainable, rest = fmodel.split_trainable(fmodel.init(seed))
        return loss_trainer(trainable, _trainable_loss(fmodel.apply, spec, lambda _: rest),
                            opt=sf.optim.adam(1e-2))
    return make


def fsdp_case(n, spec=None, *, per_rank=1, steps=2, seed=0, bug=None) -> Case:
    spec = spec or sf.testing.TinyModel("mlp", d_model=5, hidden=7)
    return Case(fsdp_sharded(spec, seed, bug), fsdp_reference(spec, seed), {"dp": n},
                [spec.batch(per_rank * n, seed + s) for s in range(steps)])


# --- zero: hand-written ZeRO-2 with momentum -----------------------------------------------


def _zero_step(lr, beta, bug):
    def step(state, batch):
        mesh = state["mesh"]
        n, rank = mesh.size("dp"), mesh.index("dp")
        params, momentum = state["params"], state["opt_state"]
        loss, grads = _local_value_and_grad(params, batch)
        new_params, new_momentum, shards = {}, {}, {}
        for name, g in grads.items():
            if bug == "wrong_chunk":  # each rank reduces the next rank's rows
                g = torch.roll(g, -(g.shape[0] // n), 0)
            shard = sf.psum_scatter(g, "dp", dim=0) / n
            m = beta * momentum[name] + shard
            stale = bug == "stale_opt_shard" and rank == n - 1
            new_momentum[name] = momentum[name] if stale else m  # not written back
            own = params[name].chunk(n)[rank] - lr * m
            new_params[name] = sf.all_gather(own, "dp", dim=0)
            shards[name] = shard
        return ({"mesh": mesh, "params": new_params, "opt_state": new_momentum},
                {"loss": sf.pmean(loss, "dp"), "grads": shards})
    return step


def _local_value_and_grad(params, batch):
    grads, loss = torch.func.grad_and_value(mlp_loss)(params, batch)
    return loss, grads


def _zero_gather(values):
    mesh = values["mesh"]
    out = {k: v for k, v in values.items() if k != "mesh"}
    for key in ("opt_state", "grads"):
        if key in out:
            out[key] = {k: sf.all_gather(v, "dp", dim=0, mesh=mesh) for k, v in out[key].items()}
    return out


def zero_sharded(d, hidden, seed, bug=None, lr=0.1, beta=0.9):
    def make(mesh):
        n, rank = mesh.size("dp"), mesh.index("dp")
        params = mlp_params(d, hidden, seed)
        momentum = {k: torch.zeros_like(v.chunk(n)[rank]) for k, v in params.items()}
        return Trainer({"mesh": mesh, "params": params, "opt_state": momentum},
                       _zero_step(lr, beta, bug), _zero_gather)
    return make


def zero_reference(d, hidden, seed, lr=0.1, beta=0.9):
    def step(state, batch):
        loss, grads = _local_value_and_grad(state["params"], batch)
        momentum = {k: beta * state["opt_state"][k] + g for k, g in grads.items()}
        params = {k: v - lr * momentum[k] for k, v in state["params"].items()}
        return {"params": params, "opt_state": momentum}, {"loss": loss, "grads": grads}

    def make():
        params = mlp_params(d, hidden, seed)
        return Trainer({"params": params,
                        "opt_state": {k: torch.zeros_like(v) for k, v in params.items()}}, step)
    return make


def zero_case(n, *, d=None, per_rank=2, steps=2, seed=0, bug=None) -> Case:
    d = d or 2 * n  # every leaf's dim 0 (d, hidden, hidden) divides by n
    hidden = 2 * n
    return Case(zero_sharded(d, hidden, seed, bug), zero_reference(d, hidden, seed), {"dp": n},
                regression_batches(per_rank * n, d, steps, seed))


# --- the mutants ---------------------------------------------------------------------------

MUTANTS = {
    "missing_grad_mean": ("dp", "missing gradient mean"),
    "psum_for_pmean": ("dp", "psum where pmean belongs"),
    "rank_seed": ("dp", "rank-dependent seed"),
    "forgotten_pvary": ("megatron", "forgotten pvary"),
    "wrong_spec_dim": ("megatron", "wrong spec dim"),
    "padding_leaked": ("fsdp", "padding leaked"),
    "padding_in_front": ("fsdp", "uneven-shard bug"),
    "stale_opt_shard": ("zero", "stale state"),
    "wrong_chunk": ("zero", "wrong chunk"),
}


def mutant_case(name: str, n: int = 2) -> Case:
    family, _ = MUTANTS[name]
    if family == "dp":
        return dp_case({"dp": n}, bug=name)
    if family == "megatron":
        return megatron_case(n, bug=name)
    if family == "fsdp":
        return fsdp_case(n, bug=name)
    return zero_case(n, bug=name)
