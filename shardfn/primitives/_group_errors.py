"""Clear errors for collectives whose process group is gone.

Two ways a collective meets a dead group, both raw torch errors before:

* this rank destroyed its default group (``dist.destroy_process_group()``,
  ``sf.distributed.shutdown()``) and still uses a mesh built before: torch says
  "Could not resolve the process group registered under the name 0" or "Group ... is
  not registered";
* a peer destroyed its group, exited or crashed: gloo says "Connection closed by peer".

:func:`require_group` is the cheap check at a collective's start (one
``dist.is_initialized()`` call); :func:`translate` turns a failure inside a collective
(``stats.collective_scope`` calls it on the way out, so the success path pays nothing)
into a :class:`ProcessGroupError` naming the collective, the axis and its ranks.

Example:
    >>> require_group(lambda: ax.describe("psum"), ax.size, ax.ranks[ax.index])
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["ProcessGroupError", "destroyed_message", "require_group", "translate"]

# what gloo (and the TCP store) say when the other end of a connection went away
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Socket closed", "connection closed")


class ProcessGroupError(RuntimeError):
    """A collective could not run: this rank's process group was destroyed, or a peer of
    the group left (destroyed its group, exited or crashed)."""


def _this_rank(rank: int | None) -> str:
    if rank is None and os.environ.get("RANK", "").isdigit():
        rank = int(os.environ["RANK"])
    return f"rank {rank}" if rank is not None else "this rank"


def destroyed_message(description: str, rank: int | None = None) -> str:
    """The message for a collective run after this rank destroyed its default group."""
    return (f"{description} on {_this_rank(rank)}: torch.distributed's default process group "
            f"was destroyed on this rank (dist.destroy_process_group() or "
            f"sf.distributed.shutdown()), so meshes and transforms built before cannot "
            f"communicate; call sf.distributed.initialize() (or init_process_group) again and "
            f"build a new Mesh")


def require_group(description: Callable[[], str], size: int, rank: int | None = None) -> None:
    """Raise :class:`ProcessGroupError` if a collective over ``size > 1`` ranks would run
    without a default process group (this rank destroyed it); ``description()`` names the
    collective (called only then)."""
    if size > 1 and not dist.is_initialized():
        raise ProcessGroupError(destroyed_message(description(), rank))


def translate(error: BaseException, description: str) -> ProcessGroupError | None:
    """The clear error for ``error`` raised inside ``description``, or None to keep it."""
    if isinstance(error, ProcessGroupError) or not isinstance(error, (RuntimeError,
                                                                        ValueError)):
        return None
    if not dist.is_initialized():
        return ProcessGroupError(destroyed_message(description))
    text = str(error)
    if any(marker in text for marker in _PEER_GONE):
        first_line = text.splitlines()[0] if text else type(error).__name__
        return ProcessGroupError(
            f"{description} on {_this_rank(dist.get_rank())}: a peer of this group left (it "
            f"destroyed its process group, exited or crashed) while this rank was still "
            f"communicating "
            f"with it. Every rank of the axis must run the same collectives until all are "
            f"done; the peer's own log says why it left. (torch: {first_line})")
    return None
