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
from shardfn.checkpoint.errors import structure_difference


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


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("inv_freq", torch.ones(2))

    def forward(self, x):
        return self.lin(x) * self.inv_freq.sum()


def test_an_optimizer_state_of_the_trainable_part_names_the_leaves_it_lacks(tmp_path):
    """``{"params": every leaf, "opt": adamw.init(trainable)}``: the message names the
    buffer the state has no moments for (was: two whole tree structures)."""
    model = sf.shard_params(sf.functional(WithBuffer()), sf.Mesh({"dp": 1}), "dp")
    params = model.init(0)
    trainable, _ = model.split_trainable(params)
    opt = sf.optim.adamw(1e-3)
    state = {"params": params, "opt": opt.init(trainable)}
    with pytest.raises(ValueError, match=r"'opt' is not its optimizer's init of these params "
                                         r"\(missing: 1\.inv_freq, 2\.inv_freq\).*OptLayout"):
        sf.checkpoint.save(tmp_path / "ck", state, model.mesh, {"params": model, "opt": opt})
    sf.checkpoint.save(tmp_path / "ok", {"params": trainable, "opt": opt.init(trainable)},
                       model.mesh, {"params": model, "opt": opt})


def test_structure_difference_names_both_sides():
    diff = structure_difference
    spec = sf.pytree.tree_structure
    assert diff(spec({"a": 1}), spec({"a": 1, "b": {"c": 2}})) == "missing: b.c"
    assert diff(spec({"a": 1, "z": 3}), spec({"b": 1})) == "missing: b; unexpected: a, z"
    assert diff(spec({f"k{i}": 0 for i in range(9)}), spec({}), limit=2) == \
        "unexpected: k0, k1 and 7 more"
    assert diff(spec((1, 2)), spec([1, 2])).startswith("the same leaf names")


def _save_on_half_the_world(path: str):
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank >= 2:  # these ranks never call save
        return None
    # a mesh of its own (a mesh over ranks [0, 1] would make a process group on those two
    # only, which the persistent world's later groups would not agree with)
    mesh = sf.Mesh({"dp": 1}, ranks=[rank])
    try:
        sf.checkpoint.save(path, {"x": torch.ones(2)}, mesh)
    except ValueError as error:
        save_error = str(error)
    try:
        sf.checkpoint.load(path, {"x": torch.ones(2)}, mesh)
    except ValueError as error:
        return save_error, str(error)
    return save_error, None


def test_a_mesh_over_part_of_the_world_is_refused_at_once(worlds, tmp_path):
    """Ranks 0 and 1 save on meshes of their own while ranks 2 and 3 do not call: refused
    before any collective, naming both sizes (was: waiting for the other ranks in the
    checkpoint's first collective until the world's timeout)."""
    results = worlds(4).run(_save_on_half_the_world, str(tmp_path / "ck"))
    assert results[2:] == [None, None]
    for save_error, load_error in results[:2]:
        for message in (save_error, load_error):
            assert "spans 1 of the world's 4 ranks; save/load run on every rank" in message
