"""Issue #22 items 5 and 6: a gradient reduction that cannot be right is refused, and
``sf.all_finite`` sees complex inf/NaN.

``shard_params``' gradients are this rank's shard of the gradient *averaged* over its
axis. ``data_parallel(...).reduce_grads`` (or ``shard_opt_state``) over the same axis
averaged different ranks' shards together (off by 1.91 in the issue, also in check mode);
now it raises naming the leaf and the axis, in every mode (``torch.func.grad``,
``torch.autograd.grad``, ``.grad`` from ``backward()``), at every axis size. Unreduced
gradients (plain ``functional``) still reduce exactly, also in a process that ran
``shard_params`` before, and a reduction over another axis (a replica axis) is allowed.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.testing import assert_close

import shardfn as sf
from shardfn.primitives import reduced
from shardfn.primitives._comm import Axis


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _refusals(check: bool):
    """On every rank: shard_params grads in every mode, then each refused reduction."""
    import torch
    import torch.distributed as dist

    import shardfn as sf

    previous = sf.check_consistency(check)
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        mesh = sf.Mesh({"dp": n})
        fm = sf.functional(_net())
        sp = sf.shard_params(fm, mesh, "dp")
        shards = sp.shard(fm.init(0))
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))

        def loss(s):
            return sp.apply(s, x).square().mean()

        leaves = {k: v.clone().requires_grad_() for k, v in shards.items()}
        loss(leaves).backward()
        trees = {
            "func.grad": torch.func.grad(loss)(shards),
            "func.grad_and_value": torch.func.grad_and_value(loss)(shards)[0],
            "backward": {k: v.grad for k, v in leaves.items()},
            "autograd.grad": dict(zip(leaves, torch.autograd.grad(loss(leaves),
                                                                   list(leaves.values())),
                                      strict=True)),
        }
        dp = sf.data_parallel(mesh, "dp")
        zero = sf.shard_opt_state(sf.optim.adamw(1e-2), mesh, "dp")
        sf.check_consistency(False)  # check mode refuses this init already (shards differ)
        state = zero.init(shards)
        sf.check_consistency(check)
        errors = {}
        for mode, grads in trees.items():
            for what, reduce in (("reduce_grads", dp.reduce_grads),
                                 ("donated", sf.data_parallel(mesh, "dp", donate=True)
                                  .reduce_grads),
                                 ("zero.update", lambda g: zero.update(g, state, shards)),
                                 ("zero.reduce_grads", lambda g: zero.reduce_grads(g, shards))):
                try:
                    reduce(grads)
                    errors[(mode, what)] = None
                except ValueError as e:
                    errors[(mode, what)] = str(e)
        hooked = {k: v.clone().requires_grad_() for k, v in shards.items()}
        try:  # data_parallel's autograd path: the hooks see shard_params' .grad
            with dp.overlap(hooked) as sync:
                loss(hooked).backward()
            sync.grads()
            errors[("backward", "overlap")] = None
        except ValueError as e:
            errors[("backward", "overlap")] = str(e)
        # the same process, unreduced gradients of the full model: reduced exactly
        params = fm.init(0)
        plain = torch.func.grad(lambda p: fm.apply(p, x).square().mean())(params)
        mean = dp.reduce_grads(plain)
        return errors, plain, mean
    finally:
        sf.check_consistency(previous)


@pytest.mark.parametrize("check", [False, True])
def test_reducing_shard_params_grads_again_is_refused(worlds, check):
    results = worlds(2).run(_refusals, check)
    for rank, (errors, _, _) in enumerate(results):
        for (mode, what), message in errors.items():
            assert message is not None, f"rank {rank}: {what} of {mode} grads was not refused"
            assert "axis 'dp'" in message and "sf.shard_params" in message, message
            assert re.search(r"leaf '[02]\.(weight|bias)'", message), message  # by name
            assert "directly" in message, message
    plains = [plain for _, plain, _ in results]
    expected = {k: (plains[0][k] + plains[1][k]) / 2 for k in plains[0]}
    for _, _, mean in results:  # no false positive, and the right mean
        assert_close(mean, expected)


def test_refused_at_axis_size_one():
    """The issue's snippet on a mesh of one: the same mistake is refused (no group needed)."""
    fm = sf.functional(_net())
    mesh = sf.Mesh({"dp": 1})
    sp = sf.shard_params(fm, mesh, "dp")
    shards = sp.shard(fm.init(0))
    x = torch.randn(3, 4)
    grads = torch.func.grad(lambda s: sp.apply(s, x).sum())(shards)
    with pytest.raises(ValueError, match=r"'0\.bias' is already reduced over axis 'dp'"):
        sf.data_parallel(mesh, "dp").reduce_grads(grads)
    # shard_params' own gradients are used directly; unreduced grads still pass
    plain = torch.func.grad(lambda p: fm.apply(p, x).sum())(fm.init(0))
    assert sf.data_parallel(mesh, "dp").reduce_grads(plain) is plain


@pytest.mark.parametrize("mode", ["reduce_once", "reduce_each"])
def test_accumulated_grads_are_refused_too(mode):
    fm = sf.functional(_net())
    mesh = sf.Mesh({"dp": 1})
    sp = sf.shard_params(fm, mesh, "dp")
    shards = sp.shard(fm.init(0))
    batch = torch.randn(4, 4)
    grads, _ = sp.accumulate_grads(lambda s, b: sp.apply(s, b).sum(), 2, mode=mode)(shards, batch)
    with pytest.raises(ValueError, match="already reduced over axis 'dp'"):
        sf.data_parallel(mesh, "dp").reduce_grads(grads)


def _axis(names, ranks) -> Axis:
    return Axis(tuple(names), len(ranks), 0, None, tuple(ranks))


@pytest.mark.parametrize(("done", "again", "refused"), [
    ((("dp",), (0, 1)), (("dp",), (0, 1)), True),             # the same axis
    ((("dp",), (0, 1)), (("dp", "rep"), (0, 1, 2, 3)), True),  # a product containing it
    ((("dp",), (0, 1)), (("rep",), (0, 2)), False),            # HSDP by hand: the replica axis
    ((("dp", "rep"), (0, 1, 2, 3)), (("rep",), (0, 2)), True),  # shard_params' HSDP covers rep
    ((("dp",), (0,)), (("dp",), (0,)), True),                  # size one: the same name
    ((("dp",), (0,)), (("rep",), (0,)), False),
])
def test_overlap_of_axes(done, again, refused):
    over = reduced.ReducedOver(done[0], frozenset(done[1]), "sf.shard_params")
    assert reduced.overlaps(over, _axis(*again)) is refused


def test_marks_follow_the_storage_and_die_with_it(monkeypatch):
    ax = _axis(("dp",), (0, 1))
    g = torch.randn(4)
    reduced.mark_reduced([g], ax, "test")
    assert reduced.reduced_over(g[1:]) is not None  # a view: the same storage
    assert reduced.reduced_over(g * 1) is None  # a new tensor is not marked
    assert reduced.reduced_over(torch.randn(4)) is None
    key = g.untyped_storage()._cdata
    others = [torch.randn(1) for _ in range(3)]  # made while g lives: not at g's address
    del g
    monkeypatch.setattr(reduced, "_prune_above", 0)  # the next mark prunes the freed ones
    reduced.mark_reduced(others, ax, "test")
    assert key not in reduced._MARKS


def test_all_finite_sees_complex_inf_and_nan():
    inf, nan = float("inf"), float("nan")
    assert sf.all_finite({"z": torch.tensor([1 + 2j, 3 - 1j])})
    for bad in (complex(inf, 0), complex(0, inf), complex(nan, 0), complex(0, nan)):
        assert not sf.all_finite({"z": torch.tensor([1 + 0j, bad])}), bad
        assert not sf.all_finite({"z": torch.tensor([bad], dtype=torch.complex128)}), bad
    assert not sf.all_finite({"w": torch.ones(2), "z": torch.tensor([complex(inf, inf)])})


def test_loss_scale_unscales_complex_gradients():
    scaler = sf.dynamic_loss_scale(init_scale=8.0)
    state = scaler.init()
    grads = {"z": torch.tensor([8 + 16j], dtype=torch.complex64), "w": torch.tensor([8.0])}
    out = scaler.unscale(grads, state)
    assert_close(out["z"], torch.tensor([1 + 2j], dtype=torch.complex64))
    assert_close(out["w"], torch.tensor([1.0]))
