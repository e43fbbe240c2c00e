"""Checkpoint safety (issue #22): no code run from files, a full disk, malformed markers, modes.

* A ``.metadata`` crafted to run a command when unpickled (``__reduce__`` to
  ``os.system`` / ``builtins.exec``), with a commit marker that matches it: DCP's own
  reader runs it (shown first, so the payload is real); ``sf.checkpoint.load`` with
  ``verify=True`` and ``verify=False``, in one process and on 2 ranks, refuses it
  naming the file and the global, and the payload's marker file is never written.
  Likewise an object leaf's stored bytes replaced by a pickled payload.
* A full disk (a 1 MiB tmpfs): a 2-rank save fails on every rank with a
  ``CheckpointError`` naming ENOSPC and the path, leaves no ``.tmp-`` directory, and
  the next save works (a 16-byte one at once, a large one once space is freed) with
  ``keep_last=1``; an async save likewise.
* A commit marker without ``"files"`` and a truncated ``.metadata`` under
  ``verify=False`` raise a ``CheckpointError`` naming the file (and the key).
* ``save(mode=0o600)`` makes every file 0600 and directory 0700; the default follows
  the umask.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import uuid
import zlib

import pytest
import torch

import shardfn.checkpoint as ck


def _state(rank: int = 0):
    return {"w": torch.arange(24.0).reshape(4, 6), "step": 7, "rng": torch.full((3,), rank)}


def _like():
    return {"w": torch.zeros(4, 6), "step": 0, "rng": torch.zeros(3, dtype=torch.int64)}


class _Payload:
    """Unpickling it runs ``fn(arg)``; pickling it only records that call."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def _craft(path: str, metadata, payload) -> None:
    """Replace ``.metadata`` with ``payload`` pickled inside real ``metadata``, and give
    the commit marker the matching size and checksum (what an attacker writes too)."""
    metadata.planner_data = payload
    raw = pickle.dumps(metadata)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(raw)
    marker = os.path.join(path, ck._commit.MARKER)
    manifest = json.load(open(marker))
    manifest["files"][".metadata"] = [len(raw), zlib.crc32(raw)]
    json.dump(manifest, open(marker, "w"))


def _payloads(flag: str):
    return [_Payload(os.system, f"touch {flag}"),
            _Payload(exec, f"open({flag!r}, 'w').write('ran')")]


def _load_error(path: str, verify: bool) -> str:
    try:
        ck.load(path, _like(), verify=verify)
    except ck.CheckpointError as err:
        return str(err)
    return "no error"


def test_crafted_metadata_runs_no_code(worlds, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path = ck.save(str(tmp_path / "c"), _state())
    clean = open(os.path.join(path, ".metadata"), "rb").read()
    metadata = ck._dcp.Reader(path).read_metadata()
    for payload, where in zip(_payloads(str(tmp_path / "ran")), ("posix.system", "exec"),
                              strict=True):
        _craft(path, metadata, payload)
        FileSystemReader(path).read_metadata()  # DCP's pickle.load: the payload is real
        assert (tmp_path / "ran").exists()
        os.remove(tmp_path / "ran")
        for verify in (True, False):
            with pytest.raises(ck.CorruptCheckpointError, match=rf"'\.metadata' names "
                               rf"\S*{where}.*refused") as info:
                ck.load(path, _like(), verify=verify)
            assert path in str(info.value)
            assert not (tmp_path / "ran").exists()
            for error in worlds(2).run(_load_error, path, verify):
                assert ".metadata" in error and where in error and "refused" in error, error
            assert not (tmp_path / "ran").exists()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(clean)
    _fix_marker(path, ".metadata")
    torch.testing.assert_close(ck.load(path, _like()), _state())


def test_crafted_object_item_runs_no_code(tmp_path):
    """An object leaf's stored bytes replaced by a ``torch.save`` of a payload, in a new
    data file the metadata and the marker both point to: read with ``weights_only``."""
    import dataclasses
    import io

    path = ck.save(str(tmp_path / "c"), {"n": 5, "w": torch.ones(2)})
    flag = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(_Payload(os.system, f"touch {flag}"), buffer)
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # the payload is real
    assert flag.exists()
    os.remove(flag)
    open(os.path.join(path, "__9_0.distcp"), "wb").write(buffer.getvalue())
    metadata = ck._dcp.Reader(path).read_metadata()
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == "n":
            metadata.storage_data[index] = dataclasses.replace(
                info, relative_path="__9_0.distcp", offset=0, length=len(buffer.getvalue()))
    open(os.path.join(path, ".metadata"), "wb").write(pickle.dumps(metadata))
    _fix_marker(path, ".metadata")
    _fix_marker(path, "__9_0.distcp")
    for verify in (True, False):
        with pytest.raises(ck.CorruptCheckpointError, match=r"(?s)'__9_0\.distcp'.*posix.system"):
            ck.load(path, {"n": 0, "w": torch.zeros(2)}, verify=verify)
        assert not flag.exists()


def _fix_marker(path: str, name: str) -> None:
    marker = os.path.join(path, ck._commit.MARKER)
    manifest = json.load(open(marker))
    raw = open(os.path.join(path, name), "rb").read()
    manifest["files"][name] = [len(raw), zlib.crc32(raw)]
    json.dump(manifest, open(marker, "w"))


def test_marker_without_files_and_truncated_metadata(tmp_path):
    path = ck.save(str(tmp_path / "c"), _state())
    marker = os.path.join(path, ck._commit.MARKER)
    good = open(marker).read()
    manifest = json.loads(good)
    del manifest["files"]
    json.dump(manifest, open(marker, "w"))
    for verify in (True, False):
        with pytest.raises(ck.CorruptCheckpointError,
                           match=r"\.shardfn_commit.*no 'files' key"):
            ck.load(path, _like(), verify=verify)
    open(marker, "w").write(good)
    metadata = os.path.join(path, ".metadata")
    raw = open(metadata, "rb").read()
    for cut in (len(raw) // 2, 1, 0):
        open(metadata, "wb").write(raw[:cut])
        with pytest.raises(ck.CorruptCheckpointError, match=r"'\.metadata' is not valid DCP "
                           r"metadata \(truncated"):
            ck.load(path, _like(), verify=False)
        with pytest.raises(ck.CorruptCheckpointError, match=r"'\.metadata' is truncated"):
            ck.load(path, _like())
    open(metadata, "wb").write(raw)
    torch.testing.assert_close(ck.load(path, _like(), verify=False), _state())


def _modes(root: str) -> dict[str, int]:
    out = {}
    for directory, _, files in os.walk(root):
        for name in [directory, *(os.path.join(directory, f) for f in files)]:
            out[os.path.relpath(name, root)] = stat.S_IMODE(os.stat(name).st_mode)
    return out


def test_mode_sets_the_permissions_of_every_file_and_directory(tmp_path):
    ck.save(str(tmp_path / "ckpt"), _state(), step=1, mode=0o600, thread_count=2)
    ck.save(str(tmp_path / "ckpt"), _state(), step=2, mode=0o640, keep_last=1)
    modes = _modes(str(tmp_path / "ckpt"))
    assert modes == {".": 0o700, "step_000002": 0o750, "step_000002/.metadata": 0o640,
                     "step_000002/.shardfn_commit": 0o640,
                     "step_000002/__0_0.distcp": 0o640}, modes
    old = os.umask(0o027)
    try:
        path = ck.save(str(tmp_path / "plain"), _state())
    finally:
        os.umask(old)
    assert set(_modes(path).values()) == {0o750, 0o640}, _modes(path)  # the umask's
    torch.testing.assert_close(ck.load(tmp_path / "ckpt", _like()), _state())
    for bad in (0o400, 0o1777, "0o600", 0o200):
        with pytest.raises(ValueError, match="mode is the files' permission bits"):
            ck.save(str(tmp_path / "x"), _state(), mode=bad)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs at ``tmp_path/disk`` (skipped where mounting is not permitted)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): "
                    f"{done.stderr.strip() or done.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _big(rank: int):
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(256, 256, generator=g), "step": 1}  # 256 KiB a rank


def _save_on_ranks(directory: str, step: int, size: str, async_: bool = False):
    import torch.distributed as dist

    rank = dist.get_rank()
    state = _big(rank) if size == "big" else {"w": torch.ones(4), "step": step}
    layouts = {"w": ck.PerRank()} if size == "big" else None
    try:
        out = ck.save(directory, state, layouts=layouts, step=step, keep_last=1,
                      async_=async_)
        return out.wait() if async_ else out
    except ck.CheckpointError as err:
        return f"error: {err}"


def _fill(disk, leave: int) -> None:
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_full_disk_fails_clearly_cleans_up_and_frees_the_space(worlds, small_disk):
    directory = str(small_disk / "ckpt")
    assert worlds(2).run(_save_on_ranks, directory, 1, "small")[0].endswith("step_000001")
    _fill(small_disk, 200 << 10)  # 200 KiB free; the save needs 2 x 256 KiB
    for async_ in (False, True):
        errors = worlds(2).run(_save_on_ranks, directory, 2, "big", async_)
        for error in errors:  # every rank: ENOSPC and the path
            assert error.startswith("error: ") and "ENOSPC" in error, error
            assert str(small_disk / "ckpt" / "step_000002.tmp-") in error, error
        assert sorted(os.listdir(directory)) == ["step_000001"]  # no .tmp- left
    # the failed save's space is free again: a 16-byte save works at once
    assert worlds(2).run(_save_on_ranks, directory, 3, "small")[0].endswith("step_000003")
    os.remove(small_disk / "filler")
    path = worlds(2).run(_save_on_ranks, directory, 4, "big")[0]
    assert path.endswith("step_000004"), path
    assert sorted(os.listdir(directory)) == ["step_000004"]
    got = ck.load(path, {"w": torch.zeros(256, 256), "step": 0},
                  layouts={"w": ck.Skip()})
    assert got["step"] == 1


def test_a_killed_saves_leftovers_are_removed_before_writing(tmp_path):
    directory = tmp_path / "ckpt"
    ck.save(str(directory), _state(), step=1)
    leftover = directory / f"step_000002.tmp-{uuid.uuid4().hex[:12]}"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x" * 100)
    seen = []

    def hook(event, **info):
        if event == "write_file":
            seen.append(leftover.exists())

    with ck._hooks.installed(hook):
        ck.save(str(directory), _state(), step=2, keep_last=2)
    assert seen == [False]  # gone before this save wrote its first file
    assert sorted(os.listdir(directory)) == ["step_000001", "step_000002"]
