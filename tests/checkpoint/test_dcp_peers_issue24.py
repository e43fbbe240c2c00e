"""The checkpoint pieces PyTorch DCP has (issue #24): partial loads, dtype casts, compression.

* Partial loads: a subtree of a checkpoint (the parameters of a checkpoint that
  also holds the optimizer state) loads with ``subtree="params"`` or
  ``unexpected="ignore"``, and is refused by default naming the leaves left
  over; leaves of ``like`` that the checkpoint lacks are refused by default
  naming them, and kept from ``like`` with ``missing="keep"``.
* Casts: a stored dtype that differs from ``like``'s is refused naming the leaf
  and both dtypes; ``cast=True`` casts (float32 into bfloat16 and back), never
  floating into integer.
* Compression: ``save(..., compression="gzip")`` writes smaller files for a
  compressible tree, ``load`` detects it (and DCP's own reader reads it), a
  damaged compressed file is reported by name, ``"zstd"`` round-trips where a
  zstd package is installed and is refused naming it where not.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.checkpoint._compress import decode, registry, zstd_available


class MLP(nn.Module):
    """Uneven widths (5 -> 7 -> 3): ZeRO-3 shards over 2 ranks are padded."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _bf16(tree):
    return sf.pytree.tree_map(lambda x: x.to(torch.bfloat16), tree)


def _train_save_and_load_parts(path: str):
    """Every rank: train ZeRO-3 + AdamW 2 steps, save params + opt (raw and gzip), then
    load the parameters alone in three ways, and in bfloat16; returns what to check."""
    mesh = sf.Mesh({"dp": 2})
    model = sf.shard_params(sf.functional(MLP()), mesh, "dp")
    opt = sf.optim.adamw(1e-2)
    params = model.init(0)
    opt_state = opt.init(params)
    for step in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step + 10 * mesh.rank))
        grads = torch.func.grad(lambda p, x=x: model.apply(p, x).square().mean())(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = sf.optim.apply_updates(params, updates)
    layouts = {"params": model, "opt": opt}
    state = {"params": params, "opt": opt_state, "step": 2}
    raw = ck.save(path + "/raw", state, mesh, layouts)
    ck.save(path + "/gzip", state, mesh, layouts, compression="gzip")
    saved = sf.gather(params, model.specs, mesh)

    def full(p):
        return sf.gather(p, model.specs, mesh)

    out = {"saved": saved}
    # DCP test_e2e_save_and_load.py::test_partial_load: {"model"} of {"model", "optimizer"}
    out["ignore"] = full(ck.load(raw, {"params": model.init(1)}, mesh, {"params": model},
                                 unexpected="ignore")["params"])
    # ... and its `_load_state_dict_from_keys("model")`: the subtree alone
    out["subtree"] = full(ck.load(raw, model.init(1), mesh, model, subtree="params"))
    out["gzip"] = full(ck.load(path + "/gzip", model.init(1), mesh, model, subtree="params"))
    try:
        ck.load(raw, {"params": model.init(1)}, mesh, {"params": model})
        out["strict"] = "loaded"
    except ck.CheckpointMismatchError as err:
        out["strict"] = str(err)
    like16 = _bf16(model.init(1))
    try:
        ck.load(raw, like16, mesh, model, subtree="params")
        out["no_cast"] = "loaded"
    except ck.CheckpointMismatchError as err:
        out["no_cast"] = str(err)
    loaded16 = ck.load(raw, like16, mesh, model, subtree="params", cast=True)
    out["cast_dtypes"] = {v.dtype for v in loaded16.values()}
    out["cast"] = full(loaded16)
    return out


def test_partial_subtree_and_cast_loads_on_two_ranks(worlds, tmp_path):
    """A ZeRO-3 + AdamW checkpoint of 2 ranks: its parameters alone load on 2 ranks
    (``unexpected="ignore"`` and ``subtree="params"``, as DCP's
    ``test_e2e_save_and_load.py::test_partial_load`` loads ``{"model"}`` of a checkpoint
    of ``{"model", "optimizer"}`` and via ``_load_state_dict_from_keys("model")``), from a
    gzip checkpoint too, and in one process; strict loads name what is left over; a
    float32 checkpoint into bfloat16 leaves is refused naming both dtypes, and cast with
    ``cast=True``."""
    path = str(tmp_path)
    out = worlds(2).run(_train_save_and_load_parts, path)
    for rank in out:
        saved = rank["saved"]
        assert any(not torch.equal(v, sf.functional(MLP()).init(0)[k]) for k, v in saved.items())
        for way in ("ignore", "subtree", "gzip"):
            for name in saved:
                assert torch.equal(rank[way][name], saved[name]), (way, name)
        assert "unexpected (in the checkpoint, not in like)" in rank["strict"]
        assert "'opt.mu.fc1.weight'" in rank["strict"] and "'step'" in rank["strict"]
        assert "'params.fc1.weight': dtype torch.float32 in the checkpoint, torch.bfloat16 " \
               "in like" in rank["no_cast"]
        assert rank["cast_dtypes"] == {torch.bfloat16}
        for name in saved:
            assert torch.equal(rank["cast"][name], saved[name].to(torch.bfloat16)), name
    saved = out[0]["saved"]
    fmodel = sf.functional(MLP())  # ZeRO-3 on 2 ranks -> the subtree in one process, no mesh
    for where in ("raw", "gzip"):
        one = ck.load(f"{path}/{where}", fmodel.init(1), subtree="params")
        for name in saved:
            assert torch.equal(one[name], saved[name]), (where, name)
    with pytest.raises(ck.CheckpointMismatchError, match=r"'params\.fc9\.weight'"):
        ck.load(f"{path}/raw", {**fmodel.init(1), "fc9.weight": torch.zeros(2)},
                subtree="params")
    with pytest.raises(ValueError, match="subtree='params.'"):
        ck.load(f"{path}/raw", fmodel.init(1), subtree="params.")


def test_missing_leaves_refused_or_kept_from_like(tmp_path):
    """DCP ``test_planner.py::TestLoadPlanner::test_strict``: a module saved, then loaded
    into one with an extra parameter: refused by default naming it (DCP: "Missing key in
    checkpoint"), loaded with the extra leaf kept from ``like`` when asked (DCP:
    ``DefaultLoadPlanner(allow_partial_load=True)``)."""
    module = nn.Linear(2, 2)
    path = ck.save(str(tmp_path / "c"), {"module": dict(module.state_dict()), "step": 7})
    extra = torch.randn(2, 2)
    like = {"module": {"weight": torch.zeros(2, 2), "bias": torch.zeros(2),
                       "extra_param": extra}, "step": 0}
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"missing \(in like, not in the checkpoint\): "
                             r"\['module\.extra_param'\]"):
        ck.load(path, like)
    out = ck.load(path, like, missing="keep")
    assert out["module"]["extra_param"] is extra  # like's own value
    assert torch.equal(out["module"]["weight"], module.weight.detach())
    assert torch.equal(out["module"]["bias"], module.bias.detach()) and out["step"] == 7
    with pytest.raises(ValueError, match="missing='kept'"):
        ck.load(path, like, missing="kept")
    # kept leaves are not read; everything else still has to fit (a shape is still refused)
    bad = {**like, "module": {**like["module"], "bias": torch.zeros(3)}}
    with pytest.raises(ck.CheckpointMismatchError, match=r"'module\.bias': shape \(2,\)"):
        ck.load(path, bad, missing="keep")


def test_casts_bfloat16_into_float32_only_when_asked(tmp_path):
    """The reverse cast (a bfloat16 checkpoint into float32 leaves) and its refusal; an
    integer into floating leaf casts, a floating into an integer one never does."""
    torch.manual_seed(0)
    state = {"w": torch.randn(4, 3).to(torch.bfloat16), "count": torch.tensor(3)}
    path = ck.save(str(tmp_path / "c"), state)
    like = {"w": torch.zeros(4, 3), "count": torch.tensor(0.0)}
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.load(path, like)
    assert "'w': dtype torch.bfloat16 in the checkpoint, torch.float32 in like" in str(info.value)
    assert "'count': dtype torch.int64 in the checkpoint, torch.float32 in like" in \
        str(info.value)
    out = ck.load(path, like, cast=True)
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], state["w"].float())
    assert out["count"].dtype == torch.float32 and out["count"].item() == 3.0
    with pytest.raises(ck.CheckpointMismatchError,
                       match=r"'w': dtype torch\.bfloat16 in the checkpoint, torch\.int32 .*"
                             r"torch\.can_cast"):
        ck.load(path, {"w": torch.zeros(4, 3, dtype=torch.int32), "count": torch.tensor(0)},
                cast=True)


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_gzip_round_trip_smaller_files_and_dcp_reads_it(tmp_path):
    """DCP ``test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoadZStandard
    ::test_read_write_only_tensor`` with shardfn's gzip: a module's state dict and a blob
    round-trip; the files of a compressible tree are much smaller than raw ones; DCP's
    own reader loads them with shardfn's extension registry; a flipped byte is reported
    (also with ``verify=False``: the gzip trailer's CRC)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {"module": dict(nn.Linear(5, 5).state_dict()), "blob": b"SomeBlobForTesting",
             "zeros": torch.zeros(256, 256), "step": 3}
    raw = ck.save(str(tmp_path / "raw"), state)
    packed = ck.save(str(tmp_path / "gzip"), state, compression="gzip")
    assert _size(packed) < _size(raw) / 10
    like = {"module": {"weight": torch.zeros(5, 5), "bias": torch.zeros(5)}, "blob": b"",
            "zeros": torch.ones(256, 256), "step": 0}
    out = ck.load(packed, like)
    assert out["blob"] == b"SomeBlobForTesting" and out["step"] == 3
    for name, value in state["module"].items():
        assert torch.equal(out["module"][name], value), name
    assert torch.equal(out["zeros"], state["zeros"])
    plain = {"module.weight": torch.zeros(5, 5), "zeros": torch.ones(256, 256)}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(packed, _extension_registry=registry()),
             no_dist=True)
    assert torch.equal(plain["module.weight"], state["module"]["weight"])
    assert torch.equal(plain["zeros"], state["zeros"])
    (data,) = [f for f in os.listdir(packed) if f.endswith(".distcp")]
    damaged = bytearray((tmp_path / "gzip" / data).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (tmp_path / "gzip" / data).write_bytes(bytes(damaged))
    for verify in (True, False):
        with pytest.raises(ck.CorruptCheckpointError, match=data):
            ck.load(packed, like, verify=verify)


def test_zstd_where_installed_and_bad_codecs(tmp_path):
    """``"zstd"`` (torch's own DCP transform) round-trips where ``zstandard`` or
    ``pyzstd`` is installed, else is refused naming them; an unknown codec is refused;
    a compressed tensor item that would decompress past its own size is refused."""
    state = {"zeros": torch.zeros(64, 64), "step": 1}
    if zstd_available():
        path = ck.save(str(tmp_path / "z"), state, compression="zstd")
        out = ck.load(path, {"zeros": torch.ones(64, 64), "step": 0})
        assert torch.equal(out["zeros"], state["zeros"]) and out["step"] == 1
    else:
        with pytest.raises(ValueError, match="'zstandard' or 'pyzstd'"):
            ck.save(str(tmp_path / "z"), state, compression="zstd")
    with pytest.raises(ValueError, match=r"compression='lz4'; use one of \['gzip', 'zstd'\]"):
        ck.save(str(tmp_path / "l"), state, compression="lz4")
    from zlib_ng import zlib_ng

    pack = zlib_ng.compressobj(3, zlib_ng.DEFLATED, 31)
    bomb = memoryview(pack.compress(bytes(1 << 20)) + pack.flush())
    assert len(decode(["stream.gzip@shardfn/1"], bomb, 1 << 20, "x")) == 1 << 20
    with pytest.raises(ck.CorruptCheckpointError, match="more than 1000 bytes"):
        decode(["stream.gzip@shardfn/1"], bomb, 1000, "x")
    with pytest.raises(ck.CheckpointError, match=r"\['stream\.rot13/1'\]"):
        decode(["stream.rot13/1"], bomb, None, "x")
