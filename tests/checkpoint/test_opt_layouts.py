"""Optimizer states follow the layouts of their parameters, however those are given.

Regression: a plain optimizer over sharded parameters whose layouts were a tree of
``sf.Layout`` (not a model object) saved its moments as if replicated and unchecked,
so one rank's shard silently stood for every rank's.
"""

from __future__ import annotations

import torch

import shardfn as sf
import shardfn.checkpoint as ck


def _state(mesh, seed: int):
    """Parameters sharded on dim 0 over dp (uneven: 5 rows), AdamW moments != parameters."""
    full = {"w": torch.arange(15.0).reshape(5, 3) + seed, "b": torch.tensor([1.0, 2.0])}
    specs = {"w": sf.layout_of(full["w"], sf.P("dp")), "b": None}
    params = {"w": sf.shard(full["w"], specs["w"], mesh), "b": full["b"]}
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)
    state = state._replace(mu={k: 3 * v + 1 for k, v in params.items()})
    return {"params": params, "opt": state}, specs, opt, full


def _round_trip(path: str):
    mesh = sf.Mesh({"dp": 2})
    state, specs, opt, full = _state(mesh, 0)
    layouts = {"params": specs, "opt": opt}  # the parameters' layouts as a tree, no model
    ck.save(path, state, mesh, layouts)
    like, *_ = _state(mesh, 100)
    out = ck.load(path, like, mesh, layouts)
    return (sf.gather(out["params"]["w"], specs["w"], mesh),
            sf.gather(out["opt"].mu["w"], specs["w"], mesh), full["w"])


def test_plain_optimizer_follows_a_tree_of_parameter_layouts(worlds, tmp_path):
    for w, mu, full in worlds(2).run(_round_trip, str(tmp_path / "c")):
        torch.testing.assert_close(w, full)
        torch.testing.assert_close(mu, 3 * full + 1)


def _save_without_layouts(path: str):
    mesh = sf.Mesh({"dp": 2})
    state, _, opt, _ = _state(mesh, 0)
    try:
        ck.save(path, state, mesh, {"opt": opt})  # the shards would pass for replicated
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return f"{type(error).__name__}: {error}"
    return None


def test_sharded_moments_without_layouts_are_refused_naming_the_leaf(worlds, tmp_path):
    for text in worlds(2).run(_save_without_layouts, str(tmp_path / "c")):
        assert text is not None and "opt.mu.w" in text and "differ" in text, text


def test_one_process_round_trip_still_works(tmp_path):
    mesh = sf.Mesh({"dp": 1})
    state, specs, opt, full = _state(mesh, 0)
    ck.save(str(tmp_path / "c"), state, mesh, {"params": specs, "opt": opt})
    like, *_ = _state(mesh, 7)
    out = ck.load(str(tmp_path / "c"), like, mesh, {"params": specs, "opt": opt})
    torch.testing.assert_close(out["opt"].mu["w"], 3 * full["w"] + 1)
