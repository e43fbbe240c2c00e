"""Issue 26 items 7 and 9: what a newcomer meets in the local world and the test kit.

* ``sf.testing.local_world(n)`` assigned (a notebook) works as well as in a ``with``
  block; dropping the last reference, or the interpreter's exit, stops its processes;
* ``shardfn.testing.strategies`` without hypothesis says which extra to install;
* a ``RankError``'s headline names the user's function (also the ``sharded`` side of
  ``assert_sharded_matches``, not the kit's internal function), the exception type and
  the last line of its message, and the rank.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from shardfn.testing import RankError, assert_sharded_matches
from shardfn.testing._reports import error_summary
from tests.testing import mutants

ROOT = Path(__file__).resolve().parents[2]


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _python(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def test_an_assigned_world_runs_and_stops_when_dropped_or_at_interpreter_exit():
    """As in a notebook: ``world = local_world(n)`` with no ``with`` block. Rebinding the
    name stops the old world's processes; one never closed is stopped at exit."""
    result = _python("""
        import gc, os
        import shardfn as sf
        world = sf.testing.local_world(1, timeout=60)
        assert isinstance(world, sf.testing.LocalWorld) and world.run(lambda: 6 * 7) == [42]
        print("DROPPED", *world.run(os.getpid))
        world = sf.testing.local_world(2, timeout=60)  # the cell run again: the old one goes
        gc.collect()
        print("LEFT_OPEN", *world.run(os.getpid))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    pids = {line.split()[0]: [int(p) for p in line.split()[1:]]
            for line in result.stdout.splitlines() if line.split()[:1] in (["DROPPED"],
                                                                        ["LEFT_OPEN"])}
    assert len(pids["DROPPED"]) == 1 and len(pids["LEFT_OPEN"]) == 2, result.stdout
    assert all(_pid_gone(pid) for pid in pids["DROPPED"] + pids["LEFT_OPEN"])


def test_strategies_without_hypothesis_say_which_extra_to_install():
    result = _python("""
        import sys
        sys.modules["hypothesis"] = None  # as if the test extra were not installed
        import shardfn as sf
        for get in (lambda: sf.testing.strategies,
                    lambda: __import__("shardfn.testing.strategies")):
            try:
                get()
            except ModuleNotFoundError as error:
                print("NAME", error.name)
                print("MESSAGE", error)
            else:
                print("NO ERROR")
    """, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NO ERROR" not in result.stdout
    assert result.stdout.count("NAME hypothesis") == 2, result.stdout
    assert result.stdout.count("pip install 'shardfn[test]'") == 2, result.stdout


def _fails_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("leaf 'w1' has a bad shape\nexpected 3 dims, got 2")
    return "fine"


def test_rank_error_headline_names_function_exception_and_rank(worlds):
    with pytest.raises(RankError) as caught:
        worlds(2).run(_fails_on_rank_one)
    headline = str(caught.value).splitlines()[0]
    assert headline == ("_fails_on_rank_one raised ValueError: expected 3 dims, got 2 on "
                        "rank 1"), headline
    assert "leaf 'w1' has a bad shape" in caught.value.remote_traceback  # the whole message
    with pytest.raises(RankError) as caught:  # a partial is named by its function
        worlds(2).run(functools.partial(_fails_on_rank_one))
    assert str(caught.value).startswith("_fails_on_rank_one raised ValueError")


def test_rank_error_of_assert_sharded_matches_names_the_sharded_function(worlds):
    def sharded_without_trainer(mesh):
        raise KeyError("no shard for 'w2'")

    case = mutants.dp_case({"dp": 2})  # both ranks raise: the first to answer is named
    with pytest.raises(RankError) as caught:
        assert_sharded_matches(sharded_without_trainer, case.reference, mesh=case.mesh,
                               inputs=case.inputs, world=worlds)
    headline = str(caught.value).splitlines()[0]
    assert headline == (f"{sharded_without_trainer.__qualname__} raised KeyError: "
                        f"\"no shard for 'w2'\" on rank {caught.value.rank}"), headline
    assert "_on_rank" not in headline


def test_error_summary_is_one_line():
    assert error_summary(ValueError("first\n\nlast  \n")) == "ValueError: last"
    assert error_summary(RuntimeError()) == "RuntimeError"
    long = error_summary(ValueError("x" * 1000))
    assert len(long) == 300 and long.endswith("...")
