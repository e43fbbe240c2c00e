"""pipeline_stages composed: pp x dp training equals one process; remat per stage.

* mesh {"pp": 2, "dp": 2}: each dp replica pipelines its half of the batch, and
  ``dp_axis="dp"`` averages gradients and loss once per step; 5 AdamW steps give
  the single-process parameters (gathered with ``pp.gather``) and losses.
* ``remat=policy``: each stage's forward recomputed in backward gives the same
  gradients and keeps fewer activation bytes per stage (sf.memory).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
import shardfn.memory as mem
from shardfn.transforms.pipeline import pipeline_stages
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, reference

STEPS = 5


def _single_process_training(seed: int, x: torch.Tensor, y: torch.Tensor, units=None):
    """STEPS AdamW steps of ``nn.Sequential(*units)`` (default: six MLP units) on one process."""
    model = sf.functional(nn.Sequential(*(mlp_units(6) if units is None else units)))
    params = model.init(seed)
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    losses = []
    for _ in range(STEPS):
        grads, loss = torch.func.grad_and_value(lambda p: mse(model.apply(p, x), y))(params)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        losses.append(loss)
    return params, losses


def _pp_dp_training(schedule: str, seed: int, x: torch.Tensor, y: torch.Tensor):
    mesh = sf.Mesh({"pp": 2, "dp": 2})
    pp = pipeline_stages(mlp_units(6), mesh, "pp", balance=[3, 3], schedule=schedule,
                         microbatches=3, loss_fn=mse, dp_axis="dp")
    rows = x.shape[0] // 2
    mine = slice(mesh.index("dp") * rows, (mesh.index("dp") + 1) * rows)
    params = pp.init(seed)
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    losses = []
    for _ in range(STEPS):
        loss, grads = pp.value_and_grad(params, x[mine], y[mine])
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        losses.append(loss)
    return pp.gather(params), losses


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp_x_dp_adamw_steps_equal_one_process(worlds, schedule):
    x, y = batch(12, seed=3)
    expected_params, expected_losses = _single_process_training(4, x, y)
    for params, losses in worlds(4).run(_pp_dp_training, schedule, 4, x, y):
        assert_close(losses, expected_losses)
        assert_close(params, expected_params)


def test_pp_x_dp_without_the_reduction_differs(worlds):
    """The check above can fail: each replica's own gradient is not the full-batch one."""
    x, y = batch(12, seed=3)
    _, loss, grads, _ = reference(mlp_units(6), 4, x, y)

    def on_rank():
        mesh = sf.Mesh({"pp": 2, "dp": 2})
        pp = pipeline_stages(mlp_units(6), mesh, "pp", balance=[3, 3], schedule="1f1b",
                             microbatches=2, loss_fn=mse)
        mine = slice(mesh.index("dp") * 6, (mesh.index("dp") + 1) * 6)
        return pp.value_and_grad(pp.init(4), x[mine], y[mine])

    for got_loss, got_grads in worlds(4).run(on_rank):
        assert not torch.allclose(got_loss, loss)
        assert any(not torch.allclose(g, grads[n]) for n, g in got_grads.items())


def _remat_case(policy):
    def on_rank():
        pp = pipeline_stages(mlp_units(6, d=32), sf.Mesh({"pp": 2}), balance=[3, 3],
                             schedule="gpipe", microbatches=4, loss_fn=mse, remat=policy)
        params = pp.init(2)
        with mem.track() as tracker:
            loss, grads = pp.value_and_grad(params, *batch(16))
        return loss, grads, tracker.max_by_category[f"pipeline.stage{pp.rank}"]
    return on_rank


def test_remat_per_stage_same_gradients_less_memory(worlds):
    _, loss, grads, _ = reference(mlp_units(6, d=32), 2, *batch(16))
    plain = worlds(2).run(_remat_case(None))
    remat = worlds(2).run(_remat_case(sf.checkpoint_policies.nothing_saveable))
    for (plain_loss, plain_grads, plain_bytes), (r_loss, r_grads, r_bytes) in zip(
            plain, remat, strict=True):
        for got_loss, got_grads in ((plain_loss, plain_grads), (r_loss, r_grads)):
            assert_close(got_loss, loss)
            for name, grad in got_grads.items():
                assert_close(grad, grads[name])
        # GPipe keeps 4 micro-batches; with remat each keeps its stage's output only, not
        # the Tanh outputs inside (measured: 2824 against 4448 bytes, 3232 against 6452)
        assert r_bytes < 0.75 * plain_bytes, (r_bytes, plain_bytes)


class _Block(nn.Module):
    """Residual MLP block: the unit both ZeRO-3 and tensor parallelism split."""

    def __init__(self, d: int = 8, hidden: int = 16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


def _blocks():
    torch.manual_seed(0)
    return [nn.Linear(4, 8), _Block(), _Block(), _Block(), nn.Linear(8, 3)]


def _single_process_blocks(seed: int, x: torch.Tensor, y: torch.Tensor):
    return _single_process_training(seed, x, y, _blocks())


def _composed_training(kind: str, seed: int, x: torch.Tensor, y: torch.Tensor):
    other = "dp" if kind == "shard_params" else "tp"
    mesh = sf.Mesh({"pp": 2, other: 2})
    if kind == "shard_params":  # ZeRO-3 inside each stage; each dp replica its half batch
        def transform(fmodel, stage_mesh):
            return sf.shard_params(fmodel, stage_mesh, "dp")
        rows = x.shape[0] // 2
        mine = slice(mesh.index("dp") * rows, (mesh.index("dp") + 1) * rows)
        dp_axis = "dp"
    else:  # Megatron MLP inside each stage; the tp ranks see the same batch
        def transform(fmodel, stage_mesh):
            return sf.tensor_split(fmodel, stage_mesh, "tp",
                                   {"*.fc1": "colwise", "*.fc2": "rowwise"})
        mine, dp_axis = slice(None), None
    pp = pipeline_stages(_blocks(), mesh, "pp", balance=[2, 3], schedule="1f1b",
                         microbatches=3, loss_fn=mse, dp_axis=dp_axis, stage_transform=transform)
    params = pp.init(seed)
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    losses = []
    for _ in range(STEPS):
        loss, grads = pp.value_and_grad(params, x[mine], y[mine])
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        losses.append(loss)
    return pp.gather(params), losses, {n: tuple(t.shape) for n, t in params.items()}


@pytest.mark.parametrize("kind", ["shard_params", "tensor_split"])
def test_pp_x_transform_adamw_steps_equal_one_process(worlds, kind):
    x, y = batch(12, seed=5)
    expected_params, expected_losses = _single_process_blocks(6, x, y)
    for params, losses, local_shapes in worlds(4).run(_composed_training, kind, 6, x, y):
        assert_close(losses, expected_losses)
        assert_close(params, expected_params)
        split = [n for n in local_shapes if n.endswith("fc1.weight")]
        assert split and all(local_shapes[n][0] == 8 for n in split)  # 16 rows over 2 ranks


def test_split_backward_with_shard_params_is_refused(worlds):
    def on_rank():
        mesh = sf.Mesh({"pp": 2, "dp": 2})
        try:
            pipeline_stages(_blocks(), mesh, balance=[2, 3], schedule="zb-h1", microbatches=2,
                            loss_fn=mse, stage_transform=lambda f, m: sf.shard_params(f, m, "dp"))
        except ValueError as error:
            return str(error)
        return None

    for text in worlds(4).run(on_rank):
        assert text is not None and "'zb-h1' splits backward" in text
