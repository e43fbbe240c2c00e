"""Issue #23, ``remat`` at any level: ``sf.remat(model, policy)`` is a model, composed by type.

* ``sf.remat(fm, p)`` is a ``RematModel``: the same values, gradients (torch.func and
  autograd), buffers (updated once with ``mutable=True``) and members as ``fm``;
  ``sf.remat(fm.apply)`` is still a function;
* ``remat(remat(m, p), p)`` is itself, another policy is refused;
  ``with_precision(remat(m, p), q)`` is ``remat(with_precision(m, q), p)``;
* on 2 ranks: ``shard_params(remat(fm, p))`` is ``shard_params(fm, remat=p)``, FSDP x TP
  takes the policy the same way, ``tensor_split(remat(fm, p))`` is
  ``remat(tensor_split(fm), p)`` and ``remat(shard_params(fm), p)`` recomputes the whole
  sharded call; every one equal to the unsharded model.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.model import Model, missing_members
from shardfn.transforms.remat_model import RematModel

SEED = 5
PLAN = {"0": "colwise", "3": "rowwise"}
cp = sf.checkpoint_policies
POLICIES = {"nothing": cp.nothing_saveable, "dots": cp.dots_saveable,
            "everything": cp.everything_saveable}
F64 = sf.Precision(torch.float64, output_dtype=torch.float32)


def _net(batch_norm: bool = False, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6) if batch_norm else nn.Identity()
    return nn.Sequential(nn.Linear(5, 6), norm, nn.Tanh(), nn.Linear(6, 4), nn.Dropout(dropout))


def _batch() -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1))


def _grad_and_out(model, params, x, seed=0):
    """``torch.func.grad`` of the trainable leaves, the output and the new buffers."""
    trainable, rest = model.split_trainable(params)

    def loss(t):
        out, buffers = model.apply(model.merge(t, rest), x, mutable=True)
        return out.square().mean(), (out, buffers)

    torch.manual_seed(seed)  # dropout draws the same mask for both models
    grads, (out, buffers) = torch.func.grad(loss, has_aux=True)(trainable)
    return grads, out, buffers


# ---------------------------------------------------------------- unsharded


@settings(max_examples=6, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), batch_norm=st.booleans(),
       dropout=st.sampled_from([0.0, 0.5]))
def test_remat_of_a_model_is_the_model_recomputed(policy, batch_norm, dropout):
    fm = sf.functional(_net(batch_norm, dropout))
    model = sf.remat(fm, POLICIES[policy])
    assert isinstance(model, RematModel) and model.inner is fm
    # the protocol's members, each fm's (all of them once fm has all)
    assert set(missing_members(model)) <= set(missing_members(fm))
    assert isinstance(model, Model) or missing_members(fm)
    for name in ("names", "param_names", "buffer_names", "trainable_names", "frozen_names"):
        assert getattr(model, name) == getattr(fm, name), name
    params, x = model.init(SEED), _batch()
    assert all(torch.equal(params[k], v) for k, v in fm.init(SEED).items())
    assert all(torch.equal(model.params_from(_net(batch_norm))[k], v)
               for k, v in fm.params_from(_net(batch_norm)).items())
    ref_grads, ref_out, ref_buffers = _grad_and_out(fm, params, x)
    grads, out, buffers = _grad_and_out(model, params, x)
    assert_close(grads, ref_grads, rtol=0, atol=0)
    assert_close(out, ref_out, rtol=0, atol=0)
    assert_close(buffers, ref_buffers, rtol=0, atol=0)
    assert_close(model.eval().apply(params, x), fm.eval().apply(params, x), rtol=0, atol=0)


CALLS: list[int] = []


class _Counting(nn.Module):
    """A layer that notes each run of its forward (in a global: the skeleton is a copy)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x):
        CALLS.append(1)
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("remat", [False, True])
def test_backward_runs_the_forward_again(remat):
    fm = sf.functional(_Counting())
    model = sf.remat(fm) if remat else fm
    CALLS.clear()
    torch.func.grad(lambda p: model.apply(p, _batch()).sum())(fm.init(SEED))
    assert len(CALLS) == (2 if remat else 1)


def test_remat_model_passes_the_conformance_kit():
    fm = sf.functional(_net(batch_norm=True))
    report = sf.testing.check_model(sf.remat(fm, cp.dots_saveable), (_batch(),),
                                    loss_fn=lambda out, _: out.square().mean())
    assert report.kind == "RematModel" and "mutable" in report.checked


def test_buffers_move_once_and_are_state_under_autograd():
    """Two training steps under plain autograd: the forward updates BatchNorm's buffers
    once (the recomputation's updates are dropped), they come back detached (the next
    step takes them), and the caller's tensors are never written."""
    fm = sf.functional(_net(batch_norm=True))
    models = {"plain": fm, "remat": sf.remat(fm, cp.dots_saveable)}
    results = {}
    for kind, model in models.items():
        params, x = fm.init(SEED), _batch()
        given_buffers = {k: params[k].clone() for k in fm.buffer_names}
        trainable, rest = model.split_trainable(params)
        trainable = {k: v.clone().requires_grad_() for k, v in trainable.items()}
        for step in range(2):
            out, buffers = model.apply(model.merge(trainable, rest), x + step, mutable=True)
            out.square().mean().backward()
            assert not any(b.requires_grad for b in buffers.values()), kind
            if step == 0:
                assert all(torch.equal(params[k], v) for k, v in given_buffers.items())
            rest = {**rest, **buffers}
        results[kind] = ({k: t.grad for k, t in trainable.items()}, rest)
    assert results["remat"][1]["1.num_batches_tracked"] == 2
    assert_close(results["remat"], results["plain"], rtol=0, atol=0)


def test_remat_twice_functions_and_bad_arguments():
    fm = sf.functional(_net())
    model = sf.remat(fm, cp.dots_saveable)
    assert sf.remat(model, cp.dots_saveable) is model
    for mode in (True, False):  # a copy in that mode, under the same policy
        copy = model.train(mode) if mode else model.eval()
        assert isinstance(copy, RematModel) and copy.policy is cp.dots_saveable
        assert copy.inner.module.training is mode and model.inner.module.training
    with pytest.raises(ValueError, match=r"already remat\(\.\.\., dots_saveable\); one model "
                                         r"has one remat policy: apply sf.remat once"):
        sf.remat(model, cp.nothing_saveable)
    block = sf.remat(fm.apply)  # a bound method is a function: wrapped as one
    assert not isinstance(block, RematModel) and callable(block)
    params, x = fm.init(SEED), _batch()
    trainable, rest = fm.split_trainable(params)
    assert_close(*(torch.func.grad(lambda t, f=f: f(fm.merge(t, rest), x).square().sum())(
        trainable) for f in (block, fm.apply)), rtol=0, atol=0)
    with pytest.raises(TypeError, match="callable or a model"):
        sf.remat(3)
    with pytest.raises(TypeError, match="policy"):
        sf.remat(fm, "dots")
    with pytest.raises(AttributeError, match=r"RematModel has no 'units'.*\.inner"):
        _ = model.units
    norm = sf.remat(sf.functional(_net(batch_norm=True)))
    with pytest.raises(ValueError, match=r"remat\(FunctionalModel\)\.apply.*running_mean"):
        params = norm.init(SEED)  # buffers are state: differentiating them is refused
        floats = {k: v for k, v in params.items() if v.is_floating_point()}
        torch.func.grad(lambda p: norm.apply({**params, **p}, x).sum())(floats)


def test_precision_and_remat_in_either_order_are_one_model():
    fm = sf.functional(_net())
    inner_first = sf.with_precision(sf.remat(fm, cp.dots_saveable), F64)
    outer_first = sf.remat(sf.with_precision(fm, F64), cp.dots_saveable)
    assert isinstance(inner_first, RematModel) and inner_first == outer_first
    assert sf.with_precision(outer_first, F64) is outer_first
    with pytest.raises(ValueError, match="one model has one policy"):
        sf.with_precision(outer_first, sf.Precision(torch.float32))
    params, x = fm.init(SEED), _batch()
    ref = _grad_and_out(sf.with_precision(fm, F64), params, x)
    for model in (inner_first, outer_first):
        assert_close(_grad_and_out(model, params, x), ref, rtol=0, atol=0)


# ---------------------------------------------------------------- sharded, split, FSDP x TP


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _step(model, params, x):
    """(grads of ``params``, output) under ``torch.func.grad``."""
    grads = torch.func.grad(lambda p: model.apply(p, x).square().mean())(params)
    return grads, model.apply(params, x).detach()


def _kinds_on_rank(policy_name):
    """Every composition's (kind, its remat policy, gathered grads, output) on this rank."""
    import shardfn as sf

    policy = POLICIES[policy_name]
    fm, out = sf.functional(_net()), {}
    dp_mesh, x = sf.Mesh({"dp": 2}), _batch()
    half = x.chunk(2)[_rank()]
    for kind, model in (("remat_inner", sf.shard_params(sf.remat(fm, policy), dp_mesh, "dp")),
                        ("keyword", sf.shard_params(fm, dp_mesh, "dp", remat=policy)),
                        ("remat_outer", sf.remat(sf.shard_params(fm, dp_mesh, "dp"), policy))):
        grads, output = _step(model, model.init(SEED), half)
        inner = model.inner if isinstance(model, RematModel) else model
        out[kind] = (type(model).__name__, inner.remat, sf.gather(grads, model.specs, dp_mesh),
                     output)
    tp_mesh = sf.Mesh({"tp": 2})
    split = sf.tensor_split(sf.remat(fm, policy), tp_mesh, "tp", PLAN)
    grads, output = _step(split, split.init(SEED), x)
    out["split"] = (type(split).__name__, type(split.inner).__name__,
                    sf.gather(grads, split.specs, tp_mesh), output)
    mesh = sf.Mesh({"dp": 1, "tp": 2})
    for kind, model in (
            ("fsdp_tp_remat_split", sf.shard_params(sf.remat(sf.tensor_split(fm, mesh, "tp", PLAN),
                                                             policy), mesh, "dp")),
            ("fsdp_tp_split_remat", sf.shard_params(sf.tensor_split(sf.remat(fm, policy), mesh,
                                                                    "tp", PLAN), mesh, "dp"))):
        grads, output = _step(model, model.init(SEED), x)
        out[kind] = (type(model).__name__, model.sharded.remat, model.gather_params(grads),
                     output)
    return out


@pytest.mark.parametrize("policy", ["nothing", "dots"])  # shard_params: no record / record
def test_remat_composes_with_shard_params_tensor_split_and_fsdp_tp(worlds, policy):
    fm = sf.functional(_net())
    params, x = fm.init(SEED), _batch()
    ref_grads, ref_out = _step(fm, params, x)
    for rank, out in enumerate(worlds(2).run(_kinds_on_rank, policy)):
        assert out["remat_inner"][:2] == ("ShardedModel", POLICIES[policy])
        assert out["keyword"][:2] == ("ShardedModel", POLICIES[policy])
        assert out["remat_outer"][:2] == ("RematModel", None)  # whole call, not per unit
        assert out["split"][:2] == ("RematModel", "TensorSplitModel")
        for kind in ("fsdp_tp_remat_split", "fsdp_tp_split_remat"):
            assert out[kind][:2] == ("FsdpTpModel", POLICIES[policy]), kind
        # one model: bitwise the keyword spelling's gradients
        assert all(torch.equal(g, out["keyword"][2][k]) for k, g in out["remat_inner"][2].items())
        for kind, (_, _, grads, output) in out.items():
            assert_close(grads, ref_grads, msg=kind)
            dp_half = kind in ("remat_inner", "keyword", "remat_outer")
            assert_close(output, ref_out.chunk(2)[rank] if dp_half else ref_out, msg=kind)


def test_shard_params_refuses_two_remat_policies_and_sharding_twice():
    fm = sf.functional(_net())
    mesh = sf.Mesh({"dp": 1, "tp": 1})
    model = sf.remat(fm, cp.dots_saveable)
    assert sf.shard_params(model, mesh, "dp", remat=cp.dots_saveable).remat is cp.dots_saveable
    with pytest.raises(ValueError, match=r"sf.remat\(\.\.\., dots_saveable\) and "
                                         r"remat=nothing_saveable was passed too; one model has "
                                         r"one remat policy: shard_params\(fm, mesh, axis, "
                                         r"remat=policy\)"):
        sf.shard_params(model, mesh, "dp", remat=cp.nothing_saveable)
    with pytest.raises(ValueError, match=r"already a ShardedModel"):
        sf.shard_params(sf.remat(sf.shard_params(fm, mesh, "dp")), mesh, "tp")
    with pytest.raises(TypeError, match=r"split first, then shard"):
        sf.tensor_split(sf.remat(sf.shard_params(fm, mesh, "dp")), mesh, "tp", PLAN)


@pytest.mark.parametrize("policy", ["everything", "dots", "nothing"])
def test_remat_of_a_mutable_apply_updates_running_stats_once(policy):
    """``sf.remat(lambda p, x: fm.apply(p, x, mutable=True), everything_saveable)`` with
    BatchNorm: a saved copy of the buffer is written in place by BatchNorm (a write its
    schema does not declare, so no version bump); the replay must not hand that written
    copy back to BatchNorm, which would update the statistics a second time."""
    torch.manual_seed(0)
    fm = sf.functional(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    params, x = fm.init(0), torch.randn(5, 3)
    chosen = getattr(sf.checkpoint_policies, f"{policy}_saveable")
    trainable, rest = fm.split_trainable(params)

    def loss(t, remat):
        call = (lambda p, x: fm.apply(p, x, mutable=True))
        out, buffers = (sf.remat(call, chosen) if remat else call)(fm.merge(t, rest), x)
        return out.square().mean(), buffers

    expected = torch.func.grad(loss, has_aux=True)(trainable, False)
    got = torch.func.grad(loss, has_aux=True)(trainable, True)
    for name in fm.buffer_names:
        assert torch.equal(got[1][name], expected[1][name]), name
    for name in trainable:
        torch.testing.assert_close(got[0][name], expected[0][name])
