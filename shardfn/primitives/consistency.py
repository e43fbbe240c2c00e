"""Check mode: ranks compare what they are about to do before they do it.

A collective whose ranks disagree (a shape, a dtype, a tree, a permutation, or
the op itself) hangs, kills a rank or returns garbage. In check mode every
public collective, and the boundaries of the transforms (``shard_params``
init/shard/apply, ``data_parallel`` and ``shard_opt_state`` steps), first
exchange a small fingerprint over the axis; a mismatch raises
:class:`ConsistencyError` on every rank of the axis, showing each rank's call.

Off by default; on by default inside ``sf.testing`` (local world workers);
``SHARDFN_CHECK=1`` in the environment turns it on, ``SHARDFN_CHECK=0`` off.

Example:
    >>> sf.check_consistency(True)     # every later collective is checked
    >>> sf.check_consistency()         # -> True: the current setting
"""

# STUB: the interface below is fixed; the implementation is being written.

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardfn.primitives._comm import Axis

__all__ = ["ConsistencyError", "check_call", "check_consistency", "check_replicated", "enabled"]


class ConsistencyError(ValueError):
    """Ranks of an axis disagreed on a collective or a replicated value (raised on every rank)."""


_ENABLED: bool = os.environ.get("SHARDFN_CHECK", "0") not in ("", "0", "false", "False")


def enabled() -> bool:
    """Whether check mode is on in this process."""
    return _ENABLED


def check_consistency(enable: bool | None = None) -> bool:
    """Turn check mode on or off (None: leave it); return the setting now in force.

    Args:
        enable: True, False, or None to only read the setting.

    Returns:
        Whether check mode is on.

    Example:
        >>> sf.check_consistency(True)
        True
    """
    global _ENABLED
    if enable is not None:
        _ENABLED = bool(enable)
    return _ENABLED


def check_call(op: str, ax: Axis, tree: Any = None, **static: Any) -> None:
    """In check mode, compare this call's fingerprint across the ranks of ``ax``.

    The fingerprint is ``op``, the axis, the tree structure with every leaf's shape
    and dtype, and ``static`` (e.g. ``dim=0``, ``perm=...``, ``src=0``), plus the
    caller's site for the error message. A no-op when check mode is off or the
    axis has one rank.

    Args:
        op: the operation's public name, e.g. ``"psum"`` or ``"shard_params.apply"``.
        ax: the resolved axis.
        tree: the tensors (or pytree of tensors and Python values) the call is given.
        **static: other arguments that must agree across ranks.

    Raises:
        ConsistencyError: on every rank of the axis, when the fingerprints differ.
    """


def check_replicated(what: str, ax: Axis, tree: Any) -> None:
    """In check mode, check that ``tree``'s values are the same on every rank of ``ax``.

    Used where a value must be replicated: parameters at ``init``/``shard`` (a
    different seed per rank), a broadcast source. Compares a hash of each leaf's
    bytes, and names the first leaf that differs and the ranks that disagree.

    Args:
        what: what is being checked, for the message (``"shard_params.init params"``).
        ax: the axis over which the values must agree.
        tree: a pytree of tensors.

    Raises:
        ConsistencyError: on every rank of the axis, when values differ.
    """
