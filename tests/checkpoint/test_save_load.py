"""Round trips of every kind of state, mismatch reports, and the per-rank / replicated rules.

A state with parameters, masked and multi_transform optimizer states, SGD
momentum, a loss-scaler state, a torch.Generator state, ints, floats, strings
and None comes back exactly. A ``like`` whose names or shapes differ gets one
error listing every mismatch. A leaf without a layout that differs between
ranks is refused (naming it), unless it is marked ``PerRank``, whose values come
back per rank.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn import optim


def _params():
    torch.manual_seed(1)
    return {"emb": torch.randn(7, 4), "ln": {"w": torch.randn(4), "b": torch.randn(4)},
            "head": torch.randn(3, 4, dtype=torch.float64), "steps": torch.tensor(5)}


def _opts():
    decay = lambda t: sf.pytree.tree_map(lambda x: x.dim() >= 2, t)  # noqa: E731
    labels = lambda t: sf.pytree.tree_map_with_path(  # noqa: E731
        lambda n, x: "sgd" if n.startswith("ln") else "adam", t)
    return {
        "masked": optim.masked(optim.adamw(1e-2, weight_decay=0.1), decay),
        "multi": optim.multi_transform({"sgd": optim.sgd(0.1, momentum=0.9),
                                        "adam": optim.adam(1e-3)}, labels),
    }


def _state(scale: float):
    params = {k: v for k, v in _params().items() if k != "steps"}
    opts = _opts()
    states = {name: opt.init(params) for name, opt in opts.items()}
    grads = sf.pytree.tree_map(lambda p: torch.ones_like(p) * scale, params)
    for name, opt in opts.items():  # a real update, so every moment is non-zero
        _, states[name] = opt.update(grads, states[name], params)
    gen = torch.Generator().manual_seed(int(scale * 100))
    return {"params": params, "opt": states,
            "scaler": sf.dynamic_loss_scale().init(),
            "rng": gen.get_state(), "data": {"epoch": 2, "offset": 1234, "file": "shard-07"},
            "lr": 3e-4, "flag": True, "nothing": None}


def _zeros_like(tree):
    return sf.pytree.tree_map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor)
                              else x, tree)


def test_every_kind_of_leaf_round_trips(tmp_path):
    state = _state(0.5)
    path = ck.save(str(tmp_path / "c"), state)
    like = _zeros_like(_state(0.25))
    like["data"] = {"epoch": 0, "offset": 0, "file": ""}
    out = ck.load(path, like)
    flat_out, flat_ref = sf.pytree.tree_leaves(out), sf.pytree.tree_leaves(state)
    assert len(flat_out) == len(flat_ref)
    for a, b in zip(flat_out, flat_ref, strict=True):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b and type(a) is type(b)
    assert out["nothing"] is None
    gen = torch.Generator()
    gen.set_state(out["rng"])
    ref = torch.Generator()
    ref.set_state(state["rng"])
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=ref))


def test_mismatch_lists_every_difference(tmp_path):
    path = ck.save(str(tmp_path / "c"), {"a": torch.zeros(3), "b": torch.zeros(2, 2),
                                         "c": torch.zeros(4), "n": 1})
    like = {"a": torch.zeros(3), "b": torch.zeros(2, 3), "d": torch.zeros(1),
            "n": torch.zeros(1)}
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.load(path, like)
    text = str(info.value)
    assert "missing" in text and "'d'" in text
    assert "unexpected" in text and "'c'" in text
    assert "'b': shape (2, 2) in the checkpoint, (2, 3) in like" in text
    assert "'n': the checkpoint holds an object" in text
    assert "'a'" not in text  # the leaf that fits is not listed
    with pytest.raises(ck.CheckpointMismatchError, match="dtype torch.float32"):
        ck.load(path, {"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(2, 2),
                       "c": torch.zeros(4), "n": 1})


def _per_rank(path: str, mark: bool):
    import torch.distributed as dist

    rank = dist.get_rank()
    state = {"w": torch.arange(4.0), "rng": torch.Generator().manual_seed(rank).get_state()}
    layouts = {"rng": ck.PerRank()} if mark else None
    try:
        ck.save(path, state, layouts=layouts)
    except ck.CheckpointError as err:
        return str(err)
    like = {"w": torch.zeros(4), "rng": torch.zeros_like(state["rng"])}
    out = ck.load(path, like, layouts=layouts)
    return torch.equal(out["rng"], state["rng"]) and torch.equal(out["w"], state["w"])


def test_replicated_leaves_must_agree_or_be_per_rank(worlds, tmp_path):
    for error in worlds(2).run(_per_rank, str(tmp_path / "a"), False):
        assert "'rng'" in error and "differ between ranks" in error and "PerRank" in error
    assert worlds(2).run(_per_rank, str(tmp_path / "b"), True) == [True, True]


def test_per_rank_leaves_refuse_another_world_size(worlds, tmp_path):
    """A PerRank leaf saved by 2 ranks has no meaning in one process (it used to load rank
    0's value silently): refused naming the leaf; Skip() keeps like's value instead."""
    path = str(tmp_path / "p")
    assert worlds(2).run(_per_rank, path, True) == [True, True]
    like = {"w": torch.zeros(4), "rng": torch.zeros_like(torch.Generator().get_state())}
    with pytest.raises(ValueError, match=r"\['rng'\] are PerRank leaves.*saved by 2 ranks"):
        ck.load(path, like, layouts={"rng": ck.PerRank()})
    out = ck.load(path, like, layouts={"rng": ck.Skip()})
    assert torch.equal(out["w"], torch.arange(4.0)) and torch.equal(out["rng"], like["rng"])


def test_bad_layouts_name_the_leaf(tmp_path):
    mesh = sf.Mesh({"dp": 1})
    with pytest.raises(ValueError, match="leaf 'w'.*local shape"):
        ck.save(str(tmp_path / "c"), {"w": torch.zeros(3)}, mesh,
                {"w": sf.Layout(sf.P("dp"), (4,))})
    with pytest.raises(ValueError, match="leaf 'w'.*axis 'tp'"):
        ck.save(str(tmp_path / "c"), {"w": torch.zeros(3)}, mesh, {"w": sf.P("tp")})
    with pytest.raises(ValueError, match="needs its parameters"):
        ck.save(str(tmp_path / "c"), {"p": {"w": torch.zeros(3)},
                                      "o": optim.adam(1e-3).init({"w": torch.zeros(3)})},
                mesh, {"o": optim.adam(1e-3)})


def _stage_local(path: str):
    """Each rank holds other leaves (as pipeline stages do), under the full tree's names."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = {f"layers.{rank}.w": torch.full((2, 3), float(rank)), "step": 4}
    ck.save(path, mine)
    like = {f"layers.{rank}.w": torch.zeros(2, 3), "step": 0}
    return torch.equal(ck.load(path, like)[f"layers.{rank}.w"], mine[f"layers.{rank}.w"])


def test_leaves_only_some_ranks_hold(worlds, tmp_path):
    path = str(tmp_path / "c")
    assert worlds(2).run(_stage_local, path) == [True, True]
    full = ck.load(path, {"layers.0.w": torch.zeros(2, 3), "layers.1.w": torch.zeros(2, 3),
                          "step": 0})  # one process: every stage's leaves
    assert torch.equal(full["layers.1.w"], torch.ones(2, 3)) and full["step"] == 4
