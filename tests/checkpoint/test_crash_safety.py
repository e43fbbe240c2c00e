"""Crash safety: a save that fails or is killed leaves the previous checkpoint loadable.

A test hook raises between two files on one rank (the other ranks get an error
too, none hangs); a real SIGKILL ends one rank in the middle of its writes (the
local world respawns). Both times the previous checkpoint still loads and the
partial one is reported incomplete. A flipped byte and a truncated file are
found on load, naming the file. ``keep_last`` keeps the newest checkpoints and
removes partial ones; ``latest`` skips incomplete ones.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardfn.checkpoint as ck
from shardfn.testing import RankError


def _state(step: int):
    torch.manual_seed(step)
    return {"w": torch.randn(6, 4), "b": torch.randn(9), "step": step}


def _like():
    return {"w": torch.zeros(6, 4), "b": torch.zeros(9), "step": 0}


def _save_steps(directory: str, steps, keep_last=None):
    out = []
    for s in steps:
        out.append(ck.save(directory, _state(s), step=s, keep_last=keep_last, thread_count=2))
    return out


def _failing_save(directory: str, how: str):
    """Step 2 on every rank; rank 1 fails before its second file ("raise" or "kill")."""
    import signal

    import torch.distributed as dist

    def hook(event, **info):
        if event == "write_file" and dist.get_rank() == 1 and info["name"] == "__1_1.distcp":
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError("injected: disk full")

    with ck._hooks.installed(hook):
        try:
            ck.save(directory, _state(2), step=2, thread_count=2)
        except ck.CheckpointError as err:
            return str(err)
    return "no error"


def _check_previous_loads_and_partial_is_incomplete(directory: str,
                                                    partial_left: bool | None) -> None:
    newest = ck.latest(directory)
    assert newest == os.path.join(directory, "step_000001")
    out = ck.load(newest, _like())
    torch.testing.assert_close(out, _state(1))
    assert ck.load(directory, _like())["step"] == 1  # a directory: its newest complete one
    partial = [p for p in os.listdir(directory) if p.startswith("step_000002.tmp-")]
    killed = partial_left is None  # the others remove it if they see the rank die first
    partial_left = bool(partial) if killed else partial_left
    if not partial_left:  # a save that failed (not killed): every rank removed its files
        assert partial == [], os.listdir(directory)
        with pytest.raises(ck.IncompleteCheckpointError, match="incomplete"):
            ck.load(os.path.join(directory, "step_000002"), _like())
        return
    assert len(partial) == 1, os.listdir(directory)
    assert killed or sorted(os.listdir(os.path.join(directory, partial[0]))) != []
    with pytest.raises(ck.IncompleteCheckpointError, match="incomplete"):
        ck.load(os.path.join(directory, partial[0]), _like())
    with pytest.raises(ck.IncompleteCheckpointError, match="step_000002.tmp-"):
        ck.load(os.path.join(directory, "step_000002"), _like())


def test_hook_raises_between_files_on_one_rank(worlds, tmp_path):
    directory = str(tmp_path / "run")
    worlds(2).run(_save_steps, directory, [1])
    errors = worlds(2).run(_failing_save, directory, "raise")
    for error in errors:  # both ranks got an error (none hangs), naming the rank and cause
        assert "rank 1" in error and "injected: disk full" in error, error
    _check_previous_loads_and_partial_is_incomplete(directory, partial_left=False)
    # the next save with keep_last removes the partial one
    worlds(2).run(_save_steps, directory, [3], 5)
    assert sorted(os.listdir(directory)) == ["step_000001", "step_000003"]


def test_rank_killed_mid_save(worlds, tmp_path):
    directory = str(tmp_path / "run")
    worlds(2).run(_save_steps, directory, [1])
    with pytest.raises(RankError, match="rank 1 is dead"):
        worlds(2).run(_failing_save, directory, "kill")
    _check_previous_loads_and_partial_is_incomplete(directory, partial_left=None)
    assert worlds(2).run(lambda: 1) == [1, 1]  # the world was respawned


def _data_file(path: str) -> str:
    return os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0])


def _load_error(path: str) -> str:
    try:
        ck.load(path, _like())
    except ck.CorruptCheckpointError as err:
        return str(err)
    return "no error"


def test_flipped_byte_and_truncated_file_are_reported(worlds, tmp_path):
    path = ck.save(str(tmp_path / "ckpt"), _state(1))
    ck.load(path, _like())
    data = _data_file(path)
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(data, "wb").write(bytes(raw))
    with pytest.raises(ck.CorruptCheckpointError, match=r"__0_0.distcp.*corrupted"):
        ck.load(path, _like())
    for error in worlds(2).run(_load_error, path):  # any rank may check it: all report it
        assert "__0_0.distcp" in error and "corrupted" in error, error
    raw[len(raw) // 2] ^= 0x01
    open(data, "wb").write(bytes(raw[:-7]))
    with pytest.raises(ck.CorruptCheckpointError, match=r"__0_0.distcp.*truncated"):
        ck.load(path, _like())
    os.remove(data)
    with pytest.raises(ck.CorruptCheckpointError, match=r"__0_0.distcp.*missing"):
        ck.load(path, _like())


def test_keep_last_and_latest(tmp_path):
    directory = str(tmp_path / "run")
    assert ck.latest(directory) is None
    _save_steps(directory, [1, 2, 5, 10, 100], keep_last=3)
    assert sorted(os.listdir(directory)) == ["step_000005", "step_000010", "step_000100"]
    assert ck.latest(directory) == os.path.join(directory, "step_000100")
    os.remove(os.path.join(directory, "step_000100", ck._commit.MARKER))  # now incomplete
    assert ck.latest(directory) == os.path.join(directory, "step_000010")
    with pytest.raises(FileExistsError, match="already exists"):
        ck.save(directory, _state(10), step=10)
    ck.save(directory, _state(11), step=10, overwrite=True)
    assert ck.load(ck.latest(directory), _like())["step"] == 11
    with pytest.raises(ValueError, match="keep_last"):
        ck.save(directory, _state(1), keep_last=2)
