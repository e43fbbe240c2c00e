"""Values declared replicated: in check mode, verified equal on every rank of their axis.

JAX's ``shard_map`` types every value as *invariant* over a mesh axis (equal on
every rank) or *varying*; ``check_vma`` checks the types when it traces, and the
transposes follow them. shardfn has no types at run time, so a program states the
same facts by the collectives it calls, and check mode (``sf.check_consistency``)
verifies them on the values:

==========================================  ==========================================
declared replicated                         what a difference means
==========================================  ==========================================
``pvary(x, axis)``'s input ``x``            ``x`` is already varying (per-rank inputs)
``psum_invariant`` / ``pmean_invariant``    the reduction returned different values
output
the gradient reaching that output           the result fed per-rank work: a forgotten
(in backward)                               ``pvary``, or a loss that differs per rank
:func:`check_replicated`'s tree             whatever the caller declared (a loss)
==========================================  ==========================================

Each is one exchange of hashes through the store (see
:mod:`shardfn.primitives.consistency`); values whose bits differ by no more than
rounding pass (a GPU kernel with atomics may sum in another order per rank). Off
check mode nothing is checked (one bool test). See docs/check_mode.md, "Values
declared replicated".

Example:
    >>> loss = sf.check_replicated(sf.pmean(local_loss, "dp"), "dp")   # a no-op off check mode
"""

from __future__ import annotations

from typing import Any

from shardfn.mesh import AxisName, Mesh
from shardfn.primitives import _comm, consistency
from shardfn.primitives._comm import Axis

__all__ = ["check_replicated", "cotangent_hint", "output_hint", "pvary_hint"]


def pvary_hint(ax: Axis) -> str:
    """What to do when ``pvary``'s input differs across ``ax``."""
    return (f"pvary declares its input replicated over {ax.key!r} (its gradient is summed "
            f"over the axis); this one differs across {ax.key!r}: it is already varying, so "
            f"drop pvary, or pass the same value on every rank")


def output_hint(op: str, ax: Axis) -> str:
    """What a differing ``psum_invariant`` / ``pmean_invariant`` result means."""
    return (f"{op} returned different values on the ranks of {ax.key!r}: the reduction "
            f"itself disagrees (a backend that reduces in a rank-dependent order beyond "
            f"rounding, or a communicator bug)")


def cotangent_hint(op: str, ax: Axis) -> str:
    """What a differing gradient at an invariant output means: the output fed per-rank work."""
    return (f"{op}'s backward passes the gradient through unsummed (its result is declared "
            f"replicated and counted once), but the gradient differs across {ax.key!r}: the "
            f"result fed per-rank (varying) computation. Wrap it in sf.pvary(y, "
            f"{ax.key!r}) where it meets per-rank values (a forgotten pvary), compute the same "
            f"loss on every rank, or use sf.psum / sf.pmean, whose backward sums the gradients")


def check_replicated(tree: Any, axis: AxisName, *, mesh: Mesh | None = None,
                     what: str = "value", exact: bool = False) -> Any:
    """Declare ``tree`` replicated over ``axis``; in check mode verify it, and return it.

    Off check mode this only resolves the axis. In check mode the ranks of ``axis``
    exchange a hash of every leaf; when the bits differ beyond rounding (or at all,
    with ``exact``) every rank raises :class:`~shardfn.primitives.consistency.
    ConsistencyError` naming the leaf, the ranks holding each value and the relative
    difference. Use it on a loss every rank must agree on, on the gradients of
    replicated parameters (a forgotten ``pvary`` makes them differ per rank), or on an
    input each rank must load identically.

    Cost in check mode: one store exchange (about a small collective's latency) and one
    hash pass over the bytes (CUDA tensors are copied to the CPU); a rounding-level
    difference adds a second exchange and a sketch pass. Off: nothing measurable.

    Args:
        tree: a tensor or pytree of tensors.
        axis: a mesh axis name or a tuple of names.
        mesh: overrides the current mesh.
        what: what the value is, for the message (``"loss"``).
        exact: compare bits only (no rounding tolerance).

    Returns:
        ``tree`` itself.

    Raises:
        ConsistencyError: in check mode, on every rank of the axis, when the values differ.

    Example:
        >>> loss = sf.check_replicated(sf.pmean(local_loss, "dp"), "dp", what="loss")
    """
    ax = _comm.resolve(axis, mesh)
    if consistency.enabled() and ax.size > 1:
        consistency.check_replicated(
            f"{what} (declared replicated by sf.check_replicated)", ax, tree,
            f"It was declared replicated over {ax.key!r}: every rank must compute it from the "
            f"same values (same inputs, seeds and reductions)", rounding=not exact)
    return tree
