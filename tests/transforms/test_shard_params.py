"""shard_params (ZeRO-3 / FSDP / HSDP) equals single-process training.

The core property: a small transformer-like model (tied embedding/output
projection, blocks of uneven widths, LayerNorm, a buffer, a frozen layer, a
0-dim parameter) trained for 5 AdamW steps on the local world, each rank on its
slice of the batch, ends with the same parameters as one process training on
the whole batch. Then: communication volume, memory, policies, RNG replay,
repeated units, inference, and bad input.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.shard_params import shard_params

STEPS = 5



# ---------------------------------------------------------------- models


class Block(nn.Module):
    def __init__(self, d: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(torch.tanh(self.up(self.ln(x)))))


class TinyLM(nn.Module):
    """Embedding tied to the output projection, a frozen layer, a buffer, a 0-dim parameter."""

    def __init__(self, vocab: int, d: int, hiddens: list[int], dropout: float = 0.0,
                 frozen: bool = True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.proj.requires_grad_(not frozen)
        self.blocks = nn.ModuleList(Block(d, h, dropout) for h in hiddens)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.25))
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, 8))

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1], None]
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) * self.temperature


UNITS = {
    "Block": Block,
    "Block+Embedding": (Block, nn.Embedding),  # the tied weight is shared by a unit and the root
    "emb+head+blocks.0": ["emb", "head", "blocks.0"],  # the tied weight is shared by two units
    "min_params": 10,
    "none": None,
}


def make_lm(case) -> nn.Module:
    torch.manual_seed(0)
    return TinyLM(case["vocab"], case["d"], case["hiddens"], case.get("dropout", 0.0))


def make_batch(case, step: int):
    gen = torch.Generator().manual_seed(case["seed"] * 100 + step)
    shape = (case["n"] * case["per_rank"], case["seq"])
    return (torch.randint(0, case["vocab"], shape, generator=gen),
            torch.randint(0, case["vocab"], shape, generator=gen))


# ---------------------------------------------------------------- training on both sides


def grads_and_loss(loss_fn, train, *args, how: str):
    """``loss_fn``'s gradient w.r.t. ``train`` and its value, by ``torch.func.grad_and_value``
    (``how="func"``) or by ``loss.backward()`` on leaf copies (``how="autograd"``)."""
    if how == "func":
        return torch.func.grad_and_value(loss_fn)(train, *args)
    leaves = {n: t.detach().requires_grad_() for n, t in train.items()}
    loss = loss_fn(leaves, *args)
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}, loss


def _train(case, sharded: bool):
    """5 AdamW steps: on the local world when sharded, else one process on the whole batch."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank() if sharded and dist.is_initialized() else 0
    fmodel = sf.functional(make_lm(case))
    if sharded:
        mesh = sf.Mesh(case["mesh"])
        model = shard_params(fmodel, mesh, case["axis"], units=UNITS[case["units"]],
                             reshard_after_forward=case["reshard"], prefetch=case["prefetch"],
                             replicate_axis=case.get("replicate"))
        params, specs = model.init(case["seed"]), model.specs
    else:
        mesh, model, specs = None, fmodel, None
        params = fmodel.init(case["seed"])
    train = {n: params[n] for n in fmodel.trainable_names}
    rest = {n: params[n] for n in params if n not in train}
    train_specs = {n: specs[n] for n in train} if sharded else None
    opt = sf.optim.chain(sf.optim.clip_by_global_norm(case["clip"], specs=train_specs, mesh=mesh),
                         sf.optim.adamw(1e-2, weight_decay=0.1))
    state = opt.init(train)

    def loss_fn(train, tokens, targets):
        logits = model.apply({**rest, **train}, tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    losses = []
    for step in range(STEPS):
        tokens, targets = make_batch(case, step)
        if sharded:
            tokens, targets = tokens.chunk(case["n"])[rank], targets.chunk(case["n"])[rank]
        grads, loss = grads_and_loss(loss_fn, train, tokens, targets, how=case["how"])
        updates, state = opt.update(grads, state, train)
        train = sf.optim.apply_updates(train, updates)
        losses.append(loss.detach())
    final = {**rest, **train}
    if sharded:
        final = sf.gather(final, specs, mesh)
    return final, torch.stack(losses)


MESHES = [
    ({"dp": 1}, "dp", None),
    ({"dp": 2}, "dp", None),
    ({"dp": 3}, "dp", None),
    ({"dp": 4}, "dp", None),
    ({"replicate": 2, "shard": 2}, "shard", "replicate"),
]


@st.composite
def cases(draw):
    mesh, axis, replicate = draw(st.sampled_from(MESHES))
    return dict(
        n=math.prod(mesh.values()), mesh=mesh, axis=axis, replicate=replicate,
        # d >= 3: a LayerNorm over 2 features is degenerate (its input gradient is roundoff),
        # and Adam would turn that roundoff into full-size updates
        vocab=draw(st.integers(5, 13)), d=draw(st.integers(3, 7)),
        hiddens=draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)),
        units=draw(st.sampled_from(sorted(UNITS))), reshard=draw(st.booleans()),
        prefetch=draw(st.integers(0, 2)), how=draw(st.sampled_from(["func", "autograd"])),
        clip=draw(st.sampled_from([0.05, 100.0])), per_rank=draw(st.integers(1, 2)),
        seq=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)),
    )


def _check_training(worlds, case):
    ref_params, ref_losses = _train(case, sharded=False)
    results = worlds(case["n"]).run(_train, case, True)
    for rank, (params, _) in enumerate(results):
        assert_close(params, ref_params, msg=lambda m, r=rank: f"rank {r} params: {m}")
    # every rank's loss is its micro-batch's; their mean is the full batch's
    assert_close(torch.stack([losses for _, losses in results]).mean(0), ref_losses)


@given(case=cases())
def test_training_matches_single_process(worlds, case):
    _check_training(worlds, case)


@pytest.mark.parametrize("how", ["func", "autograd"])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("mesh", [MESHES[2], MESHES[4]], ids=["dp3", "hsdp2x2"])
def test_training_each_mode(worlds, mesh, reshard, how):
    shape, axis, replicate = mesh
    case = dict(n=math.prod(shape.values()), mesh=shape, axis=axis, replicate=replicate,
                vocab=11, d=5, hiddens=[3, 6, 4], units="Block+Embedding", reshard=reshard,
                prefetch=1, how=how, clip=0.05, per_rank=2, seq=3, seed=7)
    _check_training(worlds, case)


# ---------------------------------------------------------------- init and layout


def _init_on_rank(case, meta: bool):
    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    init_fns = {"temperature": lambda shape, dtype, device, gen: torch.full(shape, 1.25),
                "pos": lambda shape, dtype, device, gen: torch.linspace(-1.0, 1.0, 8)}
    if meta:
        with torch.device("meta"):
            module = make_lm(case)
    else:
        module = make_lm(case)
    fmodel = sf.functional(module, init_fns=init_fns)
    reference = sf.functional(make_lm(case), init_fns=init_fns)
    mesh = sf.Mesh(case["mesh"])
    model = shard_params(fmodel, mesh, case["axis"], units=UNITS[case["units"]],
                         replicate_axis=case["replicate"])
    shards = model.init(case["seed"])
    expected = sf.shard(reference.init(case["seed"]), model.specs, mesh)
    return shards, expected, sf.gather(shards, model.specs, mesh), model.specs


@given(mesh=st.sampled_from(MESHES[1:]), vocab=st.integers(3, 9), d=st.integers(1, 5),
       units=st.sampled_from(sorted(UNITS)), meta=st.booleans())
def test_init_is_the_shard_of_the_full_init(worlds, mesh, vocab, d, units, meta):
    shape, axis, replicate = mesh
    case = dict(mesh=shape, axis=axis, replicate=replicate, vocab=vocab, d=d, hiddens=[3, 2],
                units=units, seed=vocab * d)
    fmodel = sf.functional(make_lm(case), init_fns={
        "temperature": lambda s, dt, dev, g: torch.full(s, 1.25),
        "pos": lambda s, dt, dev, g: torch.linspace(-1.0, 1.0, 8)})
    full = fmodel.init(case["seed"])
    n = shape[axis]
    for shards, expected, gathered, specs in worlds(math.prod(shape.values())).run(
            _init_on_rank, case, meta):
        assert shards.keys() == expected.keys() == set(fmodel.names)
        for name in shards:
            assert torch.equal(shards[name], expected[name]), name
        assert_close(gathered, full)
        for name, layout in specs.items():
            if name in fmodel.param_names and full[name].dim():
                assert layout == sf.Layout(sf.P(axis), tuple(full[name].shape))
                assert shards[name].shape[0] == math.ceil(full[name].shape[0] / n)
            else:  # buffers and 0-dim parameters are replicated
                assert layout == sf.Layout(sf.P(), tuple(full[name].shape))


# ---------------------------------------------------------------- communication volume


def _comm_on_rank(n: int, reshard: bool, prefetch: int):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(13, 6), *[Block(6, h) for h in (5, 7, 3)], nn.Linear(6, 9))
    fmodel = sf.functional(net)
    model = shard_params(fmodel, sf.Mesh({"dp": n}), "dp", units=Block,
                         reshard_after_forward=reshard, prefetch=prefetch)
    shards = model.init(0)
    tokens = torch.randint(0, 13, (2, 3), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = lambda p: model.apply(p, tokens).square().mean()  # noqa: E731
    torch.func.grad(loss)(shards)  # warm-up: records the unit order used for prefetching
    sf.reset_comm_stats()
    torch.func.grad(loss)(shards)
    return sf.comm_stats(), {name: tuple(layout.shape) for name, layout in model.specs.items()}


@pytest.mark.parametrize("reshard", [True, False])
def test_comm_volume_is_the_zero3_figure(worlds, reshard):
    n, prefetch = 4, 2
    results = worlds(n).run(_comm_on_rank, n, reshard, prefetch)
    shapes = results[0][1]
    # Psi: parameter bytes with dim 0 padded to a multiple of N (what the collectives move)
    psi = sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) * 4 for s in shapes.values())
    factor = 3 if reshard else 2
    units = 3 + 1  # three blocks and the root
    for stats, _ in results:
        expected = factor * psi * (n - 1) / n
        assert abs(stats.total_bytes - expected) <= stats.total_calls, (stats, expected)
        assert stats.op_bytes("psum_scatter") == pytest.approx(psi * (n - 1) / n, abs=units)
        # one flat collective per unit (one dtype): all-gathers twice unless kept
        assert stats.op_calls("psum_scatter") == units
        assert stats.op_calls("all_gather") == (2 if reshard else 1) * units
        assert stats.op_calls("psum") == 0


# ---------------------------------------------------------------- memory


MEMORY_BLOCKS, MEMORY_D, MEMORY_BATCH = 8, 96, 4  # 8 equal blocks of 96 x 96 (two Linears)


def _memory_on_rank(n: int, prefetch: int, sharded: bool, remat=None) -> dict[str, int]:
    """Live bytes of a step, counted by ``sf.memory.track`` (tensors made inside each block).

    ``step``: a whole ``torch.func.grad`` step. ``forward`` / ``forward_left``: the peak
    of an autograd forward and what it leaves for backward; ``backward``: the peak of
    what the backward allocates on top of that.
    """
    import shardfn as sf
    import shardfn.memory as mem
    from shardfn.transforms.shard_params import shard_params

    torch.manual_seed(0)
    net = nn.Sequential(*[Block(MEMORY_D, MEMORY_D) for _ in range(MEMORY_BLOCKS)])
    fmodel = sf.functional(net)
    x = torch.randn(MEMORY_BATCH, MEMORY_D)
    if sharded:
        model = shard_params(fmodel, sf.Mesh({"dp": n}), "dp", units=Block, prefetch=prefetch,
                             remat=remat)
    else:
        model = fmodel
    with mem.track() as t_init:
        params = model.init(0)
    loss = lambda p: model.apply(p, x).square().mean()  # noqa: E731
    torch.func.grad(loss)(params)  # warm-up: the second step prefetches in the recorded order
    with mem.track() as t_step:
        grads = torch.func.grad(loss)(params)
    del grads
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    with mem.track() as t_forward:
        value = loss(leaves)
    with mem.track() as t_backward:
        value.backward()
    return {"init": t_init.peak_bytes, "shards": t_init.current_bytes, "step": t_step.peak_bytes,
            "forward": t_forward.peak_bytes, "forward_left": t_forward.current_bytes,
            "backward": t_backward.peak_bytes,
            "unit": sum(p.numel() * 4 for p in net[0].parameters())}


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("mode", ["keep activations", "recompute units"])
def test_memory_holds_shards_plus_a_few_units(worlds, prefetch, mode):
    n, d, batch = 4, MEMORY_D, MEMORY_BATCH
    recompute = mode == "recompute units"
    remat = sf.checkpoint_policies.nothing_saveable if recompute else None
    full = _memory_on_rank(1, prefetch, False)
    unit = full["unit"]
    if recompute:  # unit inputs/outputs (batch x width, fp32) and one unit's inner activations
        activations = (MEMORY_BLOCKS + 1) * batch * d * 4 + 2 * full["forward"] // MEMORY_BLOCKS
    else:  # what one process's forward holds: the same activations
        activations = full["forward"]
    # gradients during backward: the full gradient of the unit whose backward runs, and
    # one reduction in flight (the previous unit's full gradient and (N-1)/N of a unit
    # of receive buffers), finished before the next one starts
    gradients = unit + unit + unit * (n - 1) // n
    gathered = (prefetch + 1) * unit
    for got in worlds(n).run(_memory_on_rank, n, prefetch, True, remat):
        shards = got["shards"]  # also the size of the gradient shards a step makes
        assert shards == full["shards"] / n  # 96 rows split evenly: no padding
        # init builds one unit at a time, never the full model
        assert got["init"] <= shards + unit, (got["init"], shards, unit)
        # forward: prefetch + 1 gathered units and the activations (the shards existed)
        assert got["forward"] <= gathered + activations, (got["forward"], gathered, activations)
        # backward, on top of what forward left: the gradient shards, prefetch + 1
        # gathered units (their released storage refilled) and the gradients in flight
        backward = got["forward_left"] + got["backward"]
        assert backward <= shards + gathered + gradients + activations, (backward, unit)
        # a whole torch.func step: the same bound
        assert got["step"] <= shards + gathered + gradients + activations, (got["step"], unit)
        # far below one process's step, which holds the full parameters and gradients
        # (measured: 0.43 of it with prefetch 0, 0.53 with prefetch 2, of 8 blocks on 4 ranks)
        assert shards + got["step"] < 0.6 * (full["shards"] + full["step"])


# ---------------------------------------------------------------- semantics


def _grads_on_rank(case, seeds: bool):
    """Per-rank gradients of the rank's loss, gathered; also the no-grad forward."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank() if dist.is_initialized() else 0
    fmodel = sf.functional(case["make"]())
    mesh = sf.Mesh({"dp": case["n"]})
    model = shard_params(fmodel, mesh, "dp", units=case["units"],
                         grad_reduce=case.get("grad_reduce", "mean"))
    shards = model.init(0)
    x = case["inputs"][rank]
    if seeds:
        torch.manual_seed(rank)
    grads = torch.func.grad(lambda p: model.apply(p, x).square().mean())(shards)
    with torch.no_grad():
        out = model.apply(shards, x)
    return sf.gather(grads, model.specs, mesh), out


def _reference_grads(case, seeds: bool):
    fmodel = sf.functional(case["make"]())
    params = fmodel.init(0)
    per_rank, outs = [], []
    for rank, x in enumerate(case["inputs"]):
        if seeds:
            torch.manual_seed(rank)
        per_rank.append(torch.func.grad(lambda p, x=x: fmodel.apply(p, x).square().mean())(params))
        with torch.no_grad():
            outs.append(fmodel.apply(params, x))
    scale = 1.0 if case.get("grad_reduce") == "sum" else 1.0 / len(case["inputs"])
    mean = {name: sum(g[name] for g in per_rank) * scale for name in fmodel.trainable_names}
    return mean, outs


class Twice(nn.Module):
    """The same block applied twice, and a tied pair inside one unit."""

    def __init__(self):
        super().__init__()
        self.block = Block(5, 3)
        self.pair = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5))
        self.pair[2].weight = self.pair[0].weight
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(self.pair(self.block(self.block(x))))


def _twice():
    torch.manual_seed(0)
    return Twice()


class Branchy(nn.Module):
    """A unit whose output is unused (its backward never runs) and two parallel units."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = Block(5, 3), Block(5, 4), Block(5, 2)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        self.c(x)
        return self.out(self.a(x) + self.b(x))


def _branchy():
    torch.manual_seed(0)
    return Branchy()


class MixedBlock(nn.Module):
    """float32 and float64 parameters in one unit: one flat collective per dtype."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 5).double()

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)).double()).float()


def _mixed():
    torch.manual_seed(0)
    return nn.Sequential(MixedBlock(), nn.Linear(5, 5), MixedBlock())


def _dropout_lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), Block(6, 5, dropout=0.3),
                         nn.Dropout(0.2), Block(6, 3, dropout=0.5), nn.Linear(6, 3))


@pytest.mark.parametrize(("name", "make", "units", "seeds", "grad_reduce"), [
    ("repeated unit", _twice, ["block", "pair"], False, "mean"),
    ("dropout replays the forward's random numbers", _dropout_lm, Block, True, "mean"),
    ("grad_reduce=sum is the plain transpose", _twice, Block, False, "sum"),
    ("unused unit output and parallel units", _branchy, Block, False, "mean"),
    ("two dtypes in a unit", _mixed, MixedBlock, False, "mean"),
])
def test_gradients_equal_the_mean_of_per_rank_gradients(worlds, name, make, units, seeds,
                                                        grad_reduce):
    n = 2
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(3, 4 if make is _dropout_lm else 5, generator=gen) for _ in range(n)]
    case = dict(make=make, units=units, n=n, inputs=inputs, grad_reduce=grad_reduce)
    ref_grads, ref_outs = _reference_grads(case, seeds)
    for rank, (grads, out) in enumerate(worlds(n).run(_grads_on_rank, case, seeds)):
        for key in ref_grads:
            assert_close(grads[key], ref_grads[key], msg=lambda m, k=key: f"{name}: {k}: {m}")
        if not seeds:
            assert_close(out, ref_outs[rank])


def test_frozen_parameters_and_buffers_are_never_differentiated():
    """Differentiating them is refused, as by ``sf.functional`` (docs/functional.md, "Buffers
    are state"); before, they got zeros (torch.func) or None (autograd), where the unsharded
    model gave them gradients. The trainable part gets its gradients."""
    case = dict(vocab=7, d=3, hiddens=[2])
    fmodel = sf.functional(make_lm(case))
    model = shard_params(fmodel, sf.Mesh({"dp": 1}), "dp", units=Block)
    shards = model.init(0)
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"buffers \['pos'\].*frozen parameters .*proj.weight"):
        torch.func.grad(lambda p: model.apply(p, tokens).sum())(shards)
    leaves = {k: v.clone().requires_grad_() for k, v in shards.items()}
    with pytest.raises(ValueError, match="proj.weight"):
        model.apply(leaves, tokens)
    trainable, rest = model.split_trainable(shards)
    assert {"proj.weight", "proj.bias", "pos"} <= set(rest)
    grads = torch.func.grad(lambda t: model.apply(model.merge(t, rest), tokens).sum())(trainable)
    assert grads.keys() == trainable.keys() and grads["emb.weight"].any()


def test_inference_and_inputs_gradient_in_one_process():
    case = dict(vocab=7, d=3, hiddens=[2, 4])
    fmodel = sf.functional(make_lm(case))
    params = fmodel.init(1)
    model = shard_params(fmodel, sf.Mesh({"dp": 1}), "dp", units=Block, prefetch=2)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        assert_close(model.apply(model.shard(params), tokens), fmodel.apply(params, tokens))
    with torch.inference_mode():
        assert_close(model.apply(model.shard(params), tokens), fmodel.apply(params, tokens))
    # gradient w.r.t. a float input flows through units
    net = nn.Sequential(Block(3, 2), nn.Linear(3, 3), Block(3, 5))
    fnet = sf.functional(net)
    p = fnet.init(0)
    snet = shard_params(fnet, sf.Mesh({"dp": 1}), "dp", units=Block)
    x = torch.randn(2, 3)
    expected = torch.func.grad(lambda x: fnet.apply(p, x).square().sum())(x)
    assert_close(torch.func.grad(lambda x: snet.apply(p, x).square().sum())(x), expected)
    # torch.func.vjp over apply, w.r.t. parameters and input together
    cotangent = torch.randn(2, 3)
    out, vjp_fn = torch.func.vjp(snet.apply, p, x)
    ref_out, ref_vjp_fn = torch.func.vjp(fnet.apply, p, x)
    assert_close(out, ref_out)
    assert_close(vjp_fn(cotangent), ref_vjp_fn(cotangent))


# ---------------------------------------------------------------- unit policies


def test_unit_policies():
    fmodel = sf.functional(make_lm(dict(vocab=7, d=4, hiddens=[3, 5])))
    mesh = sf.Mesh({"dp": 1})
    assert shard_params(fmodel, mesh, units=Block).units == ("blocks.0", "blocks.1")
    # outermost wins: the Linear layers inside blocks are not units of their own
    assert shard_params(fmodel, mesh, units=(Block, nn.Linear)).units == (
        "proj", "blocks.0", "blocks.1", "head")
    # bottom-up by size, smallest first: blocks hold 39 and 57 parameters, their Linears
    # 15, 16 and 25, 24; the embedding 28
    assert shard_params(fmodel, mesh, units=40).units == ("blocks.1",)
    assert shard_params(fmodel, mesh, units=30).units == ("blocks.0", "blocks.1")
    assert shard_params(fmodel, mesh, units=25).units == (
        "emb", "blocks.0", "blocks.1.up", "head")  # head holds the tied embedding
    assert shard_params(fmodel, mesh, units=["blocks.1", "emb", "blocks.1.up"]).units == (
        "emb", "blocks.1")
    assert shard_params(fmodel, mesh).units == ()


@pytest.mark.parametrize(("units", "error", "match"), [
    (nn.Conv2d, ValueError, "matches no submodule.*Block"),
    (10**6, ValueError, "matches no submodule"),
    (0, ValueError, ">= 1"),
    (["blocks.9"], ValueError, "no submodule at path 'blocks.9'.*blocks"),
    ([""], ValueError, "root"),
    (["blocks"], ValueError, "ModuleList, which has no forward"),
    ("blocks", TypeError, "units must be"),
])
def test_bad_unit_policy(units, error, match):
    fmodel = sf.functional(make_lm(dict(vocab=7, d=4, hiddens=[3, 5])))
    with pytest.raises(error, match=match):
        shard_params(fmodel, sf.Mesh({"dp": 1}), units=units)


def test_bad_arguments():
    net = make_lm(dict(vocab=7, d=4, hiddens=[3]))
    mesh = sf.Mesh({"dp": 1})
    with pytest.raises(TypeError, match="sf.functional"):
        shard_params(net, mesh)
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        shard_params(sf.functional(net), mesh, "tp")
    with pytest.raises(ValueError, match="grad_reduce"):
        shard_params(sf.functional(net), mesh, grad_reduce="avg")


def _bad_inputs_on_rank():
    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    fmodel = sf.functional(make_lm(dict(vocab=7, d=4, hiddens=[3])))
    mesh = sf.Mesh({"dp": 2})
    model = shard_params(fmodel, mesh, units=Block)
    full = fmodel.init(0)
    shards = model.init(0)
    tokens = torch.tensor([[1, 2]])
    messages = {}
    attempts = {
        "full tree": lambda: model.apply(full, tokens),
        "other mesh": lambda: model.apply(
            {k: v[:1] if v.dim() and k != "pos" else v for k, v in full.items()}, tokens),
        "missing leaf": lambda: model.apply({k: v for k, v in shards.items() if k != "pos"},
                                            tokens),
        "shards to fmodel": lambda: fmodel.apply(shards, tokens),
    }
    for what, attempt in attempts.items():
        try:
            attempt()
            messages[what] = None
        except (ValueError, TypeError) as error:
            messages[what] = str(error)
    return messages


def test_bad_inputs_are_named(worlds):
    for messages in worlds(2).run(_bad_inputs_on_rank):
        assert "has the full shape" in messages["full tree"]
        assert "model.shard(full_params)" in messages["full tree"]
        assert "sharded for another mesh" in messages["other mesh"]
        assert "local shape" in messages["other mesh"]
        assert "missing ['pos']" in messages["missing leaf"]
        assert "expected (7, 4)" in messages["shards to fmodel"]


class InPlaceAfterUnit(nn.Module):
    """Updates a unit's output in place (``h.mul_(2)``)."""

    def __init__(self):
        super().__init__()
        self.block = Block(4, 3)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.block(x)
        h.mul_(2.0)
        return self.out(h)


def test_misuse_at_run_time_is_named():
    torch.manual_seed(0)
    fmodel = sf.functional(InPlaceAfterUnit())
    params = fmodel.init(0)
    x = torch.randn(3, 4)
    mesh = sf.Mesh({"dp": 1})
    reference = torch.func.grad(lambda p: fmodel.apply(p, x).square().sum())(params)
    # kept activations: autograd records the in-place update like any other op
    model = shard_params(fmodel, mesh, units=Block)
    grads = torch.func.grad(lambda s: model.apply(s, x).square().sum())(model.shard(params))
    assert_close(grads, reference)
    # a recomputed unit replays its forward output, which must not have changed since
    recompute = shard_params(fmodel, mesh, units=Block,
                             remat=sf.checkpoint_policies.nothing_saveable)
    with pytest.raises(RuntimeError, match="modified in place"):
        torch.func.grad(lambda s: recompute.apply(s, x).square().sum())(recompute.shard(params))
    # backward through one apply() call runs once, whichever mode
    plain = sf.functional(nn.Sequential(Block(4, 3), nn.Linear(4, 2)))
    for remat in (None, sf.checkpoint_policies.nothing_saveable):
        m = shard_params(plain, mesh, units=Block, remat=remat)
        leaves = {k: v.detach().requires_grad_() for k, v in m.init(0).items()}
        loss = m.apply(leaves, x).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="can run only once"):
            loss.backward()
