"""``PipelineModel.specs``: a pipeline's params checkpoint with the model as their layout.

Each pp rank holds its stages' leaves (``P()`` without a ``stage_transform``, the
stage model's specs with one, e.g. ZeRO-3 shards over "dp"). ``sf.checkpoint``
saves them with ``layouts={"params": pp}`` and no hand-written layout; one
process loads the full tree (equal to the unsplit model's init), and the world
loads its own leaves (shards) back.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.transforms.pipeline import pipeline_stages
from tests.transforms.pipeline._pipeline_models import mlp_units, mse


def _pipeline(mesh_shape: dict, zero3: bool):
    transform = (lambda f, m: sf.shard_params(f, m, "dp")) if zero3 else None
    return pipeline_stages(mlp_units(5, d=6), sf.Mesh(mesh_shape), balance=[3, 2],
                           schedule="1f1b", microbatches=2, loss_fn=mse,
                           dp_axis="dp" if "dp" in mesh_shape else None,
                           stage_transform=transform)


def _save_and_reload(path: str, mesh_shape: dict, zero3: bool):
    pp = _pipeline(mesh_shape, zero3)
    params = {n: t + 1.0 for n, t in pp.init(0).items()}  # not the init: a trained state
    ck.save(path, {"params": params, "step": 3}, pp.mesh, {"params": pp})
    like = {"params": {n: torch.zeros_like(t) for n, t in params.items()}, "step": 0}
    back = ck.load(path, like, pp.mesh, {"params": pp})
    expected_specs = {}
    for model in pp.stage_models.values():
        expected_specs.update(model.specs)
    mine, restored = pp.gather(params), pp.gather(back["params"])  # padding of shards cut
    return {"names": pp.names, "specs": pp.specs, "expected_specs": expected_specs,
            "equal": all(torch.equal(restored[n], mine[n]) for n in mine), "full": mine,
            "step": back["step"]}


@pytest.mark.parametrize("mesh_shape, zero3", [({"pp": 2}, False), ({"pp": 2, "dp": 2}, True)])
def test_checkpoint_with_the_pipeline_as_layout(worlds, tmp_path, mesh_shape, zero3):
    path = str(tmp_path / "ckpt")
    n = 1
    for size in mesh_shape.values():
        n *= size
    results = worlds(n).run(_save_and_reload, path, mesh_shape, zero3)
    full = sf.functional(torch.nn.Sequential(*mlp_units(5, d=6))).init(0)
    for got in results:
        assert got["equal"] and got["step"] == 3
        assert list(got["specs"]) == list(got["names"])
        if zero3:
            assert got["specs"] == {n: got["expected_specs"][n] for n in got["names"]}
            assert any(spec != sf.P() for spec in got["specs"].values())
        else:
            assert all(spec == sf.P() for spec in got["specs"].values())
    assert {n for got in results for n in got["names"]} == set(full)
    loaded = ck.load(path, {"params": {n: torch.zeros_like(t) for n, t in full.items()},
                            "step": 0})  # one process: the whole tree
    assert_close(loaded["params"], {n: t + 1.0 for n, t in full.items()})
    assert_close(loaded["params"], results[0]["full"])
