"""Testing helpers: a persistent local world of N CPU processes for distributed tests."""

from shardfn.primitives.stats import heartbeat
from shardfn.testing.local_world import LocalWorld, RankError, WorldTimeout, local_world

__all__ = ["LocalWorld", "RankError", "WorldTimeout", "heartbeat", "local_world"]
