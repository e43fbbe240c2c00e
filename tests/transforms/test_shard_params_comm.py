"""shard_params communicates only for the gradients asked for; check-mode calls; unequal batches.

* differentiating w.r.t. some leaves only (``grad`` of the bias, the rest captured;
  or ``requires_grad`` on some leaves under autograd) reduce-scatters only their
  gradients: ``sf.comm_stats()`` shows exactly their bytes (the all-gathers are
  unchanged), and the gradients are still right. Frozen parameters are never
  reduced (FSDP2's ``test_fully_shard_frozen_params`` counts the same);
* ``init`` / ``shard`` call ``consistency.check_replicated`` on the full values and
  ``apply`` calls ``consistency.check_call`` on its arguments over the data-parallel
  axes (observed through the module, since check mode itself is another module's);
* unequal per-rank batches: ``grad_reduce="mean"`` averages per-rank gradients (it is
  the full-batch mean only for equal batches); ``grad_reduce="sum"`` with the loss
  summed over the rank's examples and divided by the global count weights them
  exactly: equal to the full-batch gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.remat import checkpoint_policies
from shardfn.transforms.shard_params import shard_params
from tests.transforms.test_shard_params import Block


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), Block(6, 7), Block(6, 9), nn.Linear(6, 3))
    net[0].requires_grad_(False)  # frozen: gathered, never reduced
    return net


def _x(n: int) -> torch.Tensor:
    return torch.randn(2 * n, 5, generator=torch.Generator().manual_seed(4))


WANTED = {  # the leaves differentiated, and how many units (of root, 1, 2) reduce
    "the last bias": (["3.bias"], 1),
    "one unit": (["2.ln.weight", "2.ln.bias", "2.up.weight", "2.up.bias", "2.down.weight",
                  "2.down.bias"], 1),
    "a unit's weight and the root's bias": (["1.up.weight", "3.bias"], 2),
}


def _comm_on_rank(n: int, wanted: list[str], how: str, remat: bool):
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank()
    fmodel = sf.functional(_net())
    mesh = sf.Mesh({"dp": n})
    model = shard_params(fmodel, mesh, "dp", units=Block,
                         remat=checkpoint_policies.nothing_saveable if remat else None)
    shards = model.init(0)
    x = _x(n).chunk(n)[rank]
    train = {k: shards[k] for k in wanted}
    rest = {k: v for k, v in shards.items() if k not in train}

    def loss_fn(train):
        return model.apply({**rest, **train}, x).square().mean()

    def step():
        if how == "func":
            return torch.func.grad(loss_fn)(train)
        leaves = {k: v.detach().requires_grad_() for k, v in train.items()}
        loss_fn(leaves).backward()
        return {k: v.grad for k, v in leaves.items()}

    step()  # warm-up: the prefetch order
    sf.reset_comm_stats()
    grads = step()
    stats = sf.comm_stats()
    full = sf.gather({**rest, **grads}, model.specs, mesh)
    return ({k: full[k] for k in grads}, stats.op_bytes("psum_scatter"),
            stats.op_bytes("all_gather"), stats.op_calls("psum"),
            stats.op_calls("psum_scatter"))


@pytest.mark.parametrize("what", list(WANTED))
@pytest.mark.parametrize(("how", "remat"), [("func", False), ("autograd", False),
                                            ("func", True)])
@pytest.mark.parametrize("n", [2, 3])
def test_only_wanted_gradients_are_reduced(worlds, what, how, remat, n):
    wanted, reducing_units = WANTED[what]
    fmodel = sf.functional(_net())
    params = fmodel.init(0)
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    ref = torch.func.grad(lambda t: fmodel.apply({**params, **t}, _x(n)).square().mean())(
        {k: params[k] for k in wanted})
    padded = lambda s: math.ceil(s[0] / n) * math.prod(s[1:]) * 4  # noqa: E731 bytes per rank
    # what the reduce-scatters of these leaves move (rows padded to whole shards)
    expected_scatter = sum(padded(shapes[k]) * (n - 1) for k in wanted)
    # the all-gathers are those of every leaf (frozen ones too), forward and backward
    expected_gather = 2 * sum(padded(s) * (n - 1) for k, s in shapes.items() if len(s))
    for grads, scatter_bytes, gather_bytes, psums, scatters in worlds(n).run(
            _comm_on_rank, n, wanted, how, remat):
        assert scatter_bytes == expected_scatter, (scatter_bytes, expected_scatter)
        assert scatters == reducing_units  # a unit with nothing wanted issues no reduction
        assert gather_bytes == expected_gather
        assert psums == 0
        for name in wanted:
            assert_close(grads[name], ref[name], msg=lambda m, k=name: f"{k}: {m}")


def _hsdp_on_rank(wanted: list[str]):
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank()
    fmodel = sf.functional(_net())
    mesh = sf.Mesh({"rep": 2, "dp": 2})
    model = shard_params(fmodel, mesh, "dp", units=Block, replicate_axis="rep")
    shards = model.init(0)
    x = _x(4).chunk(4)[rank]
    train = {k: shards[k] for k in wanted}
    rest = {k: v for k, v in shards.items() if k not in train}
    sf.reset_comm_stats()
    grads = torch.func.grad(lambda t: model.apply({**rest, **t}, x).square().mean())(train)
    stats = sf.comm_stats()
    full = sf.gather({**rest, **grads}, model.specs, mesh)
    return {k: full[k] for k in grads}, stats.op_calls("psum_scatter"), stats.op_calls("psum")


def test_hsdp_reduces_only_wanted_gradients(worlds):
    wanted, reducing_units = WANTED["one unit"]
    fmodel = sf.functional(_net())
    params = fmodel.init(0)
    ref = torch.func.grad(lambda t: fmodel.apply({**params, **t}, _x(4)).square().mean())(
        {k: params[k] for k in wanted})
    for grads, scatters, psums in worlds(4).run(_hsdp_on_rank, wanted):
        # one reduce-scatter over "dp" and one all-reduce over "rep", for that unit only
        assert (scatters, psums) == (reducing_units, reducing_units)
        for name in wanted:
            assert_close(grads[name], ref[name], msg=lambda m, k=name: f"{k}: {m}")


def _all_trainable_on_rank(n: int):
    import shardfn as sf

    fmodel = sf.functional(_net())
    model = shard_params(fmodel, sf.Mesh({"dp": n}), "dp", units=Block)
    trainable, rest = model.split_trainable(model.init(0))  # frozen ones are never differentiated
    sf.reset_comm_stats()
    torch.func.grad(lambda t: model.apply(model.merge(t, rest), _x(n)).square().mean())(trainable)
    return sf.comm_stats().op_bytes("psum_scatter")


def test_frozen_parameters_are_never_reduced(worlds):
    n = 2
    shapes = {k: tuple(v.shape) for k, v in sf.functional(_net()).init(0).items()}
    trainable = [k for k in shapes if not k.startswith("0.")]
    expected = sum(math.ceil(shapes[k][0] / n) * math.prod(shapes[k][1:]) * 4 * (n - 1)
                   for k in trainable)
    assert worlds(n).run(_all_trainable_on_rank, n) == [expected] * n


# ---------------------------------------------------------------- check-mode calls


def test_init_shard_and_apply_call_the_consistency_checks(monkeypatch):
    from shardfn.primitives import consistency

    calls = []
    monkeypatch.setattr(consistency, "check_replicated",
                        lambda what, ax, tree: calls.append((what, ax.names, sorted(tree))))
    monkeypatch.setattr(consistency, "check_call",
                        lambda op, ax, tree=None, **static: calls.append((op, ax.names, tree)))
    fmodel = sf.functional(_net())
    mesh = sf.Mesh({"dp": 1, "rep": 1})
    model = shard_params(fmodel, mesh, "dp", units=Block, replicate_axis="rep")
    shards = model.init(0)
    inits = [c for c in calls if c[0] == "shard_params.init"]
    # every leaf is checked, on the full values, over both data-parallel axes
    assert sorted(k for c in inits for k in c[2]) == sorted(fmodel.names)
    assert all(c[1] == ("dp", "rep") for c in inits)
    calls.clear()
    model.shard(fmodel.init(0))
    assert calls == [("shard_params.shard", ("dp", "rep"), sorted(fmodel.names))]
    calls.clear()
    x = _x(1)
    model.apply(shards, x)
    ((op, axes, tree),) = calls
    assert (op, axes) == ("shard_params.apply", ("dp", "rep"))
    assert tree[0][0] is x  # (args, kwargs)


def _check_mode_on_rank(what: str):
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank()
    fmodel = sf.functional(_net())
    model = shard_params(fmodel, sf.Mesh({"dp": 2}), "dp", units=Block)
    previous = sf.check_consistency()
    sf.check_consistency(True)
    try:
        if what == "init seed":
            model.init(rank)  # a different seed per rank
        elif what == "shard values":
            model.shard(fmodel.init(rank))
        else:  # unequal per-rank batch shapes
            model.apply(model.init(0), _x(2)[:rank + 1])
    except sf.ConsistencyError as error:
        return str(error)
    finally:
        sf.check_consistency(previous)
    return None


@pytest.mark.parametrize(("what", "op"), [("init seed", "shard_params.init"),
                                          ("shard values", "shard_params.shard"),
                                          ("batch shapes", "shard_params.apply")])
def test_check_mode_catches_rank_mismatches(worlds, what, op):
    for message in worlds(2).run(_check_mode_on_rank, what):
        assert message is not None and op in message, message


# ---------------------------------------------------------------- unequal batches


def _unequal_on_rank(sizes: list[int], grad_reduce: str):
    import torch.distributed as dist

    import shardfn as sf

    rank, n = dist.get_rank(), len(sizes)
    fmodel = sf.functional(_net())
    mesh = sf.Mesh({"dp": n})
    model = shard_params(fmodel, mesh, "dp", units=Block, grad_reduce=grad_reduce)
    trainable, rest = model.split_trainable(model.init(0))
    x = _x_unequal(sizes)[sum(sizes[:rank]):sum(sizes[:rank + 1])]
    total = sum(sizes)  # the global count, known to every rank (e.g. from the loader)
    out = lambda t: model.apply(model.merge(t, rest), x).square().sum(-1)  # noqa: E731
    if grad_reduce == "sum":  # exact weighting: per-example sum over the global count
        loss_fn = lambda t: out(t).sum() / total  # noqa: E731
    else:  # the usual per-rank mean
        loss_fn = lambda t: out(t).mean()  # noqa: E731
    previous = sf.check_consistency()
    sf.check_consistency(False)  # check mode (on in the test world) refuses unequal shapes
    try:
        grads = torch.func.grad(loss_fn)(trainable)
    finally:
        sf.check_consistency(previous)
    return sf.gather({**rest, **grads}, model.specs, mesh)


def _x_unequal(sizes: list[int]) -> torch.Tensor:
    return torch.randn(sum(sizes), 5, generator=torch.Generator().manual_seed(8))


def test_unequal_batches_weighted_exactly_with_sum(worlds):
    sizes = [1, 4]
    fmodel = sf.functional(_net())
    train, rest = fmodel.split_trainable(fmodel.init(0))
    full_batch = torch.func.grad(lambda t: fmodel.apply(
        fmodel.merge(t, rest), _x_unequal(sizes)).square().sum(-1).mean())(train)
    trainable = fmodel.trainable_names
    for grads in worlds(2).run(_unequal_on_rank, sizes, "sum"):
        for name in trainable:
            assert_close(grads[name], full_batch[name], msg=lambda m, k=name: f"{k}: {m}")
    # "mean" is the mean of the per-rank means: not the full-batch mean here (documented)
    for grads in worlds(2).run(_unequal_on_rank, sizes, "mean"):
        assert any(not torch.allclose(grads[k], full_batch[k]) for k in trainable)
