"""remat: same values and gradients as the plain function, less memory, fewer recomputed ops."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn.memory as mem
from shardfn.transforms.remat import Offload, checkpoint_name, remat
from shardfn.transforms.remat import checkpoint_policies as cp

POLICIES = {
    "nothing": cp.nothing_saveable,
    "everything": cp.everything_saveable,
    "dots": cp.dots_saveable,
    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    "names": cp.save_only_these_names("hidden"),
    "all_but_names": cp.save_anything_except_these_names("hidden"),
    "save_and_offload_names": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=["hidden"], names_which_can_be_offloaded=["pre"]),
    "offload_dots": cp.offload(cp.dots_saveable),
    "offload_dot_no_batch": cp.offload_dot_with_no_batch_dims("cpu"),
    "both": cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names("hidden")),
}


def init_block(d: int, hidden: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "w1": torch.randn(d, hidden, generator=gen) / d**0.5,
        "b1": torch.randn(hidden, generator=gen) * 0.1,
        "w2": torch.randn(hidden, d, generator=gen) / hidden**0.5,
        "scale": torch.tensor(0.7),
    }


def block(p, x, drop: float = 0.0):
    pre = checkpoint_name(x @ p["w1"] + p["b1"], "pre")
    h = checkpoint_name(torch.tanh(pre), "hidden")
    if drop:
        h = torch.nn.functional.dropout(h, drop)
    return x + p["scale"] * torch.nn.functional.gelu(h @ p["w2"])


def loss_of(fn, drop: float = 0.0):
    return lambda p, x: (fn(p, x, drop) ** 2).mean()


def all_grads(fn, p, x, cot, drop=0.0, seed=0):
    """(output, {how: (param grads, input grads)}) of fn under four differentiation APIs."""
    results = {}
    torch.manual_seed(seed)
    out = fn(p, x, drop)
    torch.manual_seed(seed)
    results["grad"] = torch.func.grad(loss_of(fn, drop), argnums=(0, 1))(p, x)
    torch.manual_seed(seed)
    g, value = torch.func.grad_and_value(loss_of(fn, drop), argnums=(0, 1))(p, x)
    results["grad_and_value"] = (g, value)
    torch.manual_seed(seed)
    _, vjp_fn = torch.func.vjp(lambda p, x: fn(p, x, drop), p, x)
    results["vjp"] = vjp_fn(cot)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    x_leaf = x.clone().requires_grad_()
    torch.manual_seed(seed)
    loss_of(fn, drop)(leaves, x_leaf).backward()
    results["autograd"] = ({k: v.grad for k, v in leaves.items()}, x_leaf.grad)
    return out, results


@pytest.mark.parametrize("policy", sorted(POLICIES))
@given(batch=st.integers(1, 6), d=st.integers(1, 8), hidden=st.integers(1, 12),
       seed=st.integers(0, 2**16))
@settings(max_examples=8, deadline=None)
def test_same_values_and_gradients(policy, batch, d, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    p, x = init_block(d, hidden, gen), torch.randn(batch, d, generator=gen)
    cot = torch.randn(batch, d, generator=gen)
    ref_out, ref = all_grads(block, p, x, cot)
    out, got = all_grads(remat(block, POLICIES[policy]), p, x, cot)
    assert_close(out, ref_out)
    for how in ref:
        assert_close(got[how], ref[how], msg=lambda m, h=how: f"{policy} {h}: {m}")


@pytest.mark.parametrize("policy", ["nothing", "everything", "dots", "names"])
def test_dropout_replays_the_same_mask(policy):
    gen = torch.Generator().manual_seed(0)
    p, x = init_block(6, 16, gen), torch.randn(5, 6, generator=gen)
    cot = torch.randn(5, 6, generator=gen)
    ref_out, ref = all_grads(block, p, x, cot, drop=0.5, seed=3)
    out, got = all_grads(remat(block, POLICIES[policy]), p, x, cot, drop=0.5, seed=3)
    assert_close(out, ref_out)
    for how in ref:
        assert_close(got[how], ref[how], msg=lambda m, h=how: f"{h}: {m}")
    # the mask matters: another seed gives other gradients
    _, other = all_grads(block, p, x, cot, drop=0.5, seed=4)
    assert not torch.allclose(other["grad"][0]["w1"], ref["grad"][0]["w1"])


def test_backward_leaves_the_global_rng_stream_alone():
    gen = torch.Generator().manual_seed(0)
    p, x = init_block(4, 8, gen), torch.randn(3, 4, generator=gen)
    draws = []
    for fn in (block, remat(block)):
        torch.manual_seed(7)
        torch.func.grad(loss_of(fn, 0.3))(p, x)
        draws.append(torch.rand(4))
    assert_close(draws[0], draws[1])


def test_higher_order_gradients():
    def f(p, x):
        return torch.tanh(x @ p["w1"]).pow(3).sum()

    gen = torch.Generator().manual_seed(1)
    p, x = init_block(3, 5, gen), torch.randn(4, 3, generator=gen)

    def grad_of_grad_norm(fn):
        inner = torch.func.grad(fn)
        return torch.func.grad(lambda p, x: inner(p, x)["w1"].pow(2).sum(), argnums=(0, 1))(p, x)

    for policy in (cp.nothing_saveable, cp.dots_saveable):
        assert_close(grad_of_grad_norm(remat(f, policy)), grad_of_grad_norm(f))
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        results = []
        for fn in (f, remat(f, policy)):
            (g,) = torch.autograd.grad(fn(leaves, x), leaves["w1"], create_graph=True)
            results.append(torch.autograd.grad(g.pow(2).sum(), leaves["w1"]))
        assert_close(results[0], results[1])


def test_vmap():
    gen = torch.Generator().manual_seed(2)
    p, xs = init_block(4, 8, gen), torch.randn(3, 5, 4, generator=gen)
    fast = remat(block, cp.dots_saveable)
    assert_close(torch.func.vmap(fast, in_dims=(None, 0))(p, xs),
                 torch.func.vmap(block, in_dims=(None, 0))(p, xs))
    per_example = torch.func.vmap(torch.func.grad(loss_of(fast)), in_dims=(None, 0))
    assert_close(per_example(p, xs),
                 torch.func.vmap(torch.func.grad(loss_of(block)), in_dims=(None, 0))(p, xs))

    def batched_loss(fn):
        return lambda p, xs: torch.func.vmap(fn, in_dims=(None, 0))(p, xs).pow(2).sum()

    assert_close(torch.func.grad(batched_loss(fast))(p, xs),
                 torch.func.grad(batched_loss(block))(p, xs))


def test_same_function_twice_and_retain_graph():
    gen = torch.Generator().manual_seed(3)
    p, x = init_block(4, 8, gen), torch.randn(3, 4, generator=gen)
    fast = remat(block, cp.dots_saveable)

    def twice(fn):
        return lambda p, x: fn(p, fn(p, x)).pow(2).sum()

    assert_close(torch.func.grad(twice(fast))(p, x), torch.func.grad(twice(block))(p, x))
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    loss = twice(fast)(leaves, x)
    first = torch.autograd.grad(loss, list(leaves.values()), retain_graph=True)
    second = torch.autograd.grad(loss, list(leaves.values()))  # saved values gone: full recompute
    assert_close(first, second)
    assert_close(dict(zip(leaves, first, strict=True)), torch.func.grad(twice(block))(p, x))


def test_pytrees_static_leaves_and_integer_tensors():
    def f(params, inputs, activation: str, scale: float):
        emb = params["emb"][inputs["ids"]]  # integer input
        act = getattr(torch, activation)
        out = act(emb @ params["w"]) * scale + inputs["x"]
        return {"out": out, "argmax": out.argmax(-1), "note": activation}

    gen = torch.Generator().manual_seed(4)
    params = {"emb": torch.randn(10, 4, generator=gen), "w": torch.randn(4, 4, generator=gen)}
    inputs = {"ids": torch.tensor([1, 7, 7, 2]), "x": torch.randn(4, 4, generator=gen)}
    fast = remat(f, cp.dots_saveable)
    got, want = fast(params, inputs, "tanh", 2.0), f(params, inputs, "tanh", 2.0)
    assert got["note"] == "tanh" and torch.equal(got["argmax"], want["argmax"])

    def loss(fn):
        return lambda params, x: fn(params, {**inputs, "x": x}, "tanh", 2.0)["out"].pow(2).sum()

    x = inputs["x"]
    assert_close(torch.func.grad(loss(fast), argnums=(0, 1))(params, x),
                 torch.func.grad(loss(f), argnums=(0, 1))(params, x))
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    out = fast(leaves, inputs, "tanh", 2.0)
    assert not out["argmax"].requires_grad
    out["out"].pow(2).sum().backward()
    assert_close({k: v.grad for k, v in leaves.items()}, torch.func.grad(loss(f))(params, x))


def test_in_place_ops_inside_and_saved_value_mutated_later():
    def f(p, x):
        h = x @ p["w1"]  # dots_saveable saves it, then the forward mutates it
        h.mul_(2.0)
        h = torch.relu_(h + p["b1"])
        return h @ p["w2"]

    gen = torch.Generator().manual_seed(5)
    p, x = init_block(4, 8, gen), torch.randn(3, 4, generator=gen)
    for policy in (cp.dots_saveable, cp.everything_saveable):
        fast = remat(f, policy)
        got = torch.func.grad(lambda p, x, fast=fast: fast(p, x).sum())(p, x)
        assert_close(got, torch.func.grad(lambda p, x: f(p, x).sum())(p, x))


def test_output_changed_in_place_after_the_call():
    def f(p, x):
        h = x @ p["w1"]  # a saved mm output that is also returned
        return h, (h * h) @ p["w2"]

    gen = torch.Generator().manual_seed(5)
    p, x = init_block(4, 8, gen), torch.randn(3, 4, generator=gen)
    grads = []
    for fn, mutate in ((f, False), (remat(f, cp.dots_saveable), True)):
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        h, out = fn(leaves, x)
        if mutate:  # plain autograd would refuse: mul saved h
            h.detach().mul_(3.0)
        out.pow(2).sum().backward()
        grads.append((leaves["w1"].grad, leaves["w2"].grad))
    assert_close(grads[1], grads[0])


def test_nested_remat():
    inner = remat(block, cp.dots_saveable)

    def two_blocks(p, x):
        return inner(p, inner(p, x))

    gen = torch.Generator().manual_seed(6)
    p, x = init_block(4, 8, gen), torch.randn(3, 4, generator=gen)
    for policy in (cp.nothing_saveable, cp.everything_saveable):
        outer = remat(two_blocks, policy)
        assert_close(torch.func.grad(lambda p, x, o=outer: o(p, x).sum(), argnums=(0, 1))(p, x),
                     torch.func.grad(lambda p, x: two_blocks(p, x).sum(), argnums=(0, 1))(p, x))


def test_checkpoint_name_is_identity_outside_remat():
    tree = {"a": torch.ones(2), "b": [torch.zeros(1)]}
    assert checkpoint_name(tree, "x") is tree
    with pytest.raises(TypeError, match="name must be a string"):
        checkpoint_name(tree["a"], 3)


# ----------------------------------------------------------------------------- memory
D, HIDDEN, ROWS, BLOCKS = 16, 64, 256, 8  # small ops: no intra-op threading


def mlp_block(p, x):
    """A transformer MLP: saves x, the pre-activation and the activation (d + 2 hidden)."""
    return x + torch.nn.functional.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]


def _model(block_fn):
    def loss(params, x):
        for p in params:
            x = block_fn(p, x)
        return x.pow(2).mean()

    return loss


@pytest.mark.parametrize("api", ["torch.func.grad", "torch.func.vjp", "autograd"])
def test_full_remat_keeps_one_block_of_activations(api):
    gen = torch.Generator().manual_seed(0)
    params = [init_block(D, HIDDEN, gen) for _ in range(BLOCKS)]
    x = torch.randn(ROWS, D, generator=gen)

    def peak(block_fn):
        loss = _model(block_fn)
        leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
        with mem.track() as t:
            if api == "torch.func.grad":
                torch.func.grad(loss)(params, x)
            elif api == "torch.func.vjp":
                _, vjp_fn = torch.func.vjp(loss, params, x)
                vjp_fn(torch.ones(()))
            else:
                loss(leaves, x).backward()
        return t.peak_bytes

    plain, full = peak(mlp_block), peak(remat(mlp_block))
    dots = peak(remat(mlp_block, cp.dots_saveable))
    one_activation = ROWS * HIDDEN * 4
    assert full < 0.4 * plain, (full, plain)
    assert full < dots < plain
    # full remat: the 8 block inputs (1/4 activation each) + gradients + one block in flight
    assert full < (BLOCKS / 4 + 8) * one_activation


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _count(fn, p, x) -> Counter:
    with _CountOps() as counter:
        torch.func.grad(loss_of(fn))(p, x)
    return counter.ops


def test_policies_recompute_what_they_do_not_save():
    gen = torch.Generator().manual_seed(0)
    p, x = init_block(4, 8, gen), torch.randn(3, 4, generator=gen)
    plain = _count(block, p, x)
    nothing = _count(remat(block), p, x)
    dots = _count(remat(block, cp.dots_saveable), p, x)
    names = _count(remat(block, cp.save_only_these_names("hidden")), p, x)
    everything = _count(remat(block, cp.everything_saveable), p, x)
    assert nothing["mm"] == plain["mm"] + 2 and nothing["tanh"] == plain["tanh"] + 1
    assert dots["mm"] == plain["mm"] and dots["tanh"] == plain["tanh"] + 1
    # the tagged tanh output is replayed; the ops before it still run (no dead-code elimination)
    assert names["mm"] == plain["mm"] + 2 and names["tanh"] == plain["tanh"]
    for op in ("mm", "tanh", "gelu", "add", "mul"):
        assert everything[op] == plain[op], op
    assert sum(dots.values()) < sum(nothing.values())


def test_offloaded_values_live_on_the_offload_device():
    seen = []

    def spy(op, name):
        decision = cp.offload_dot_with_no_batch_dims("cpu")(op, name)
        seen.append(decision)
        return decision

    gen = torch.Generator().manual_seed(0)
    p, x = init_block(4, 8, gen), torch.randn(3, 4, generator=gen)
    got = torch.func.grad(loss_of(remat(block, spy)))(p, x)
    assert_close(got, torch.func.grad(loss_of(block))(p, x))
    assert seen.count(Offload("cpu")) == 2  # x @ w1 and h @ w2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_moves_saved_dots_off_the_gpu():
    gen = torch.Generator().manual_seed(0)
    params = [{k: v.cuda() for k, v in init_block(256, 1024, gen).items()} for _ in range(4)]
    x = torch.randn(4096, 256, generator=gen).cuda()

    def held_after_forward(policy):
        fast = remat(block, policy)
        with mem.track(device="cuda") as t:
            _, vjp_fn = torch.func.vjp(_model(fast), params, x)
            mem.mark("forward")
            vjp_fn(torch.ones((), device="cuda"))
        return t.marks["forward"]

    saved = held_after_forward(cp.dots_saveable)
    offloaded = held_after_forward(cp.offload(cp.dots_saveable))
    assert offloaded < saved / 2, (offloaded, saved)
    got = torch.func.grad(_model(remat(block, cp.offload(cp.dots_saveable))))(params, x)
    assert_close(got, torch.func.grad(_model(block))(params, x))


# ----------------------------------------------------------------------------- errors
def test_closed_over_tensor_that_requires_grad_raises():
    w = torch.randn(4, 4, requires_grad=True)
    fast = remat(lambda x: x @ w)
    with pytest.raises(ValueError, match="not one of its arguments"):
        fast(torch.randn(2, 4, requires_grad=True))


def test_recomputation_taking_another_path_raises():
    calls = []

    def f(x, w):
        calls.append(1)
        rows = 2 if len(calls) == 1 else 1  # data-dependent: differs in the recomputation
        return (x[:rows] @ w).sum()

    x, w = torch.randn(3, 4), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="same ops"):
        torch.func.grad(remat(f, cp.dots_saveable), argnums=1)(x, w)


def test_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        remat(3)
    with pytest.raises(TypeError, match="policy"):
        remat(block, policy="dots")
    with pytest.raises(ValueError, match="both saved and offloaded"):
        cp.save_and_offload_only_these_names(names_which_can_be_saved=["a"],
                                             names_which_can_be_offloaded=["a"])


def test_forward_mode_and_hessians_fall_back_to_the_plain_function():
    def f(x, w):
        return torch.tanh(x @ w).pow(3).sum()

    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 4, generator=gen), torch.randn(4, 5, generator=gen)
    fast = remat(f, cp.dots_saveable)
    want = torch.func.hessian(f, argnums=1)(x, w)
    assert_close(torch.func.hessian(fast, argnums=1)(x, w), want)
    assert_close(torch.func.jacrev(torch.func.jacrev(fast, argnums=1), argnums=1)(x, w), want)
    tangent = torch.randn(4, 5, generator=gen)
    assert_close(torch.func.jvp(lambda w: fast(x, w), (w,), (tangent,)),
                 torch.func.jvp(lambda w: f(x, w), (w,), (tangent,)))


# ----------------------------------------------------------------------------- collectives
def _gathered_layer_on_rank(policy_name, x, shards):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.remat import checkpoint_name, remat
    from shardfn.transforms.remat import checkpoint_policies as cp

    policies = {
        "nothing": cp.nothing_saveable,
        "everything": cp.everything_saveable,
        "all_but_gathered": cp.save_anything_except_these_names("gathered"),
    }
    mesh = sf.Mesh({"dp": 2})
    rank = dist.get_rank()

    def layer(shard, x):  # ZeRO-3 style: gather the weight, use it, drop it
        w = checkpoint_name(sf.all_gather(shard, "dp", dim=0, mesh=mesh), "gathered")
        return torch.tanh(x @ w).pow(2).sum()

    fast = remat(layer, policies[policy_name])
    with _CountOps() as counter:  # comm_stats counts in Python, before a replay is decided
        got = torch.func.grad(fast, argnums=(0, 1))(shards[rank], x[rank])
    calls = counter.ops["all_gather_into_tensor"]
    want = torch.func.grad(layer, argnums=(0, 1))(shards[rank], x[rank])
    leaf = shards[rank].clone().requires_grad_()
    fast(leaf, x[rank]).backward()
    return got, want, leaf.grad, calls


@pytest.mark.parametrize("policy", ["nothing", "everything", "all_but_gathered"])
def test_collectives_inside_remat(worlds, policy):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=gen)
    shards = torch.randn(2, 2, 5, generator=gen)  # the (4, 5) weight in two row blocks
    for got, want, autograd_grad, calls in worlds(2).run(_gathered_layer_on_rank, policy, x,
                                                         shards):
        assert_close(got, want)
        assert_close(autograd_grad, want[0])
        # the forward gathers once; the recomputation gathers again unless the value is saved
        assert calls == (1 if policy == "everything" else 2)


# ----------------------------------------------------------------------------- autocast
AUTOCAST_POLICIES = ["nothing", "everything", "dots", "names", "save_and_offload_names",
                     "offload_dots"]


def autocast_grads(fn, p, x, cot, *, cache=True):
    """{how: (param grads, input grads)}; forward under bf16 autocast, backward as named."""
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)

    def loss(p, x):
        return (fn(p, x).float() * cot).sum()

    results = {}
    with autocast():  # torch.func.grad: the backward runs inside the autocast block too
        results["grad"] = torch.func.grad(loss, argnums=(0, 1))(p, x)
    with autocast():  # the usual case: forward under autocast, backward outside it
        out, vjp_fn = torch.func.vjp(loss, p, x)
    results["vjp_outside"] = vjp_fn(torch.ones_like(out))
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    x_leaf = x.clone().requires_grad_()
    with autocast():
        value = loss(leaves, x_leaf)
    value.backward()
    results["autograd_outside"] = ({k: v.grad for k, v in leaves.items()}, x_leaf.grad)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    x_leaf = x.clone().requires_grad_()
    with autocast():
        loss(leaves, x_leaf).backward()
    results["autograd_inside"] = ({k: v.grad for k, v in leaves.items()}, x_leaf.grad)
    return results


def autocast_case(seed=0, batch=5, d=6, hidden=12):
    gen = torch.Generator().manual_seed(seed)
    p, x = init_block(d, hidden, gen), torch.randn(batch, d, generator=gen)
    return p, x, torch.randn(batch, d, generator=gen)


EXACT = {"rtol": 0.0, "atol": 0.0}  # the same ops on the same dtypes: bit for bit


@pytest.mark.parametrize("policy", AUTOCAST_POLICIES)
def test_autocast_recompute_replays_the_forward_autocast(policy):
    p, x, cot = autocast_case()
    ref = autocast_grads(block, p, x, cot)
    got = autocast_grads(remat(block, POLICIES[policy]), p, x, cot)
    for how in ref:
        assert_close(got[how], ref[how], **EXACT, msg=lambda m, h=how: f"{policy} {h}: {m}")
    # bf16 really ran: fp32 gradients differ by far more than round-off
    fp32 = torch.func.grad(lambda p, x: (block(p, x) * cot).sum())(p, x)
    assert not torch.allclose(fp32["w1"], ref["grad"][0]["w1"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", AUTOCAST_POLICIES)
def test_autocast_chained_remat_calls(policy):
    p, x, cot = autocast_case(1)
    fast = remat(block, POLICIES[policy])

    def chained(fn):
        return lambda p, x: fn(p, fn(p, x))

    # without the weight cache every use casts on its own, as each recomputation does
    ref = autocast_grads(chained(block), p, x, cot, cache=False)
    got = autocast_grads(chained(fast), p, x, cot, cache=False)
    for how in ref:
        assert_close(got[how], ref[how], **EXACT, msg=lambda m, h=how: f"{policy} {h}: {m}")
    # with it, the plain function sums the two uses' bf16 gradients of one cached cast
    # before casting to fp32, remat casts each call's gradient first: bf16 round-off apart
    ref = autocast_grads(chained(block), p, x, cot)
    got = autocast_grads(chained(fast), p, x, cot)
    for how in ref:
        assert_close(got[how], ref[how], rtol=2e-2, atol=2e-2,
                     msg=lambda m, h=how: f"{policy} {h}: {m}")


def test_autocast_weight_cache_is_not_a_closure_but_closures_still_raise():
    p, x, cot = autocast_case(2)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x @ leaves["w1"]  # the cast of w1 is now in autocast's cache, made outside remat
        remat(block)(leaves, x).float().sum().backward()
    assert leaves["w1"].grad is not None
    closed = torch.randn(6, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="closure"):
        x @ closed  # cached cast of a tensor that is not an argument
        remat(lambda p, x: block(p, x) @ closed)(leaves, x)


def test_autocast_state_of_the_forward_not_of_the_backward():
    p, x, cot = autocast_case(3)
    fast = remat(block, POLICIES["dots"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, ref_vjp = torch.func.vjp(block, p, x)
        _, vjp_fn = torch.func.vjp(fast, p, x)
    with torch.autocast("cpu", enabled=False):  # the backward's own state does not matter
        assert_close(vjp_fn(cot.bfloat16()), ref_vjp(cot.bfloat16()), **EXACT)
    _, vjp_fn = torch.func.vjp(fast, p, x)  # no autocast in forward: none in recomputation
    _, ref_vjp = torch.func.vjp(block, p, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (both backwards run under it)
        assert_close(vjp_fn(cot), ref_vjp(cot), **EXACT)


@pytest.mark.parametrize("policy", ["everything", "all_but_names"])
def test_autocast_cache_hits_do_not_shift_the_replayed_ops(policy):
    # square weights: a cast replayed in the wrong place would pass the shape check
    p, x, cot = autocast_case(4, batch=6, d=6, hidden=6)
    fast = remat(block, POLICIES[policy])
    ref = autocast_grads(lambda p, x: block(p, block(p, x)), p, x, cot)
    got = autocast_grads(lambda p, x: fast(p, fast(p, x)), p, x, cot)
    for how in ref:
        assert_close(got[how], ref[how], rtol=2e-2, atol=2e-2,
                     msg=lambda m, h=how: f"{policy} {h}: {m}")


# ----------------------------------------------------------------------------- in-place arguments
def bn_step(p, x):
    """BatchNorm in training mode on its arguments: running stats and the count change in place."""
    h = torch.nn.functional.batch_norm(x @ p["w"], p["running_mean"], p["running_var"],
                                       p["gamma"], p["beta"], training=True, momentum=0.1)
    p["num_batches_tracked"].add_(1)
    return torch.tanh(h) * p["running_mean"]  # reads the updated statistics too


def bn_state(gen, d=4):
    return {"w": torch.randn(3, d, generator=gen), "gamma": torch.rand(d, generator=gen) + 0.5,
            "beta": torch.randn(d, generator=gen), "running_mean": torch.randn(d, generator=gen),
            "running_var": torch.rand(d, generator=gen) + 0.5,
            "num_batches_tracked": torch.tensor(3)}


TRAINED = ("w", "gamma", "beta")


def bn_results(fn, how, gen_seed=0):
    """(grads of the trained leaves, the buffers after the call) of one bn step."""
    gen = torch.Generator().manual_seed(gen_seed)
    state, x = bn_state(gen), torch.randn(6, 3, generator=gen)
    buffers = {k: v for k, v in state.items() if k not in TRAINED}

    def loss(trained, buffers, x):  # buffers are arguments: torch.func lets them change
        return fn({**trained, **buffers}, x).pow(2).sum()

    trained = {k: state[k] for k in TRAINED}
    if how == "grad":
        grads = torch.func.grad(loss)(trained, buffers, x)
    else:
        trained = {k: v.clone().requires_grad_() for k, v in trained.items()}
        loss(trained, buffers, x).backward()
        grads = {k: v.grad for k, v in trained.items()}
    return grads, buffers


@pytest.mark.parametrize("how", ["grad", "autograd"])
@pytest.mark.parametrize("policy", ["nothing", "dots", "everything"])
def test_arguments_updated_in_place_are_updated_once(how, policy):
    ref_grads, ref_buffers = bn_results(bn_step, how)
    grads, buffers = bn_results(remat(bn_step, POLICIES[policy]), how)
    assert buffers["num_batches_tracked"].item() == 4  # +1, not +2
    assert_close(buffers, ref_buffers)  # the forward's single update of the float statistics
    assert_close(grads, ref_grads)  # recomputed from the values before the update


def test_argument_that_requires_grad_updated_in_place_raises():
    def f(p, x):
        p["s"].mul_(2)
        return x * 2

    s = torch.ones(3).requires_grad_().clone()  # non-leaf: in place is allowed by autograd
    with pytest.raises(ValueError, match="updates in place"):
        remat(f)({"s": s}, torch.ones(3, requires_grad=True))


def test_float_argument_updated_in_place_under_torch_func_grad():
    def f(p, x):
        y = torch.sin(x + p["m"])  # (add saves no input: autograd allows the update)
        p["m"].mul_(0.5)  # gradient: through the use before and the one after the update
        return (y * p["m"]).sum()

    def outer(fn):  # m * 1 is not a leaf: torch.func lets f update it in place
        return lambda m, x: fn({"m": m * 1}, x)

    m, x = torch.randn(4), torch.randn(4)
    assert_close(torch.func.grad(outer(remat(f)), argnums=(0, 1))(m, x),
                 torch.func.grad(outer(f), argnums=(0, 1))(m, x))


def test_in_place_update_of_one_view_of_a_shared_storage():
    flat = torch.arange(6.0)
    p = {"a": flat[:3], "b": flat[3:], "w": torch.randn(3)}  # one storage, as flat buffers

    def f(p, x):
        p["a"].mul_(2)
        return (x * p["w"] * p["a"] + p["b"]).sum()

    ref_flat = torch.arange(6.0)
    ref = torch.func.grad(f, argnums=(1,))({"a": ref_flat[:3], "b": ref_flat[3:], "w": p["w"]},
                                           torch.ones(3))
    got = torch.func.grad(remat(f), argnums=(1,))(p, torch.ones(3))
    assert_close(got, ref)
    assert_close(flat, ref_flat)  # updated once



@pytest.mark.parametrize("how", ["grad", "autograd"])
def test_buffer_updated_again_before_the_backward(how):
    """Two micro-batches through the same buffers, then one backward (gradient accumulation)."""
    def two_steps(fn):
        gen = torch.Generator().manual_seed(5)
        state = bn_state(gen)
        xs = torch.randn(2, 6, 3, generator=gen)
        buffers = {k: v for k, v in state.items() if k not in TRAINED}
        buffers["ema"] = torch.zeros(4)
        trained = {k: state[k] for k in TRAINED}

        def loss(trained, buffers):
            return sum(fn({**trained, **buffers}, x).pow(2).sum() for x in xs)

        if how == "grad":
            grads = torch.func.grad(loss)(trained, buffers)
        else:
            trained = {k: v.clone().requires_grad_() for k, v in trained.items()}
            loss(trained, buffers).backward()
            grads = {k: v.grad for k, v in trained.items()}
        return grads, buffers

    def bn_only(p, x):  # reads no statistic after the update, as BatchNorm
        h = torch.nn.functional.batch_norm(x @ p["w"], p["running_mean"], p["running_var"],
                                           p["gamma"], p["beta"], training=True, momentum=0.1)
        p["num_batches_tracked"].add_(1)
        p["ema"].mul_(0.5).add_(h.detach().mean(0))  # moves the version counter
        return torch.tanh(h)

    ref_grads, ref_buffers = two_steps(bn_only)
    grads, buffers = two_steps(remat(bn_only))
    assert buffers["num_batches_tracked"].item() == 5
    assert_close(buffers, ref_buffers)
    assert_close(grads, ref_grads)
