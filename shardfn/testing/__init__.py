"""Testing helpers: a persistent local world of N CPU processes, and the property-test kit.

* :class:`LocalWorld` / :func:`local_world`: N CPU ranks in a gloo group, reused;
* :func:`assert_sharded_matches`: a sharded step equals its unsharded reference,
  leaf by leaf, with hints for typical bugs (see docs/testing.md);
* ``shardfn.testing.strategies``: hypothesis strategies (imported on first use,
  hypothesis is a test dependency); :class:`TinyModel`: small random models;
* ``shardfn.testing.pytest_plugin``: the ``local_world`` fixture and
  ``@pytest.mark.world(n)``.
"""

from shardfn.primitives.stats import heartbeat
from shardfn.testing.conformance import Conformance, check_model, module_holding
from shardfn.testing.local_world import LocalWorld, RankError, WorldTimeout, local_world
from shardfn.testing.matches import (
    COMPARE,
    GatherWith,
    Trainer,
    assert_sharded_matches,
    gather_with,
    loss_trainer,
    split_over,
    state_specs,
)
from shardfn.testing.tiny_models import TinyModel
from shardfn.testing.worlds import shared_world

__all__ = [
    "COMPARE",
    "Conformance",
    "GatherWith",
    "LocalWorld",
    "RankError",
    "TinyModel",
    "Trainer",
    "WorldTimeout",
    "assert_sharded_matches",
    "check_model",
    "gather_with",
    "heartbeat",
    "local_world",
    "loss_trainer",
    "module_holding",
    "shared_world",
    "split_over",
    "state_specs",
    "strategies",
]


def __getattr__(name):
    # strategies needs hypothesis, a test dependency: import it on first use.
    if name == "strategies":
        import importlib

        return importlib.import_module("shardfn.testing.strategies")
    raise AttributeError(f"module 'shardfn.testing' has no attribute {name!r}")
