"""Tests for the persistent local world: results, collectives, and failure recovery."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from shardfn.testing import LocalWorld, RankError, WorldTimeout, local_world

PARENT = os.getpid()


@pytest.fixture(scope="module")
def fragile():
    """This module's own world of 2 ranks, for the tests that break it (not the session's)."""
    world = LocalWorld(2)
    yield world
    world.close()


def _rank_and_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _pids(world: LocalWorld) -> list[int]:
    return world.run(os.getpid)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_results_come_back_by_rank(worlds):
    assert worlds(2).run(_rank_and_size) == [(0, 2), (1, 2)]
    assert len(set(_pids(worlds(2)))) == 2


def test_closure_lambda_and_kwargs(worlds):
    offset = 100  # captured by the lambda: must travel with cloudpickle
    results = worlds(2).run(lambda x, *, scale: offset + scale * x + dist.get_rank(), 1, scale=3)
    assert results == [103, 104]


def test_all_reduce_sums_over_ranks(worlds):
    def fn(base):
        value = base * (dist.get_rank() + 1)
        dist.all_reduce(value)
        return value

    base = torch.tensor([1.0, -2.0, 0.5])
    for result in worlds(2).run(fn, base):
        torch.testing.assert_close(result, base * 3)


@given(size=st.integers(1, 4), rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_all_reduce_matches_local_sum(worlds, size, rows, seed):
    full = torch.randn(size, rows, generator=torch.Generator().manual_seed(seed))

    def fn(full):
        local = full[dist.get_rank() if dist.is_initialized() else 0].clone()
        if dist.is_initialized():
            dist.all_reduce(local)
        return local

    for result in worlds(size).run(fn, full):
        torch.testing.assert_close(result, full.sum(0))


def test_size_one_has_no_process_group(worlds):
    assert worlds(1).run(lambda: (dist.is_initialized(), os.getpid() != PARENT)) == [(False, True)]


def test_rank_error_names_rank_and_traceback(worlds):
    def fn():
        if dist.get_rank() == 1:
            raise ValueError("boom on purpose")
        return "fine"

    pids = _pids(worlds(2))
    with pytest.raises(RankError, match="rank 1") as info:
        worlds(2).run(fn)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in info.value.remote_traceback
    assert "boom on purpose" in str(info.value) and "in fn" in str(info.value)
    assert not isinstance(info.value, WorldTimeout)
    assert _pids(worlds(2)) == pids  # nobody was stuck: no restart needed
    assert worlds(2).run(_rank_and_size) == [(0, 2), (1, 2)]


def test_rank_error_while_peer_waits_in_collective(fragile):
    def fn():
        if dist.get_rank() == 1:
            raise KeyError("rank 1 gives up")
        dist.all_reduce(torch.ones(2))  # never matched: rank 0 blocks here

    pids = _pids(fragile)
    with pytest.raises(RankError) as info:
        fragile.run(fn, timeout=30)
    assert info.value.rank == 1 and "rank 1 gives up" in info.value.remote_traceback
    assert "rank 0 did not finish" in str(info.value) and "all_reduce" in str(info.value)
    assert set(_pids(fragile)).isdisjoint(pids)  # restarted
    assert fragile.run(lambda: dist.all_reduce(torch.ones(1)) or 1) == [1, 1]


def test_hang_raises_world_timeout_with_stacks(fragile):
    def fn():
        if dist.get_rank() == 1:
            time.sleep(1000)
        dist.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        fragile.run(fn, timeout=3)
    assert time.monotonic() - start < 10
    error = info.value
    assert isinstance(error, TimeoutError) and isinstance(error, RankError)
    assert error.rank == 0 and error.ranks == (0, 1)
    message = str(error)
    assert "rank 1 did not finish" in message and "time.sleep(1000)" in message
    assert "rank 0 did not finish" in message and "all_reduce" in message
    assert "collective in flight" in message
    assert fragile.run(_rank_and_size) == [(0, 2), (1, 2)]


@pytest.mark.parametrize(
    "die, expected",
    [(lambda: os._exit(3), "exit code 3"), (lambda: ctypes.string_at(0), "SIGSEGV")],
    ids=["exit", "segfault"],
)
def test_dead_rank_is_reported_with_exit_code(fragile, die, expected):
    def fn():
        if dist.get_rank() == 1:
            die()
        return dist.get_rank()

    start = time.monotonic()
    with pytest.raises(WorldTimeout, match=f"rank 1 is dead \\(.*{expected}") as info:
        fragile.run(fn, timeout=60)
    assert time.monotonic() - start < 15  # found by the process sentinel, not the timeout
    assert info.value.rank == 1 and info.value.ranks == (1,)
    assert fragile.run(_rank_and_size) == [(0, 2), (1, 2)]


def test_unpicklable_result_is_a_rank_error(worlds):
    with pytest.raises(RankError, match="rank 0") as info:
        worlds(1).run(lambda: threading.Lock())
    assert "pickle" in info.value.remote_traceback
    assert worlds(1).run(lambda: 7) == [7]


def test_mesh_state_is_reset_between_runs(worlds):
    def set_mesh():
        from shardfn.mesh import Mesh, set_mesh

        set_mesh(Mesh({"dp": 2}))

    def current():
        from shardfn.mesh import get_mesh

        try:
            return get_mesh()
        except ValueError:
            return None

    worlds(2).run(set_mesh)
    assert worlds(2).run(current) == [None, None]


def test_local_world_context_closes_processes():
    with local_world(2, timeout=30) as world:
        pids = _pids(world)
        assert repr(world) == "LocalWorld(size=2, timeout=30, open)"
    assert all(_pid_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        world.run(os.getpid)
    world.close()  # idempotent


def test_bad_size_is_rejected():
    with pytest.raises(ValueError, match="size"):
        LocalWorld(0)


def test_a_script_without_main_guard_opens_one_world(tmp_path):
    """Workers do not re-run the parent's script (as spawn children normally would), so a
    top-level ``with local_world(2)`` works in a script as in a notebook; a class defined in
    the script reaches the workers by value."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "no_guard.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from shardfn.testing import local_world\n"
        "class Twice(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return 2 * x\n"
        "print('top level', flush=True)\n"
        "with local_world(2) as world:\n"
        "    print(world.run(lambda: float(Twice()(torch.ones(2)).sum()) + dist.get_rank()))\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["top level", "[4.0, 5.0]"]
