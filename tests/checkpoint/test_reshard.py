"""Save on one mesh, load on another: ZeRO-3, ZeRO-1, data parallel and tensor parallel states.

Every case saves a full training state (parameters of uneven shapes, so shards
are padded; AdamW's moments and count; a step; a string) laid out one way on
one world size, loads it laid out another way on another world size (or in the
test process, with no process group), gathers what was loaded with the target
layout's own gather, and compares with the reference full state the save
started from. The moments differ from the parameters (``2p + 1``, ``p * p``), so
a moment loaded into the wrong leaf or the wrong place fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.optim.adam import AdamState


class MLP(nn.Module):
    """Uneven widths: 5 -> 7 -> 3 (padded when split over 2, 3 or 4 ranks)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def reference():
    """The full state every case starts from: params, AdamW moments, count."""
    torch.manual_seed(0)
    full = sf.functional(MLP()).init(0)
    mu = {k: 2 * v + 1 for k, v in full.items()}
    nu = {k: v * v for k, v in full.items()}
    return full, AdamState(torch.tensor(3, dtype=torch.int64), mu, nu)


def build(kind: str, world: int, zero: bool):
    """``(state, layouts, mesh, gather)`` for layout ``kind`` on ``world`` ranks; ``zero``: a
    state of zeros (a ``like`` to load into), else the reference state."""
    full, inner = reference()
    if zero:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
        inner = AdamState(torch.tensor(0), *({k: torch.zeros_like(v) for k, v in t.items()}
                                             for t in (inner.mu, inner.nu)))
    mesh = sf.Mesh({"dp": world // 2, "rep": 2} if kind == "hsdp" else {"dp": world})
    opt = sf.optim.adamw(1e-2)
    fmodel = sf.functional(MLP())
    if kind in ("zero3", "hsdp"):  # HSDP: shards over dp, replicated over rep
        model = sf.shard_params(fmodel, mesh, "dp",
                                replicate_axis="rep" if kind == "hsdp" else None)
        params = model.shard(full)
        state = AdamState(inner.count, model.shard(inner.mu), model.shard(inner.nu))
        layouts = {"params": model, "opt": opt}

        def gather(s):
            o = s["opt"]
            return (sf.gather(s["params"], model.specs, mesh), o.count,
                    sf.gather(o.mu, model.specs, mesh), sf.gather(o.nu, model.specs, mesh))
    elif kind == "zero1":
        sharded = sf.shard_opt_state(opt, mesh, "dp", bucket_bytes=64)  # pieces span leaves
        params = full
        state = sharded.shard_state(inner, params)
        layouts = {"opt": sharded}

        def gather(s):
            o = sharded.gather_state(s["opt"], s["params"])
            return s["params"], o.count, o.mu, o.nu
    elif kind == "dp":
        params, state, layouts = full, inner, None

        def gather(s):
            return s["params"], s["opt"].count, s["opt"].mu, s["opt"].nu
    else:
        raise ValueError(kind)
    return {"params": params, "opt": state, "step": 3, "tag": "run-a"}, layouts, mesh, gather


def _save(path, kind):
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    state, layouts, mesh, _ = build(kind, world, zero=False)
    return ck.save(path, state, mesh, layouts)


def _load(path, kind):
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    like, layouts, mesh, gather = build(kind, world, zero=True)
    out = ck.load(path, like, mesh, layouts)
    params, count, mu, nu = gather(out)
    return params, count, mu, nu, out["step"], out["tag"]


def _run(worlds, world: int, fn, *args):
    return worlds(world).run(fn, *args)[0] if world > 1 else fn(*args)


def _check(got) -> None:
    full, inner = reference()
    params, count, mu, nu, step, tag = got
    torch.testing.assert_close(params, full)
    torch.testing.assert_close(mu, inner.mu)
    torch.testing.assert_close(nu, inner.nu)
    assert int(count) == 3 and step == 3 and tag == "run-a"


# (kind, world) saved -> (kind, world) loaded: world size and sharding both change
CASES = [
    (("zero3", 4), ("zero3", 2)),
    (("zero3", 2), ("dp", 1)),
    (("dp", 1), ("zero3", 4)),
    (("zero3", 2), ("zero1", 3)),
    (("zero1", 3), ("zero3", 2)),
    (("zero1", 4), ("zero1", 2)),
    (("zero3", 4), ("hsdp", 4)),
    (("hsdp", 4), ("zero1", 2)),
]


@pytest.mark.parametrize("saved,loaded", CASES, ids=[f"{a[0]}{a[1]}-{b[0]}{b[1]}"
                                                     for a, b in CASES])
def test_reshard(worlds, tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    assert _run(worlds, saved[1], _save, path, saved[0]) == path
    _check(_run(worlds, loaded[1], _load, path, loaded[0]))


def test_plain_dcp_reads_the_full_tensors(worlds, tmp_path):
    """The checkpoint is a DCP checkpoint: DCP alone, in one process, gives the full tensors
    (padding cut off) under the unsharded optimizer's names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "ckpt")
    worlds(3).run(_save, path, "zero1")
    full, inner = reference()
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=True)
    assert sorted(saved) == sorted(["step", "tag", "opt.count"] +
                                   [f"params.{k}" for k in full] +
                                   [f"opt.{m}.{k}" for m in ("mu", "nu") for k in full])
    for k in full:
        assert torch.equal(saved[f"params.{k}"], full[k])
        assert torch.equal(saved[f"opt.mu.{k}"], inner.mu[k])
    zero3 = str(tmp_path / "zero3")
    worlds(4).run(_save, zero3, "zero3")
    into = {f"opt.nu.{k}": torch.empty_like(v) for k, v in full.items()}
    dcp.load(into, checkpoint_id=zero3, no_dist=True)
    for k in full:
        assert torch.equal(into[f"opt.nu.{k}"], inner.nu[k])


def _gpt():
    from shardfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    return sf.functional(GPT(GPTConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2,
                                       seq_len=8, dropout=0.0)))


def _tp_state(zero: bool):
    """Tensor parallel over 2 ranks (fused qkv, vocab-split embedding), AdamW over the local
    shards; returns the state, layouts and the full params and moments it holds."""
    from shardfn.models import gpt_tp_plan

    tp = sf.tensor_split(_gpt(), sf.Mesh({"tp": 2}), "tp", gpt_tp_plan())
    params = tp.init(0)
    if zero:
        params = {k: torch.zeros_like(v) for k, v in params.items()}
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)
    state = state._replace(mu={k: 2 * v + 1 for k, v in params.items()}, count=torch.tensor(4))
    return ({"params": params, "opt": state}, {"params": tp, "opt": opt},
            (tp.gather_params(params), tp.gather_params(state.mu)))


def _tp_save(path):
    state, layouts, full = _tp_state(zero=False)
    ck.save(path, state, sf.Mesh({"tp": 2}), layouts)
    return full


def _tp_load(path):
    like, layouts, _ = _tp_state(zero=True)
    out = ck.load(path, like, sf.Mesh({"tp": 2}), layouts)
    tp = layouts["params"]
    return tp.gather_params(out["params"]), tp.gather_params(out["opt"].mu)


def test_tensor_split_to_one_process_and_back(worlds, tmp_path):
    path = str(tmp_path / "tp")
    full_params, full_mu = worlds(2).run(_tp_save, path)[0]
    assert any(isinstance(s, sf.FusedLayout) for s in
               _tp_layout_kinds())  # the case covers a fused leaf
    like_params = {k: torch.zeros_like(v) for k, v in full_params.items()}
    like = {"params": like_params, "opt": sf.optim.adamw(1e-2).init(like_params)}
    out = ck.load(path, like)  # one process, plain full tensors
    torch.testing.assert_close(out["params"], full_params)
    torch.testing.assert_close(out["opt"].mu, full_mu)
    assert int(out["opt"].count) == 4
    back = str(tmp_path / "back")
    ck.save(back, out)
    got_params, got_mu = worlds(2).run(_tp_load, back)[1]
    torch.testing.assert_close(got_params, full_params)
    torch.testing.assert_close(got_mu, full_mu)


def _tp_layout_kinds():
    from shardfn.models import gpt_tp_plan

    return list(sf.tensor_split(_gpt(), sf.Mesh({"tp": 1}), "tp", gpt_tp_plan()).specs.values())


def _zero1_opt(name: str, mesh):
    from shardfn import optim

    odd = lambda t: sf.pytree.tree_map_with_path(lambda n, x: "weight" in n, t)  # noqa: E731
    labels = lambda t: sf.pytree.tree_map_with_path(  # noqa: E731
        lambda n, x: "a" if "weight" in n else "b", t)
    inner = {
        "masked": lambda: optim.masked(optim.adamw(1e-2, weight_decay=0.1), odd),
        "multi": lambda: optim.multi_transform({"a": optim.sgd(0.1, momentum=0.9),
                                                "b": optim.adam(1e-3)}, labels),
        "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)),
    }[name]()
    return sf.shard_opt_state(inner, mesh, "dp", bucket_bytes=48)


def _zero1_round(path: str, name: str, save: bool):
    """Save after two real updates (save=True) or load into a fresh state; return the
    gathered full inner state."""
    import torch.distributed as dist

    mesh = sf.Mesh({"dp": dist.get_world_size()})
    full, _ = reference()
    opt = _zero1_opt(name, mesh)
    state = opt.init(full)
    if save:
        for i in range(2):
            grads = {k: torch.cos(v * (i + 1 + dist.get_rank())) for k, v in full.items()}
            _, state = opt.update(grads, state, full)
        ck.save(path, {"params": full, "opt": state}, mesh, {"opt": opt})
    else:
        state = ck.load(path, {"params": full, "opt": state}, mesh, {"opt": opt})["opt"]
    return sf.pytree.tree_leaves(opt.gather_state(state, full))


@pytest.mark.parametrize("name", ["masked", "multi", "chain"])
def test_zero1_optimizer_combinations_reshard(worlds, tmp_path, name):
    path = str(tmp_path / name)
    saved = worlds(2).run(_zero1_round, path, name, True)[0]
    loaded = worlds(3).run(_zero1_round, path, name, False)[0]
    assert len(saved) == len(loaded) > 2
    for a, b in zip(saved, loaded, strict=True):
        assert torch.equal(a, b)
    assert any(x.dim() > 0 and x.abs().sum() > 0 for x in loaded)  # real moments moved


def _gpt_zero3_save(path):
    mesh = sf.Mesh({"dp": 4})
    model = sf.shard_params(_gpt(), mesh, "dp")
    params = model.init(0)
    ck.save(path, {"params": params}, mesh, {"params": model})
    return sf.gather(params, model.specs, mesh)


def _gpt_dp_tp_load(path):
    from shardfn.models import gpt_tp_plan

    mesh = sf.Mesh({"dp": 2, "tp": 2})
    tp = sf.tensor_split(_gpt(), mesh, "tp", gpt_tp_plan())
    like = {"params": {k: torch.zeros_like(v) for k, v in tp.init(1).items()}}
    return tp.gather_params(ck.load(path, like, mesh, {"params": tp})["params"])


def test_zero3_on_4_ranks_into_dp_x_tp(worlds, tmp_path):
    """The issue's example: ZeRO-3 over 4 ranks into tensor parallel on a 2x2 dp x tp mesh."""
    path = str(tmp_path / "gpt")
    full = worlds(4).run(_gpt_zero3_save, path)[0]
    for got in worlds(4).run(_gpt_dp_tp_load, path):
        torch.testing.assert_close(got, full)


def _fsdp_tp(mesh):
    from shardfn.models import gpt_tp_plan
    from shardfn.models.gpt import Block

    tp = sf.tensor_split(_gpt(), mesh, "tp", gpt_tp_plan())
    return sf.shard_params(tp, mesh, "dp", units=Block)


def _fsdp_tp_save(path):
    """FSDP x TP on {dp: 2, tp: 2}: every leaf a dp block of a tp shard (fused qkv too)."""
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    model = _fsdp_tp(mesh)
    params = model.init(0)
    opt = sf.optim.adamw(1e-2)
    state = opt.init(params)
    state = state._replace(mu={k: 2 * v + 1 for k, v in params.items()}, count=torch.tensor(3))
    ck.save(path, {"params": params, "opt": state}, mesh, {"params": model, "opt": opt})
    return model.gather_params(params), model.gather_params(state.mu)


def _fsdp_tp_load(path, axes):
    mesh = sf.Mesh(axes)
    model = _fsdp_tp(mesh)
    params = {k: torch.zeros_like(v) for k, v in model.init(1).items()}
    opt = sf.optim.adamw(1e-2)
    out = ck.load(path, {"params": params, "opt": opt.init(params)}, mesh,
                  {"params": model, "opt": opt})
    return model.gather_params(out["params"]), model.gather_params(out["opt"].mu)


def test_fsdp_x_tp_saves_both_splits_and_reshards(worlds, tmp_path):
    """The 2-D layout (FsdpTpLayout: dp rows of a tp shard, padding outside) is stored as
    global tensors: it loads into one process, into FSDP x TP on {dp: 1, tp: 2} and back
    into {dp: 2, tp: 2}."""
    path = str(tmp_path / "fsdp_tp")
    full_params, full_mu = worlds(4).run(_fsdp_tp_save, path)[0]
    like_params = {k: torch.zeros_like(v) for k, v in full_params.items()}
    out = ck.load(path, {"params": like_params, "opt": sf.optim.adamw(1e-2).init(like_params)})
    torch.testing.assert_close(out["params"], full_params)
    torch.testing.assert_close(out["opt"].mu, full_mu)
    for n, axes in ((2, {"dp": 1, "tp": 2}), (4, {"dp": 2, "tp": 2})):
        for got_params, got_mu in worlds(n).run(_fsdp_tp_load, path, axes):
            torch.testing.assert_close(got_params, full_params)
            torch.testing.assert_close(got_mu, full_mu)


def test_row_split_boxes_cover_each_row_once():
    from shardfn.checkpoint._boxes import Box, row_split_boxes

    parts = [Box((0, 0), (2, 0), (3, 4)), Box((3, 0), (9, 0), (3, 4))]  # a fused tp shard
    for ranks in (1, 2, 4, 5):
        rows = []
        for i in range(ranks):
            for b in row_split_boxes(parts, 6, ranks, i):
                assert b.local_start[0] + b.sizes[0] <= -(-6 // ranks)
                rows += list(range(b.global_offset[0], b.global_offset[0] + b.sizes[0]))
        assert sorted(rows) == [2, 3, 4, 9, 10, 11]
