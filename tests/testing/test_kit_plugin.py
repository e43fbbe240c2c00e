"""The pytest plugin in a fresh pytest process: the ``local_world`` fixture, the
``@pytest.mark.world(n)`` marker (plain and under ``@given``, a failure naming its rank), the
hypothesis profiles; and the session fixture shared with ``assert_sharded_matches``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from shardfn.testing import worlds as shared
from shardfn.testing.pytest_plugin import examples_for

ROOT = Path(__file__).resolve().parents[2]

USER_TESTS = '''
import pytest
import torch
from hypothesis import given, settings, strategies as st


def test_fixture_is_shared(local_world):
    from shardfn.testing import worlds
    assert local_world(2) is worlds.shared_world(2)
    assert local_world(2).run(lambda: 7) == [7, 7]


@pytest.mark.world(2)
def test_body_runs_on_every_rank():
    import torch.distributed as dist
    import shardfn as sf
    assert dist.get_world_size() == 2
    with sf.Mesh({"dp": 2}):
        assert sf.psum(torch.ones(()), "dp").item() == 2.0


@pytest.mark.world(2)
def test_fails_on_rank_one():
    import torch.distributed as dist
    assert dist.get_rank() == 0, "only rank 0 passes"


@settings(max_examples=3, deadline=None)
@given(x=st.integers(1, 5))
@pytest.mark.world(2)
def test_examples_run_on_the_ranks(x):
    import torch.distributed as dist
    import shardfn as sf
    with sf.Mesh({"dp": 2}):
        total = sf.psum(torch.tensor(float(x * (dist.get_rank() + 1))), "dp")
    assert total.item() == 3 * x


@pytest.fixture
def lock():
    import threading
    return threading.Lock()


@pytest.mark.world(2)
def test_unpicklable_argument_is_named(lock):
    pass


def test_profiles_are_registered():
    from hypothesis import settings
    assert settings.get_profile("shardfn-ci").deadline is None
    assert settings.get_profile("shardfn-dev").max_examples == 25
'''


def test_plugin_fixture_marker_and_profiles_in_a_fresh_pytest(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "shardfn.testing.pytest_plugin", "-p",
         "hypothesis", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_user.py")],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    out = result.stdout + result.stderr
    assert "2 failed, 4 passed" in out, out
    assert "@pytest.mark.world ships the test's arguments to the ranks, but 'lock' (lock) " \
        "cannot be pickled" in out, out
    assert "test_fails_on_rank_one failed on rank 1 of 2" in out, out
    assert "only rank 0 passes" in out, out


def test_the_repository_fixture_is_the_plugins(worlds, local_world):
    assert worlds(2) is local_world(2) is shared.shared_world(2)


def test_examples_for_scales_down_with_the_world_size():
    assert [examples_for(n, 10) for n in (1, 2, 4, 8, 40)] == [10, 10, 5, 2, 2]
