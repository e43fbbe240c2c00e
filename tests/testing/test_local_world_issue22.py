"""The local world: processes inside a rank, its start limit and retry (issue #22).

* A rank may start processes of its own: ``DataLoader(num_workers=2)`` and a nested
  local world used to fail with multiprocessing's "daemonic processes are not allowed
  to have children". The ranks still die with the parent, and what a rank started is
  killed and reaped when the world closes.
* The start has its own limit (``start_timeout``, 300 s by default, apart from the
  run ``timeout``) and a failed start is retried once on fresh processes; after two
  failures the error describes each attempt rank by rank.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from shardfn.testing import LocalWorld, _worker, local_world

# ---------------------------------------------------------------- processes inside a rank


def _batches(seed: int) -> list[torch.Tensor]:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(40.0).reshape(20, 2))
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(seed))
    return [batch for (batch,) in loader]


def _batches_on_rank() -> tuple[list[torch.Tensor], int]:
    batches = _batches(dist.get_rank())
    return batches, len(multiprocessing.active_children())  # the loader's workers are gone


def test_dataloader_with_workers_inside_a_rank(worlds):
    results = worlds(2).run(_batches_on_rank)
    for rank, (batches, children_left) in enumerate(results):
        expected = _batches(rank)  # the same loader in this process
        assert len(batches) == len(expected) == 5
        for got, want in zip(batches, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert children_left == 0
    assert not torch.equal(torch.cat(results[0][0]), torch.cat(results[1][0]))  # seeds differ


def _world_info() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _nested_world() -> list[tuple[int, int]] | None:
    if dist.get_rank() != 0:
        return None
    with local_world(2, check=False) as inner:
        got = inner.run(_world_info)
    return got


def test_a_local_world_inside_a_rank(worlds):
    assert worlds(2).run(_nested_world) == [[(0, 2), (1, 2)], None]


def _start_sleeper() -> int:
    context = multiprocessing.get_context("spawn")
    sleeper = context.Process(target=time.sleep, args=(120,), daemon=False)
    sleeper.start()
    return sleeper.pid


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as file:
            return any(line.split()[1:2] == ["Z"] for line in file if line.startswith("State:"))
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


# ---------------------------------------------------------------- start: limit and retry


class _FakeStarts:
    """Stands in for ``_worker.spawn``: the first ``bad`` starts give ranks that never
    join (``"hang"``: they sleep) or die at once (``"die"``); later starts are real."""

    def __init__(self, bad: int, how: str):
        self.bad, self.how, self.calls = bad, how, 0
        self.fakes: list[multiprocessing.Process] = []
        self._kept = []  # the fakes' ends of their pipes: open, so the parent sees no EOF

    def __call__(self, size, store_path, pg_timeout_s, check, **options):
        self.calls += 1
        if self.calls > self.bad:
            return _REAL_SPAWN(size, store_path, pg_timeout_s, check, **options)
        context = multiprocessing.get_context("spawn")
        ranks = []
        with _worker._main_not_reimported():
            for rank in range(size):
                cmd, child_cmd = context.Pipe()
                watch, child_watch = context.Pipe()
                self._kept += [child_cmd, child_watch]
                target, args = (time.sleep, (120,)) if self.how == "hang" else (os._exit, (3,))
                process = context.Process(target=target, args=args, daemon=True)
                process.start()
                self.fakes.append(process)
                prefix = f"{store_path}.rank{rank}"
                ranks.append(_worker.Rank(process, cmd, watch, context.RawValue("Q", 0),
                                          _worker.StderrLog(f"{prefix}.stderr", rank),
                                          f"{prefix}.crash"))
        return ranks

    def close(self) -> None:
        for conn in self._kept:
            conn.close()
        for process in self.fakes:
            process.kill()
            process.join()


_REAL_SPAWN = _worker.spawn


def test_a_start_that_hangs_twice_names_each_rank_and_closes(monkeypatch):
    fake = _FakeStarts(bad=2, how="hang")
    monkeypatch.setattr(_worker, "spawn", fake)
    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            LocalWorld(2, timeout=60, start_timeout=1.0)
        took = time.monotonic() - began
    finally:
        fake.close()
    message = str(info.value)
    assert fake.calls == 2
    assert "failed to start 2 times" in message and "start_timeout=1s" in message
    for attempt in ("attempt 1:", "attempt 2:"):
        assert attempt in message
    assert message.count("rank 0 had not joined the group after") == 2
    assert message.count("rank 1 had not joined the group after") == 2
    assert "LocalWorld(size, start_timeout=...)" in message
    assert took < 30  # two attempts of 1 s, plus asking the stacks: not the run timeout
    assert all(not process.is_alive() for process in fake.fakes)  # killed and reaped


def test_a_failed_start_is_retried_and_what_ranks_started_is_reaped_on_close(monkeypatch):
    fake = _FakeStarts(bad=1, how="die")
    monkeypatch.setattr(_worker, "spawn", fake)
    try:
        world = LocalWorld(2, check=False)
    finally:
        fake.close()
    try:
        assert fake.calls == 2  # the dead start, then a good one
        assert world.run(_world_info) == [(0, 2), (1, 2)]
        sleepers = world.run(_start_sleeper)
        assert _wait_gone(sleepers, 0.5) == sleepers  # alive while the world is
    finally:
        world.close()
    assert _wait_gone(sleepers, 10.0) == []  # each rank killed and reaped its child


def test_start_timeout_is_validated():
    with pytest.raises(ValueError, match="start_timeout"):
        LocalWorld(2, start_timeout=0)
    with pytest.raises(TypeError, match="start_timeout"):
        LocalWorld(2, start_timeout="300")


_ORPHAN_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from shardfn.testing import LocalWorld
    world = LocalWorld(1, check=False)
    print(world.run(os.getpid)[0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the parent dies without closing the world
""")


def test_ranks_die_with_their_parent():
    """The ranks are no longer daemonic for multiprocessing, yet a parent killed without
    closing the world leaves no rank behind."""
    done = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT], capture_output=True,
                          text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(done.stdout.split()[0])
    assert _wait_gone([pid], 10.0) == [], f"rank process {pid} outlived its parent"
