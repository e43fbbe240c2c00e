"""What a newcomer writes first: a checkpoint of an unsharded model, with and without a mesh.

* ``layouts=fm`` (a plain functional model: every layout ``P()``) saves and loads on one
  process with no mesh: a replicated layout names no mesh axis, so none is needed;
* a sharded layout with no mesh is still refused, naming the leaf;
* the model passed where the mesh goes (the third positional argument) is refused
  naming what it got and where a model belongs (was: ``AttributeError: size``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardfn as sf


def test_unsharded_model_layouts_need_no_mesh(tmp_path):
    fm = sf.functional(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)))
    params = fm.init(0)
    sf.checkpoint.save(tmp_path / "ck", params, layouts=fm)
    loaded = sf.checkpoint.load(tmp_path / "ck", fm.init(1), layouts=fm)
    assert sorted(loaded) == sorted(params)
    assert all(torch.equal(loaded[k], params[k]) for k in params)
    sharded = sf.shard_params(fm, sf.Mesh({"dp": 1}), "dp")
    with pytest.raises(ValueError, match=r"leaf '0.bias' has the layout .*P\('dp'\).*pass "
                                         r"mesh="):
        sf.checkpoint.save(tmp_path / "sharded", sharded.init(0), layouts=sharded)


def test_a_model_in_the_mesh_slot_is_refused_naming_it(tmp_path):
    fm = sf.functional(nn.Linear(3, 4))
    with pytest.raises(TypeError, match="mesh= must be an sf.Mesh, got FunctionalModel.*"
                                        "layouts="):
        sf.checkpoint.save(tmp_path / "ck", fm.init(0), fm)
    sf.checkpoint.save(tmp_path / "ok", fm.init(0))
    with pytest.raises(TypeError, match="mesh= must be an sf.Mesh, got FunctionalModel"):
        sf.checkpoint.load(tmp_path / "ok", fm.init(0), fm)
