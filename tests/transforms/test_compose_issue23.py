"""Issue #23, model composition by type: precision (and remat) in any order that means something.

* ``shard_params(with_precision(fm, p))``, ``with_precision(shard_params(fm), p)``,
  ``shard_params(fm, precision=p)`` (and both at once) are one ``ShardedModel`` under
  ``p``: bitwise the same gradients and outputs, equal to the unsharded
  ``with_precision(fm, p)`` under ``torch.func.grad`` (hypothesis over policies, remat
  policies, units and 1-2 ranks), and the same bytes: every field of ``p`` honoured
  (a float32 ``reduce_dtype`` reduce-scatters twice the bytes of a bf16 one, which a
  plain outer wrapper would not);
* ``tensor_split(with_precision(fm, p))`` == ``with_precision(tensor_split(fm), p)``, and
  the four spellings of FSDP x TP under ``p`` are one ``FsdpTpModel``;
* orders that mean nothing are refused when the model is built, naming the valid one;
  ``train``/``eval`` and ``mutable=True`` keep the policy.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf

SEED = 3
PLAN = {"0": "colwise", "3": "rowwise"}
ORDERS = ("inner", "outer", "keyword", "both")
FSDP_TP_ORDERS = ("split_inner", "split_outer", "outer", "keyword")
REMATS = {"none": None, "nothing": sf.checkpoint_policies.nothing_saveable,
          "dots": sf.checkpoint_policies.dots_saveable}


def _net(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6) if batch_norm else nn.Identity()
    # 6 rows over 2 ranks even (tensor_split needs it); the last layer's 3 rows are padded
    return nn.Sequential(nn.Linear(5, 6), norm, nn.Tanh(), nn.Linear(6, 3))


def _batch() -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1))


def _loss(model, params, x):
    return model.apply(params, x).square().mean()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _reference(policy):
    """The unsharded ``with_precision(fm, policy)`` on the full batch: (grads, output)."""
    fm = sf.functional(_net())
    model = sf.with_precision(fm, policy)
    params, x = fm.init(SEED), _batch()
    grads = torch.func.grad(lambda p: _loss(model, p, x))(params)
    return grads, model.apply(params, x).detach()


def _sharded(order, fm, mesh, policy, **options):
    if order == "inner":
        return sf.shard_params(sf.with_precision(fm, policy), mesh, "dp", **options)
    if order == "outer":
        return sf.with_precision(sf.shard_params(fm, mesh, "dp", **options), policy)
    if order == "keyword":
        return sf.shard_params(fm, mesh, "dp", precision=policy, **options)
    assert order == "both"
    return sf.shard_params(sf.with_precision(fm, policy), mesh, "dp", precision=policy,
                           **options)


def _orders_on_rank(policy, remat, units, stats):
    """Every order's (kind, policy, gathered grads, output, all-gather and reduce-scatter
    bytes) on this rank's half of the batch."""
    import shardfn as sf

    n = _world_size()
    fm, mesh = sf.functional(_net()), sf.Mesh({"dp": n})
    x = _batch().chunk(n)[_rank()]
    out = {}
    for order in ORDERS:
        model = _sharded(order, fm, mesh, policy, units=units, remat=REMATS[remat])
        shards = model.init(SEED)
        step = torch.func.grad(lambda s, model=model: _loss(model, s, x))
        step(shards)  # warm-up: the prefetch order is learned, bytes are steady from now on
        sf.reset_comm_stats()
        grads = step(shards)
        counted = sf.comm_stats()
        out[order] = (type(model).__name__, model.precision, sf.gather(grads, model.specs, mesh),
                      model.apply(shards, x).detach(),
                      (counted.op_bytes("all_gather"), counted.op_bytes("psum_scatter"))
                      if stats else None)
    return out


FLOAT = st.sampled_from([None, torch.float32, torch.float64])
POLICIES = st.builds(sf.Precision, param_dtype=st.sampled_from([None, torch.float64]),
                     reduce_dtype=FLOAT, output_dtype=FLOAT, cast_inputs=st.booleans(),
                     ).filter(lambda p: p.cast_inputs or p.param_dtype is None)  # else F.linear
# refuses float32 inputs with float64 weights, unsharded too


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 2), policy=POLICIES, remat=st.sampled_from(sorted(REMATS)),
       units=st.sampled_from([None, ["0"]]))
def test_every_order_of_shard_params_and_precision_is_one_model(worlds, n, policy, remat,
                                                                units):
    ref_grads, ref_out = _reference(policy)
    results = worlds(n).run(_orders_on_rank, policy, remat, units, False)
    for out in results:
        first = out["inner"]
        for order in ORDERS:
            kind, precision, grads, output, _ = out[order]
            assert (kind, precision) == ("ShardedModel", policy), order
            # one model: bitwise the same as the other spellings ...
            assert all(torch.equal(grads[k], first[2][k]) for k in grads), order
            assert torch.equal(output, first[3]), order
            # ... and equal to the unsharded with_precision model
            assert_close(grads, ref_grads)
            assert all(g.dtype == torch.float32 for g in grads.values())  # master dtype
    assert_close(torch.cat([out["outer"][3] for out in results]), ref_out)


def test_every_order_honours_reduce_dtype_in_bytes(worlds):
    """bf16 compute: all-gathers in bf16 for every order; a float32 reduce_dtype reduce-
    scatters twice the bytes of a bf16 one in every order (a wrapper that only cast the
    shards would reduce in bf16 whatever reduce_dtype says)."""
    fp32_reduce = sf.Precision(torch.bfloat16, reduce_dtype=torch.float32,
                               output_dtype=torch.float32)
    bf16_reduce = fp32_reduce._replace(reduce_dtype=torch.bfloat16)
    wide, narrow = (worlds(2).run(_orders_on_rank, p, "none", None, True)
                    for p in (fp32_reduce, bf16_reduce))
    for out_wide, out_narrow in zip(wide, narrow, strict=True):
        for order in ORDERS:
            (gather_w, scatter_w), (gather_n, scatter_n) = out_wide[order][4], out_narrow[order][4]
            assert gather_w == gather_n > 0, order
            assert scatter_w == 2 * scatter_n > 0, order
            assert out_wide[order][4] == out_wide["keyword"][4]
            assert all(torch.equal(g, out_wide["keyword"][2][k])
                       for k, g in out_wide[order][2].items()), order


# ---------------------------------------------------------------- tensor_split, FSDP x TP


def _fsdp_tp(order, fm, mesh, policy):
    if order == "split_inner":
        return sf.shard_params(sf.tensor_split(sf.with_precision(fm, policy), mesh, "tp", PLAN),
                               mesh, "dp")
    if order == "split_outer":
        return sf.shard_params(sf.with_precision(sf.tensor_split(fm, mesh, "tp", PLAN), policy),
                               mesh, "dp")
    if order == "outer":
        return sf.with_precision(sf.shard_params(sf.tensor_split(fm, mesh, "tp", PLAN), mesh,
                                                 "dp"), policy)
    return sf.shard_params(sf.tensor_split(fm, mesh, "tp", PLAN), mesh, "dp", precision=policy)


def _split_on_rank(policy, dp):
    import shardfn as sf

    n = _world_size()
    fm = sf.functional(_net())
    out = {}
    tp_mesh, x = sf.Mesh({"tp": n}), _batch()  # tensor parallel: every rank the whole batch
    for order in ("tensor_split_inner", "tensor_split_outer"):
        split = sf.tensor_split(fm, tp_mesh, "tp", PLAN)
        model = (sf.tensor_split(sf.with_precision(fm, policy), tp_mesh, "tp", PLAN)
                 if order == "tensor_split_inner" else sf.with_precision(split, policy))
        params = model.init(SEED)
        grads = torch.func.grad(lambda p, model=model: _loss(model, p, x))(params)
        out[order] = (model.policy, sf.gather(grads, model.specs, tp_mesh),
                      model.apply(params, x).detach())
    mesh = sf.Mesh({"dp": dp, "tp": n // dp})
    x = _batch().chunk(dp)[mesh.index("dp")]
    for order in FSDP_TP_ORDERS:
        model = _fsdp_tp(order, fm, mesh, policy)
        shards = model.init(SEED)
        grads = torch.func.grad(lambda s, model=model: _loss(model, s, x))(shards)
        out[order] = (type(model).__name__, model.sharded.precision, model.gather_params(grads))
    return out


@settings(max_examples=5, deadline=None)
@given(n=st.integers(1, 2), policy=POLICIES, dp_first=st.booleans())
def test_tensor_split_and_fsdp_tp_take_precision_in_any_order(worlds, n, policy, dp_first):
    ref_grads, ref_out = _reference(policy)
    dp = n if dp_first else 1
    for out in worlds(n).run(_split_on_rank, policy, dp):
        for order in ("tensor_split_inner", "tensor_split_outer"):
            got_policy, grads, output = out[order]
            assert got_policy == policy
            assert_close(grads, ref_grads)
            assert_close(output, ref_out)
        for order in FSDP_TP_ORDERS:
            kind, precision, grads = out[order]
            assert (kind, precision) == ("FsdpTpModel", policy), order
            assert_close(grads, ref_grads)
            assert all(torch.equal(g, out["keyword"][2][k]) for k, g in grads.items()), order


# ---------------------------------------------------------------- refusals and state


F64 = sf.Precision(torch.float64)
F64_OUT32 = sf.Precision(torch.float64, output_dtype=torch.float32)


def test_precision_twice_is_the_model_itself_or_refused():
    fm = sf.functional(_net())
    wrapped = sf.with_precision(fm, F64)
    assert sf.with_precision(wrapped, F64) is wrapped
    with pytest.raises(ValueError, match=r"with_precision\(\.\.\.\) model already computes "
                                         r"under .*float64.*apply with_precision once"):
        sf.with_precision(wrapped, F64_OUT32)
    mesh = sf.Mesh({"dp": 1})
    sharded = sf.shard_params(fm, mesh, "dp", precision=F64)
    assert sf.with_precision(sharded, F64) is sharded
    with pytest.raises(ValueError, match=r"ShardedModel already computes under .*"
                                         r"shard_params\(fm, mesh, axis, precision=policy\)"):
        sf.with_precision(sharded, F64_OUT32)
    with pytest.raises(ValueError, match=r"precision=.* passed too; one model has one policy"):
        sf.shard_params(wrapped, mesh, "dp", precision=F64_OUT32)
    assert sf.shard_params(wrapped, mesh, "dp", precision=F64).precision == F64


def test_sharding_a_sharded_model_is_refused_naming_the_valid_order():
    fm = sf.functional(_net())
    mesh = sf.Mesh({"dp": 1, "x": 1, "tp": 1})
    sharded = sf.shard_params(fm, mesh, "dp")
    with pytest.raises(ValueError, match=r"already a ShardedModel sharded over 'dp'; sharding "
                                         r"it again over the same axis.*shard_params\(fm, mesh"):
        sf.shard_params(sharded, mesh, "dp")
    with pytest.raises(ValueError, match=r"over another axis.*replicate_axis='b'"):
        sf.shard_params(sf.with_precision(sharded, F64), mesh, "x")
    fsdp_tp = sf.shard_params(sf.tensor_split(fm, mesh, "tp", PLAN), mesh, "dp")
    with pytest.raises(ValueError, match=r"already a FsdpTpModel"):
        sf.shard_params(fsdp_tp, mesh, "x")
    with pytest.raises(TypeError, match=r"split first, then shard: shard_params\(tensor_split"):
        sf.tensor_split(sharded, mesh, "tp", PLAN)
    with pytest.raises(TypeError, match=r"split over 'tp' already"):
        sf.tensor_split(sf.tensor_split(fm, mesh, "tp", PLAN), mesh, "tp", PLAN)
    with pytest.raises(TypeError, match=r"got the function .*remat="):
        sf.shard_params(sf.remat(fm.apply), mesh, "dp")


def test_train_eval_and_buffers_keep_the_policy():
    fm = sf.functional(_net(batch_norm=True))
    mesh = sf.Mesh({"dp": 1})
    wrapped = sf.with_precision(fm, F64)
    assert wrapped.eval().policy == F64 and not wrapped.eval().module.training
    for model in (sf.shard_params(wrapped, mesh, "dp"),
                  sf.with_precision(sf.shard_params(fm, mesh, "dp"), F64)):
        assert model.eval().precision == F64 and model.train().precision == F64
    params, x = fm.init(SEED), _batch()
    ref_out, ref_buffers = wrapped.apply(params, x, mutable=True)
    # buffers come back in the dtype they were given (float32 here), as under shard_params
    assert all(b.dtype == params[k].dtype for k, b in ref_buffers.items())
    assert ref_out.dtype == torch.float64
    sharded = sf.shard_params(wrapped, mesh, "dp")
    out, buffers = sharded.apply_with_buffers(sharded.shard(params), x)
    assert_close(out, ref_out)
    assert_close(buffers, ref_buffers)
    assert_close(wrapped.apply_with_buffers(params, x)[1], ref_buffers)
