"""Issue 23: pipeline stages that are models of their own, and the pipeline as a model.

* ``sf.pipeline_split``: per-stage FunctionalModels named and initialised as the full
  model's slices (hypothesis over balances); ``pipeline_stages`` over stage models
  built from them (ZeRO-3 next to a plain stage with ``dp_axis``; FSDP x TP next to
  ``with_precision(tensor_split)``): the loss and the gathered gradients equal the
  unsharded reference; ``stage_transform=`` is the same model as the explicit path.
* ``PipelineModel`` implements the model protocol: ``sf.testing.check_model`` on two
  ranks (a ZeRO-3 stage and a plain one), ``gather`` of a different subset per rank.
* Meaningless orders are refused when built, naming the valid one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.testing.conformance import check_model
from shardfn.transforms.pipeline import balance_units
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse


class _Block(nn.Module):
    """Residual MLP block: the unit ZeRO-3 and tensor parallelism both split."""

    def __init__(self, d: int = 8, hidden: int = 16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


def _blocks() -> list[nn.Module]:
    return [nn.Linear(4, 8), _Block(), _Block(), _Block(), nn.Linear(8, 3)]


_TP_PLAN = {"*.fc1": "colwise", "*.fc2": "rowwise"}
_F64 = sf.Precision(param_dtype=torch.float64)


def _reference(stage_fns, split, seed, x, y):
    """Loss and gradients of the stages run one after the other in this process."""
    full = split.full.init(seed)

    def loss_of(trainable):
        h = x
        for fn, stage in zip(stage_fns, split, strict=True):
            h = fn(stage).apply({n: trainable.get(n, full[n]) for n in stage.names}, h)
        return mse(h, y)

    trainable = {n: full[n] for n in split.full.trainable_names}
    grads, loss = torch.func.grad_and_value(loss_of)(trainable)
    return loss, grads


# ---------------------------------------------------------------- pipeline_split


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4).filter(lambda b: sum(b) <= 7))
def test_split_stages_are_the_full_models_slices(balance):
    units = mlp_units(sum(balance))
    split = sf.pipeline_split(units, balance)
    full = split.full.init(3)
    assert len(split) == len(balance) and split.balance == tuple(balance)
    assert [n for stage in split for n in stage.names] == [
        n for n in split.full.names if any(n in stage.names for stage in split)]
    assert {n for stage in split for n in stage.names} == set(split.full.names)
    for stage in split:
        for name, value in stage.init(3).items():
            assert torch.equal(value, full[name])


def test_split_needs_n_stages_for_computed_balances():
    with pytest.raises(TypeError, match="needs n_stages="):
        sf.pipeline_split(mlp_units(4), "params")
    by_params = tuple(balance_units(mlp_units(4), 2, by="params"))
    assert sf.pipeline_split(mlp_units(4), "params", n_stages=2).balance == by_params


# ---------------------------------------------------------------- refusals (one process)


def _pp(model, **options):
    options = {"schedule": "gpipe", "microbatches": 2, "loss_fn": mse, "virtual": 2, **options}
    return sf.pipeline_stages(model, sf.Mesh({"pp": 1}), "pp", **options)


def test_stage_models_that_are_not_one_splits_stages_in_order_are_refused():
    split = sf.pipeline_split(mlp_units(5), [3, 2])
    other = sf.pipeline_split(mlp_units(5), [3, 2])
    with pytest.raises(ValueError, match="stage model 0 computes stage 1"):
        _pp([split[1], split[0]])
    with pytest.raises(ValueError, match="stage model 1 is a stage of another pipeline_split"):
        _pp([split[0], other[1]])
    with pytest.raises(ValueError, match=r"stage model 0's functional .* is not a stage"):
        _pp([sf.functional(nn.Sequential(*mlp_units(3))), split[1]])
    with pytest.raises(ValueError, match="2 stage models .* the pipeline has 1 stages"):
        _pp(split, virtual=1)
    with pytest.raises(ValueError, match=r"balance=\[2, 3\], but the stage models"):
        _pp(split, balance=[2, 3])
    with pytest.raises(TypeError, match="entry 0 is an nn.Module"):
        _pp([nn.Linear(2, 2), split[1]])


def test_pipelines_are_never_stages_nor_wrapped():
    split = sf.pipeline_split(mlp_units(5), [3, 2])
    pp = _pp(split)
    with pytest.raises(TypeError, match="stage model 0 is a PipelineModel.*pipeline_split"):
        _pp([pp, split[1]])
    with pytest.raises(TypeError, match="a pipeline is not pipelined again"):
        _pp(pp)
    with pytest.raises(ValueError, match=r"with_precision over a PipelineModel.*\[sf.with_prec"):
        sf.with_precision(pp, _F64)
    with pytest.raises(ValueError, match="mutable=True is not supported.*value_and_grad"):
        pp.apply(pp.init(0), batch(4)[0], mutable=True)


def test_stage_model_meshes_must_be_this_ranks_slice_without_pp():
    split = sf.pipeline_split(mlp_units(5), [3, 2])
    mesh = sf.Mesh({"pp": 1, "dp": 1})
    with pytest.raises(ValueError, match=r"stage model 0 is over a mesh with the pipeline axis"):
        sf.pipeline_stages([sf.shard_params(split[0], mesh, "dp"), split[1]], mesh,
                           schedule="gpipe", virtual=2, microbatches=2, loss_fn=mse)
    with pytest.raises(ValueError, match="remat= applies to plain stages; stages \\[0\\]"):
        sf.pipeline_stages([sf.shard_params(split[0], mesh.submesh(["dp"]), "dp"), split[1]],
                           mesh, schedule="gpipe", virtual=2, microbatches=2, loss_fn=mse,
                           remat=sf.checkpoint_policies.nothing_saveable)
    whole = sf.pipeline_split(mlp_units(5), [5])  # under sf.remat, shard_params still frees
    stage = sf.remat(sf.shard_params(whole[0], mesh.submesh(["dp"]), "dp"),
                     sf.checkpoint_policies.nothing_saveable)
    with pytest.raises(ValueError, match=r"'zb-h1' splits backward.*\(stages \[0\]\)"):
        sf.pipeline_stages([stage], mesh, schedule="zb-h1", microbatches=2, loss_fn=mse)


def test_stage_transform_is_sugar_for_the_stage_models_path():
    mesh = sf.Mesh({"pp": 1, "dp": 1})
    x, y = batch(4, seed=2)
    sugar = sf.pipeline_stages(_blocks(), mesh, balance=[2, 3], schedule="gpipe", virtual=2,
                               microbatches=2, loss_fn=mse,
                               stage_transform=lambda f, m: sf.shard_params(f, m, "dp"))
    split = sf.pipeline_split(_blocks(), [2, 3])
    explicit = sf.pipeline_stages([sf.shard_params(s, mesh.submesh(["dp"]), "dp")
                                   for s in split], mesh, schedule="gpipe", virtual=2,
                                  microbatches=2, loss_fn=mse)
    assert type(sugar.stage_models[0]) is type(explicit.stage_models[0]) is sf.ShardedModel
    got, want = sugar.value_and_grad(sugar.init(1), x, y), \
        explicit.value_and_grad(explicit.init(1), x, y)
    assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------- stage models, distributed


def _zero3_next_to_plain(x, y):
    """pp=2 x dp=2: stage 0 ZeRO-3 over dp, stage 1 plain; each replica half the batch."""
    mesh = sf.Mesh({"pp": 2, "dp": 2})
    split = sf.pipeline_split(_blocks(), [2, 3])
    pp = sf.pipeline_stages([sf.shard_params(split[0], mesh.submesh(["dp"]), "dp"), split[1]],
                            mesh, "pp", schedule="1f1b", microbatches=2, loss_fn=mse,
                            dp_axis="dp")
    rows = x.shape[0] // 2
    mine = slice(mesh.index("dp") * rows, (mesh.index("dp") + 1) * rows)
    loss, grads = pp.value_and_grad(pp.init(5), x[mine], y[mine])
    return loss, pp.gather(grads), sorted(pp.stage_models)


def test_zero3_stage_next_to_a_plain_stage_equals_the_unsharded_model(worlds):
    """The plain stage's gradients are averaged over dp, the ZeRO-3 stage's once (by
    shard_params): averaging either twice or not at all would differ."""
    x, y = batch(8, seed=4)
    split = sf.pipeline_split(_blocks(), [2, 3])
    loss, grads = _reference([lambda s: s, lambda s: s], split, 5, x, y)
    for rank, (got_loss, got_grads, transformed) in enumerate(worlds(4).run(
            _zero3_next_to_plain, x, y)):
        assert transformed == ([0] if rank < 2 else [])  # pp rank = rank // 2 on this mesh
        assert_close(got_loss, loss)
        assert list(got_grads) == list(split.full.trainable_names)
        assert_close(got_grads, grads)


def _fsdp_tp_and_precise_tensor_split(x, y):
    """pp=1 (two virtual stages) x dp=1 x tp=2: stage 0 FSDP x TP, stage 1
    ``with_precision(tensor_split(...), float64)``."""
    mesh = sf.Mesh({"pp": 1, "dp": 1, "tp": 2})
    stage_mesh = mesh.submesh(["dp", "tp"])
    split = sf.pipeline_split(_blocks(), [2, 3])
    stages = [sf.shard_params(sf.tensor_split(split[0], stage_mesh, "tp", _TP_PLAN),
                              stage_mesh, "dp"),
              sf.with_precision(sf.tensor_split(split[1], stage_mesh, "tp", _TP_PLAN), _F64)]
    pp = sf.pipeline_stages(stages, mesh, "pp", schedule="gpipe", virtual=2, microbatches=2,
                            loss_fn=mse)
    params = pp.init(7)
    loss, grads = pp.value_and_grad(params, x, y)
    return loss, pp.gather(grads), {n: tuple(t.shape) for n, t in params.items()}


def test_fsdp_tp_and_precision_stages_equal_the_unsharded_model(worlds):
    x, y = batch(6, seed=8)
    split = sf.pipeline_split(_blocks(), [2, 3])
    loss, grads = _reference([lambda s: s, lambda s: sf.with_precision(s, _F64)], split, 7,
                             x, y)
    assert loss.dtype == torch.float64
    for got_loss, got_grads, shapes in worlds(2).run(_fsdp_tp_and_precise_tensor_split, x, y):
        assert got_loss.dtype == torch.float64  # stage 1 computed under the policy
        assert_close(got_loss, loss)
        assert_close(got_grads, grads)
        assert shapes["1.fc1.weight"] == (8, 8) and shapes["2.fc1.weight"] == (8, 8)  # tp


# ---------------------------------------------------------------- the model protocol


def _bn_units() -> list[nn.Module]:
    return [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)]


def _protocol_on_rank(x, y):
    mesh = sf.Mesh({"pp": 2, "dp": 1})
    split = sf.pipeline_split(_bn_units(), [2, 2])
    pp = sf.pipeline_stages([sf.shard_params(split[0], mesh.submesh(["dp"]), "dp"), split[1]],
                            mesh, "pp", schedule="1f1b", microbatches=1, loss_fn=mse)
    report = check_model(pp, (x,), loss_fn=mse, targets=y, mutable=False)
    params = pp.init(0)
    # a different subset per rank: rank 0 its trainable leaves, rank 1 one leaf
    subset = pp.split_trainable(params)[0] if pp.rank == 0 else {"3.bias": params["3.bias"]}
    union = sorted(pp.gather(subset))
    try:  # a leaf of the other rank on rank 1 only: every rank raises, none hangs
        pp.gather({**params, "0.weight": params.get("0.weight", torch.zeros(1))}
                  if pp.rank == 1 else params)
        failure = None
    except Exception as error:  # noqa: BLE001 - the test looks at every rank's error
        failure = (type(error).__name__, str(error))
    return (sf.model.missing_members(pp), report.checked, pp.names, pp.buffer_names, union,
            failure, pp.eval().functional.module.training, pp.functional.module.training)


def test_pipeline_model_implements_the_protocol(worlds):
    x, y = batch(6, seed=1)
    results = worlds(2).run(_protocol_on_rank, x, y)
    full = sf.functional(nn.Sequential(*_bn_units()))
    expected_union = sorted(["0.weight", "0.bias", "1.weight", "1.bias", "3.bias"])
    for rank, (missing, checked, _, buffers, union, failure, evaluated, training) in \
            enumerate(results):
        assert missing == []
        assert {"gather", "params_from", "train/eval", "grads", "subsets"} <= set(checked)
        assert buffers == (tuple(n for n in full.buffer_names) if rank == 0 else ())
        assert union == expected_union
        assert (evaluated, training) == (False, True)
        want = ("ValueError", "held by other ranks") if rank == 1 else ("PeerFailed", "0.weight")
        assert failure is not None and failure[0] == want[0] and want[1] in failure[1]
    assert set(results[0][2]).isdisjoint(results[1][2])
    assert set(results[0][2]) | set(results[1][2]) == set(full.names)
