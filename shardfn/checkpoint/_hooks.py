"""Test hooks: a function called at named points of a save (to inject faults).

Events: ``"write_file"`` (before each data file of this rank is opened, with
``name``), ``"before_commit"`` (this rank's files are written and hashed, before
the ranks agree), ``"commit"`` (rank 0, before the commit marker is written).

Example:
    >>> def fail_second_file(event, **info):
    ...     if event == "write_file" and info["name"].endswith("_1.distcp"):
    ...         raise OSError("disk full")
    >>> with sf.checkpoint._hooks.installed(fail_second_file):
    ...     sf.checkpoint.save(path, state)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["fire", "installed"]

_HOOK: list[Callable[..., Any]] = []


def fire(event: str, **info: Any) -> None:
    """Call the installed hook (if any) with ``event`` and ``info``."""
    for hook in list(_HOOK):
        hook(event, **info)


@contextlib.contextmanager
def installed(hook: Callable[..., Any]) -> Iterator[None]:
    """Install ``hook`` for the duration of the block (this process only)."""
    _HOOK.append(hook)
    try:
        yield
    finally:
        _HOOK.remove(hook)
