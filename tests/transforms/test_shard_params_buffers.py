"""shard_params and buffers: ``apply(..., mutable=True)`` returns the updated buffers.

BatchNorm running statistics updated in place inside a unit's (or the root's)
forward come back as ``new_buffers`` (every buffer, whole, integer
``num_batches_tracked`` included), per rank: each rank's statistics are those of
its own batch, exactly what ``functional.apply_with_buffers`` gives on that batch
(like DDP without SyncBatchNorm). With identical batches on every rank, outputs and
statistics equal one process. A recompute in backward (``remat``) does not update
them a second time; a unit called twice updates them twice, as one process does.
Also: ``split_trainable`` / ``merge`` on shard trees.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.remat import checkpoint_policies
from shardfn.transforms.shard_params import shard_params

POLICIES = {"none": None, "nothing_saveable": checkpoint_policies.nothing_saveable,
            "dots_saveable": checkpoint_policies.dots_saveable}


class BNBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.tanh(self.bn(self.lin(x)))


class BNNet(nn.Module):
    """BatchNorm in the root and in units; ``blocks.0`` is called twice."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.bn0 = nn.BatchNorm1d(d)
        self.blocks = nn.ModuleList([BNBlock(d), BNBlock(d)])
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        x = self.bn0(self.inp(x))
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[0](x)
        return self.out(x)


def _fmodel():
    torch.manual_seed(0)
    return sf.functional(BNNet())


def _batches(n: int, same: bool, step: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    one = [torch.randn(5, 3, generator=gen) for _ in range(n)]
    return [one[0]] * n if same else one


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _buffers_on_rank(n: int, policy_name: str, how: str, same: bool, steps: int):
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank() if dist.is_initialized() else 0
    fmodel = _fmodel()
    mesh = sf.Mesh({"dp": n})
    model = shard_params(fmodel, mesh, "dp", units=BNBlock, remat=POLICIES[policy_name])
    shards = model.init(0)
    results = []
    for step in range(steps):
        x = _batches(n, same, step)[rank]
        train, rest = model.split_trainable(shards)

        def loss_fn(train, rest=rest, x=x):
            out, new_buffers = model.apply(model.merge(train, rest), x, mutable=True)
            return _loss(out), (out, new_buffers)

        if how == "func":
            grads, (out, new_buffers) = torch.func.grad(loss_fn, has_aux=True)(train)
        elif how == "autograd":
            leaves = {k: v.detach().requires_grad_() for k, v in train.items()}
            loss, (out, new_buffers) = loss_fn(leaves)
            loss.backward()
            grads = {k: v.grad for k, v in leaves.items()}
        else:  # forward only
            with torch.no_grad():
                _, (out, new_buffers) = loss_fn(train)
            grads = {}
        full_grads = sf.gather({**rest, **grads}, model.specs, mesh) if grads else {}
        results.append((out.detach(), {k: v.detach() for k, v in new_buffers.items()},
                        {k: full_grads[k] for k in grads}))
        shards = {**shards, **new_buffers}  # the next step's tree
    return results


def _reference(n: int, same: bool, steps: int):
    """Per rank: functional.apply_with_buffers on the rank's batch, step after step."""
    fmodel = _fmodel()
    out = []
    for rank in range(n):
        params, per_step = fmodel.init(0), []
        for step in range(steps):
            x = _batches(n, same, step)[rank]
            train, rest = fmodel.split_trainable(params)

            def loss_fn(train, rest=rest, x=x):
                y, buffers = fmodel.apply_with_buffers({**rest, **train}, x)
                return _loss(y), (y, buffers)

            grads, (y, buffers) = torch.func.grad(loss_fn, has_aux=True)(train)
            per_step.append((y, buffers, grads))
            params = {**params, **buffers}
        out.append(per_step)
    return out


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("how", ["func", "autograd", "no_grad"])
def test_new_buffers_are_the_per_rank_statistics(worlds, policy, how):
    n, steps = 2, 2
    reference = _reference(n, False, steps)
    for rank, results in enumerate(worlds(n).run(_buffers_on_rank, n, policy, how, False,
                                                 steps)):
        for step, (out, buffers, grads) in enumerate(results):
            ref_out, ref_buffers, _ = reference[rank][step]
            assert list(buffers) == list(_fmodel().buffer_names)
            for name, ref in ref_buffers.items():
                # counted once per call even when backward recomputes the unit
                assert buffers[name].dtype == ref.dtype, name
                assert_close(buffers[name], ref, msg=lambda m, k=name, s=step: f"step {s} {k}: {m}")
            assert_close(out, ref_out)
            assert int(buffers["blocks.0.bn.num_batches_tracked"]) == 2 * (step + 1)
            # the gradient is the mean of the per-rank gradients (each rank's own batch
            # statistics), as DDP without SyncBatchNorm
            for name, grad in grads.items():
                expected = sum(reference[r][step][2][name] for r in range(n)) / n
                assert_close(grad, expected, msg=lambda m, k=name, s=step: f"step {s} {k}: {m}")


@pytest.mark.parametrize("policy", ["none", "nothing_saveable"])
def test_identical_batches_equal_one_process(worlds, policy):
    n, steps = 2, 2
    reference = _reference(1, True, steps)[0]
    for results in worlds(n).run(_buffers_on_rank, n, policy, "func", True, steps):
        for (out, buffers, grads), (ref_out, ref_buffers, ref_grads) in zip(results, reference,
                                                                            strict=True):
            assert_close(out, ref_out)
            for name, ref in ref_buffers.items():
                assert_close(buffers[name], ref)
            for name, ref in ref_grads.items():
                assert_close(grads[name], ref)


def test_mutable_false_returns_the_output_only_and_alias():
    fmodel = _fmodel()
    model = shard_params(fmodel, sf.Mesh({"dp": 1}), "dp", units=BNBlock)
    shards = model.init(0)
    x = _batches(1, True)[0]
    out = model.apply(shards, x)
    assert isinstance(out, torch.Tensor)
    out2, buffers = model.apply_with_buffers(shards, x)
    assert_close(out2, out)
    ref_out, ref_buffers = fmodel.apply_with_buffers(fmodel.init(0), x)
    assert_close(out, ref_out)
    for name in fmodel.buffer_names:
        assert_close(buffers[name], ref_buffers[name])
        assert buffers[name].data_ptr() != shards[name].data_ptr()  # fresh: shards unchanged
    assert int(shards["bn0.num_batches_tracked"]) == 0
    # eval: the running statistics are used, not updated
    evaluated = model.eval()
    next_shards = {**shards, **buffers}
    y, after = evaluated.apply(next_shards, x, mutable=True)
    assert_close(y, fmodel.eval().apply({**fmodel.init(0), **ref_buffers}, x))
    for name in fmodel.buffer_names:
        assert_close(after[name], next_shards[name])


def _split_on_rank(n: int):
    import shardfn as sf

    fmodel = _fmodel()
    model = shard_params(fmodel, sf.Mesh({"dp": n}), "dp", units=BNBlock)
    shards = model.init(0)
    train, rest = model.split_trainable(shards)
    merged = model.merge(train, rest)
    errors = []
    missing = {k: v for k, v in rest.items() if k != "bn0.running_mean"}
    for bad in (lambda: model.merge(train, {**rest, "inp.weight": shards["inp.weight"]}),
                lambda: model.merge(train, missing),
                lambda: model.merge({**train, "inp.weight": torch.zeros(4, 3)}, rest),
                lambda: model.split_trainable(fmodel.init(0))):
        try:
            bad()
        except ValueError as error:
            errors.append(str(error))
    return sorted(train), sorted(rest), list(merged) == list(model.names), errors


def test_split_trainable_and_merge_on_shard_trees(worlds):
    fmodel = _fmodel()
    for train, rest, ordered, errors in worlds(2).run(_split_on_rank, 2):
        assert train == sorted(fmodel.trainable_names)
        assert rest == sorted(fmodel.buffer_names)
        assert ordered
        assert len(errors) == 4
        assert "inp.weight" in errors[0] and "both" in errors[0]
        assert "bn0.running_mean" in errors[1]
        assert "inp.weight" in errors[2] and "full shape" in errors[2]
        assert "full shape" in errors[3]


def test_new_buffers_come_back_in_the_given_dtype_and_device():
    """With ``precision`` (buffers computed in bf16) and ``offload`` the new buffers are in
    the form the caller gave: float32 (int64 for the counter), on the storage device."""
    fmodel = _fmodel()
    x = _batches(1, True)[0]
    _, ref_buffers = fmodel.apply_with_buffers(fmodel.init(0), x)
    policy = sf.Precision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    for options in (dict(precision=policy), dict(offload=True)):
        model = shard_params(fmodel, sf.Mesh({"dp": 1}), "dp", units=BNBlock, **options)
        shards = model.init(0)
        out, buffers = model.apply(shards, x, mutable=True)
        assert out.dtype == torch.float32
        for name, ref in ref_buffers.items():
            assert buffers[name].dtype == shards[name].dtype == ref.dtype, name
            assert buffers[name].device == shards[name].device
            # bf16 statistics: 8 mantissa bits (exact for the integer counter)
            tol = dict(rtol=2e-2, atol=2e-2) if "precision" in options else {}
            assert_close(buffers[name], ref, **tol)


def _property_on_rank(case):
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(case["seed"])
    fmodel = sf.functional(BNNet(case["d"]))
    mesh = sf.Mesh({"dp": case["n"]})
    model = shard_params(fmodel, mesh, "dp", units=BNBlock, remat=POLICIES[case["policy"]],
                         reshard_after_forward=case["reshard"])
    shards = model.init(case["seed"])
    x = case["inputs"][rank]
    train, rest = model.split_trainable(shards)

    def loss_fn(train):
        out, new_buffers = model.apply(model.merge(train, rest), x, mutable=True)
        return out.square().mean(), new_buffers

    grads, new_buffers = torch.func.grad(loss_fn, has_aux=True)(train)
    full = sf.gather({**rest, **grads}, model.specs, mesh)
    return {k: full[k] for k in grads}, new_buffers


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 3), d=st.integers(2, 6), per_rank=st.integers(2, 4),
       policy=st.sampled_from(list(POLICIES)), reshard=st.booleans(),
       seed=st.integers(0, 2**16))
def test_buffers_property_per_rank_reference(worlds, n, d, per_rank, policy, reshard, seed):
    """Hypothesis over world size, width (uneven shards), batch, remat and resharding: new
    buffers are each rank's ``apply_with_buffers``; gradients the mean of the per-rank ones."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(per_rank, 3, generator=gen) for _ in range(n)]
    case = dict(n=n, d=d, policy=policy, reshard=reshard, seed=seed, inputs=inputs)
    torch.manual_seed(seed)
    fmodel = sf.functional(BNNet(d))
    params = fmodel.init(seed)
    train, rest = fmodel.split_trainable(params)
    refs = []
    for x in inputs:
        def ref_loss(train, x=x):
            out, buffers = fmodel.apply_with_buffers({**rest, **train}, x)
            return out.square().mean(), buffers

        refs.append(torch.func.grad(ref_loss, has_aux=True)(train))
    for rank, (grads, buffers) in enumerate(worlds(n).run(_property_on_rank, case)):
        for name, ref in refs[rank][1].items():
            assert_close(buffers[name], ref, msg=lambda m, k=name: f"{k}: {m}")
        for name, grad in grads.items():
            assert_close(grad, sum(r[0][name] for r in refs) / n,
                         msg=lambda m, k=name: f"{k}: {m}")


def _synced_on_rank(n: int, policy: str, how: str):
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank()
    torch.manual_seed(0)
    mesh = sf.Mesh({"dp": n})
    fmodel = sf.functional(sf.sync_batch_norm(BNNet(), "dp", mesh=mesh))
    model = shard_params(fmodel, mesh, "dp", units=BNBlock, remat=POLICIES[policy])
    shards = model.init(0)
    x = _synced_batch(n).chunk(n)[rank]
    train, rest = model.split_trainable(shards)

    def loss_fn(train):
        out, new_buffers = model.apply(model.merge(train, rest), x, mutable=True)
        return _loss(out), (out, new_buffers)

    if how == "func":
        grads, (out, new_buffers) = torch.func.grad(loss_fn, has_aux=True)(train)
    else:
        leaves = {k: v.detach().requires_grad_() for k, v in train.items()}
        loss, (out, new_buffers) = loss_fn(leaves)
        loss.backward()
        grads = {k: v.grad for k, v in leaves.items()}
    full = sf.gather({**rest, **grads}, model.specs, mesh)
    return ({k: full[k] for k in grads}, out.detach(),
            {k: v.detach() for k, v in new_buffers.items()})


def _synced_batch(n: int) -> torch.Tensor:
    return torch.randn(4 * n, 3, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("how", ["func", "autograd"])
def test_sync_batch_norm_under_shard_params_equals_one_process(worlds, policy, how):
    """``sf.sync_batch_norm`` (the synced option the docs name): outputs, statistics and
    gradients equal one process on the whole batch. Its psum runs inside a unit; under
    ``torch.func`` the unit's recorded backward calls the psum's backward Function."""
    n = 2
    fmodel = _fmodel()
    train, rest = fmodel.split_trainable(fmodel.init(0))

    def ref_loss(train):
        out, buffers = fmodel.apply_with_buffers({**rest, **train}, _synced_batch(n))
        return _loss(out), (out, buffers)

    ref_grads, (ref_out, ref_buffers) = torch.func.grad(ref_loss, has_aux=True)(train)
    for rank, (grads, out, buffers) in enumerate(worlds(n).run(_synced_on_rank, n, policy,
                                                               how)):
        assert_close(out, ref_out.chunk(n)[rank])
        for name, ref in ref_buffers.items():
            assert_close(buffers[name], ref, msg=lambda m, k=name: f"{k}: {m}")
        for name, ref in ref_grads.items():
            assert_close(grads[name], ref, msg=lambda m, k=name: f"{k}: {m}")
