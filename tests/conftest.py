"""Shared test fixtures: hypothesis profiles and the session's persistent local worlds.

The worlds come from shardfn's pytest plugin (``local_world``): the repository's
tests, ``@pytest.mark.world(n)`` and ``sf.testing.assert_sharded_matches`` share one
set of worlds per session. The plugin is loaded here unless its entry point (an
installed shardfn) loads it already.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import settings

from shardfn.testing import LocalWorld

# Distributed examples are slow and their timing varies: no deadline, few examples.
# HYPOTHESIS_PROFILE=dev runs more examples locally; "ci" prints the blob to reproduce.
# "ci" is derandomized: CI runs the same examples every time, so a red run is
# reproducible and a green one is not luck; "dev" explores new examples on each run.
settings.register_profile("ci", max_examples=10, deadline=None, print_blob=True,
                          derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The test process shares 2 cores with the local worlds' ranks: oversubscribed intra-op
# threads made small ops ~50x slower. The ranks set 1 thread too.
torch.set_num_threads(1)

MAX_WORLD_SIZE = 4


def _entry_point_loads_plugin() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.name == "shardfn" for ep in importlib.metadata.entry_points(group="pytest11"))


pytest_plugins = [] if _entry_point_loads_plugin() else ["shardfn.testing.pytest_plugin"]


@pytest.fixture(scope="session")
def worlds(local_world) -> Callable[[int], LocalWorld]:
    """Return ``worlds(n)``: the session's ``LocalWorld`` of ``n`` ranks (1..4), made on first use.

    Example:
        >>> def test_sum(worlds):
        ...     assert worlds(2).run(lambda: 1) == [1, 1]
    """
    def get(size: int) -> LocalWorld:
        if not isinstance(size, int) or not 1 <= size <= MAX_WORLD_SIZE:
            raise ValueError(f"worlds(n) takes n in 1..{MAX_WORLD_SIZE}, got {size!r}")
        return local_world(size)

    return get
