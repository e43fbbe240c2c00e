"""Shared test fixtures: hypothesis profiles and the session's persistent local worlds."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

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


@pytest.fixture(scope="session")
def worlds() -> Iterator[Callable[[int], LocalWorld]]:
    """Return ``worlds(n)``: the session's ``LocalWorld`` of ``n`` ranks (1..4), made on first use.

    Example:
        >>> def test_sum(worlds):
        ...     assert worlds(2).run(lambda: 1) == [1, 1]
    """
    cache: dict[int, LocalWorld] = {}

    def get(size: int) -> LocalWorld:
        if not isinstance(size, int) or not 1 <= size <= MAX_WORLD_SIZE:
            raise ValueError(f"worlds(n) takes n in 1..{MAX_WORLD_SIZE}, got {size!r}")
        if size not in cache:
            cache[size] = LocalWorld(size)
        return cache[size]

    yield get
    for world in cache.values():
        world.close()
