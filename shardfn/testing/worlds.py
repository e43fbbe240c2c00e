"""The process's shared local worlds: one ``LocalWorld`` per size, made on first use.

Spawning a world takes seconds, so everything in one process (the pytest
plugin's ``local_world`` fixture, the ``@pytest.mark.world(n)`` marker, and
``assert_sharded_matches(world=None)``) shares these worlds; :func:`close_all`
ends them (the plugin calls it at the end of the session, and at exit).

Example:
    >>> shared_world(2).run(lambda: 1)
    [1, 1]
    >>> close_all()
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from shardfn.testing.local_world import LocalWorld

__all__ = ["close_all", "resolve", "shared_world"]

_WORLDS: dict[int, LocalWorld] = {}
_LOCK = threading.Lock()


def shared_world(size: int) -> LocalWorld:
    """The shared ``LocalWorld`` of ``size`` ranks (started now if there is none, or it closed).

    Raises:
        TypeError / ValueError: for a size that is not an int >= 1.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"a local world takes a size that is an int >= 1, got {size!r}")
    with _LOCK:
        world = _WORLDS.get(size)
        if world is None or not world._finalizer.alive:  # closed by its user
            world = _WORLDS[size] = LocalWorld(size)
        return world


def close_all() -> None:
    """Close every shared world (idempotent); the next ``shared_world`` starts afresh."""
    with _LOCK:
        worlds = list(_WORLDS.values())
        _WORLDS.clear()
    for world in worlds:
        world.close()


def resolve(world: Any, size: int) -> LocalWorld:
    """A world of ``size`` ranks from ``world``: a LocalWorld, ``size -> world``, or None.

    Raises:
        ValueError: for a LocalWorld of another size.
        TypeError: for anything else.
    """
    if world is None:
        return shared_world(size)
    if isinstance(world, LocalWorld):
        if world.size != size:
            raise ValueError(f"the mesh needs {size} ranks but the world given has {world.size}")
        return world
    if callable(world):
        got = world(size)
        return resolve(got, size) if isinstance(got, LocalWorld) else _bad(got)
    return _bad(world)


def _bad(world: Any) -> LocalWorld:
    raise TypeError(f"world must be a LocalWorld, a function size -> LocalWorld, or None; "
                    f"got {type(world).__name__}")


atexit.register(close_all)
