"""Checksums checked on the bytes a load reads: each file read once, every file checked.

A 2-rank save with a replicated leaf (written by one rank) and a PerRank leaf
(one per rank) gives two data files; loaded in one process with the PerRank
leaf skipped, one file is read and the other read by no rank (checked in a pass
of its own). Each file, with a byte flipped in its middle or in its first byte
(so its zip records no longer parse), is reported corrupted by name: from one
process, and on every rank of two (where each rank reads and checks its own
file). A clean load reads no file twice: the only whole-file checksum pass is
the small ``.metadata``'s.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardfn.checkpoint as ck


def _state(rank: int):
    return {"w": torch.arange(64.0).reshape(8, 8), "rng": torch.full((16,), float(rank))}


def _like():
    return {"w": torch.zeros(8, 8), "rng": torch.zeros(16)}


def _save(path: str) -> str:
    import torch.distributed as dist

    return ck.save(path, _state(dist.get_rank()), layouts={"rng": ck.PerRank()})


def _load_on_ranks(path: str) -> str:
    import torch.distributed as dist

    try:
        out = ck.load(path, _like(), layouts={"rng": ck.PerRank()})
    except ck.CorruptCheckpointError as err:
        return str(err)
    torch.testing.assert_close(out, _state(dist.get_rank()))
    return "ok"


def _flip(file: str, where: int) -> None:
    raw = bytearray(open(file, "rb").read())
    raw[where] ^= 0x5A
    open(file, "wb").write(bytes(raw))


def test_every_file_is_checked_once_read_or_not(worlds, tmp_path):
    path = worlds(2).run(_save, str(tmp_path / "c"))[0]
    names = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert names == ["__0_0.distcp", "__1_0.distcp"]
    skip = {"rng": ck.Skip()}
    out = ck.load(path, _like(), layouts=skip)  # reads one file; the other is read by no one
    torch.testing.assert_close(out["w"], _state(0)["w"])
    assert worlds(2).run(_load_on_ranks, path) == ["ok", "ok"]
    for name in names + [".metadata"]:
        file = os.path.join(path, name)
        for where in (os.path.getsize(file) // 2, 0):
            _flip(file, where)
            with pytest.raises(ck.CorruptCheckpointError, match=rf"{name}.*corrupted"):
                ck.load(path, _like(), layouts=skip)
            for error in worlds(2).run(_load_on_ranks, path):
                assert name in error and "corrupted" in error, error
            _flip(file, where)
    assert worlds(2).run(_load_on_ranks, path) == ["ok", "ok"]
    assert ck.load(path, _like(), layouts=skip, verify=False)["w"].sum() == 64 * 63 / 2


def test_a_clean_load_makes_no_second_pass(tmp_path, monkeypatch):
    state = {"w": torch.randn(32, 16), "b": torch.randn(5), "step": 3}
    path = ck.save(str(tmp_path / "c"), state, thread_count=2)
    passes = []
    digest = ck._commit.file_digest
    monkeypatch.setattr(ck._commit, "file_digest", lambda p: passes.append(os.path.basename(p))
                        or digest(p))
    out = ck.load(path, {"w": torch.zeros(32, 16), "b": torch.zeros(5), "step": 0})
    torch.testing.assert_close(out, state)
    assert passes == [".metadata"]
    _flip(os.path.join(path, "__0_1.distcp"), 40)
    with pytest.raises(ck.CorruptCheckpointError, match=r"__0_1.distcp.*corrupted"):
        ck.load(path, {"w": torch.zeros(32, 16), "b": torch.zeros(5), "step": 0})
