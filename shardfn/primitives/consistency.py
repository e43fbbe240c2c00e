"""Check mode: ranks compare what they are about to do before they do it.

A collective whose ranks disagree (a shape, a dtype, a tree, a permutation, or
the op itself) hangs, kills a rank or returns garbage. In check mode every
public collective, and the boundaries of the transforms (``shard_params``
init/shard/apply, ``data_parallel`` and ``shard_opt_state`` steps), first
exchange a small fingerprint over the axis; a mismatch raises
:class:`ConsistencyError` on every rank of the axis, showing each rank's call.

Off by default; on by default inside ``sf.testing`` (local world workers);
``SHARDFN_CHECK=1`` in the environment turns it on, ``SHARDFN_CHECK=0`` off;
``SHARDFN_CHECK_TIMEOUT=<seconds>`` sets how long a rank waits for the others.

How the exchange works: the fingerprints go through the default process
group's key-value store (a ``TCPStore``, in the local world as under
``torchrun``), never through the axis's communicator, so it works the
same on gloo and NCCL, inside backward passes, and can time out. Each group of
ranks counts its checked calls; call ``#n`` of rank ``r`` is the key
``sfcheck/<epoch>/<group ranks>/<n>/<r>``. A rank that makes an extra or a
different call therefore disagrees with the others at that number (or, if the
others never make another checked call there, times out naming it). A key
holds a digest of the fingerprint (the full fingerprints are exchanged only on
a mismatch, for the message). Once a rank has read every key of call ``n``
it deletes its own older keys of that group (every peer has then finished
reading them, also those of an earlier epoch: ranks ``reset`` between runs), so
the store holds at most one call's keys per group and rank however long the run;
a call that timed out is marked "gave up", not deleted, so no read can block on
a missing key. Comm stats do not count this traffic. What a
key holds and what a mismatch says are in :mod:`shardfn.primitives._fingerprint`.
See docs/check_mode.md.

Example:
    >>> sf.check_consistency(True)     # every later collective is checked
    True
    >>> sf.check_consistency()         # -> True: the current setting
    True
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardfn import pytree as pt
from shardfn._torch_internals import default_store
from shardfn.primitives import _compiled, stats
from shardfn.primitives._check_store import polls_files as _polls_files  # noqa: F401
from shardfn.primitives._check_store import read_fresh as _read_fresh
from shardfn.primitives._check_store import wait_keys as _wait_keys
from shardfn.primitives._fingerprint import (
    INIT_HINT,
    beyond_rounding,
    call_text,
    comparable,
    digest,
    fingerprint,
    leaf_sketch,
    mismatch_message,
    replicated_message,
    timeout_message,
)
from shardfn.primitives._fingerprint import leaf_hash as _leaf_hash

if TYPE_CHECKING:
    from shardfn.primitives._comm import Axis

__all__ = [
    "ConsistencyError",
    "check_call",
    "check_consistency",
    "check_replicated",
    "check_same",
    "check_timeout",
    "enabled",
    "env_setting",
    "reset",
    "suspended",
]


# --- the store -----------------------------------------------------------------------


def _default_store() -> dist.Store:
    """The default process group's key-value store (one name: benchmarks swap it)."""
    return default_store()


# --- settings -------------------------------------------------------------------------


class ConsistencyError(ValueError):
    """Ranks of an axis disagreed on a collective or a replicated value (raised on every rank)."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
DEFAULT_TIMEOUT_S = 60.0


def _parse_env(environ: Mapping[str, str]) -> tuple[bool | None, float]:
    """``(SHARDFN_CHECK as a bool or None when unset, SHARDFN_CHECK_TIMEOUT in seconds)``.

    Raises:
        ValueError: for a value that is neither a boolean word nor a positive number.
    """
    flag: bool | None = None
    raw = environ.get("SHARDFN_CHECK")
    if raw is not None:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"SHARDFN_CHECK={raw!r}: use one of {_TRUE} (on) or {_FALSE} (off)")
        flag = word in _TRUE
    timeout = DEFAULT_TIMEOUT_S
    raw = environ.get("SHARDFN_CHECK_TIMEOUT")
    if raw is not None and raw.strip():
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not timeout > 0 or timeout == float("inf"):
            raise ValueError(f"SHARDFN_CHECK_TIMEOUT={raw!r}: give a positive number of seconds")
    return flag, timeout


_ENV_FLAG, _TIMEOUT_S = _parse_env(os.environ)
_ENABLED: bool = bool(_ENV_FLAG)
_STATE_LOCK = threading.RLock()  # one check at a time per process: call numbers stay in order
_SEQ: dict[tuple[int, ...], int] = {}  # group ranks -> checked calls made on that group
_EPOCH = [0]
_LIVE: dict[tuple[int, ...], list[str]] = {}  # group ranks -> this rank's keys in the store
_THREAD = threading.local()  # .suspended: checks skipped on this thread
_HELPER_THREAD_PREFIX = "shardfn-"  # shardfn's own threads ("shardfn-p2p-poster") never check


def enabled() -> bool:
    """Whether check mode is on here (a module-level bool: cheap in hot paths).

    False inside code that ``torch.compile`` traces: check mode is off there (it warns
    once, at trace time; see :mod:`shardfn.primitives._compiled`).
    """
    if _compiled.tracing():
        if _ENABLED:
            _compiled.skipped("check_mode")
        return False
    return _ENABLED


def env_setting() -> bool | None:
    """``SHARDFN_CHECK`` as read at import: True/False, or None when it is not set.

    The local world uses it to keep a user's explicit ``SHARDFN_CHECK=0``.
    """
    return _ENV_FLAG


def check_timeout() -> float:
    """Seconds a rank waits at a check for the other ranks of the axis."""
    return _TIMEOUT_S


def check_consistency(enable: bool | None = None, *, timeout: float | None = None) -> bool:
    """Turn check mode on or off (None: leave it); return the setting now in force.

    Args:
        enable: True, False, or None to only read the setting.
        timeout: seconds a rank waits at a check for the others before it raises
            :class:`ConsistencyError` naming the ranks that never arrived (None: leave
            it; the default is ``SHARDFN_CHECK_TIMEOUT`` or 60).

    Returns:
        Whether check mode is on.

    Raises:
        TypeError/ValueError: for a non-bool ``enable`` or a non-positive ``timeout``.

    Example:
        >>> sf.check_consistency(True, timeout=10)
        True
    """
    global _ENABLED, _TIMEOUT_S
    if enable is not None and not isinstance(enable, bool):
        raise TypeError(f"check_consistency(enable) takes True, False or None, got {enable!r}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            0 < timeout < float("inf")
        ):
            raise ValueError(f"check_consistency timeout must be a positive number of seconds, "
                             f"got {timeout!r}")
        _TIMEOUT_S = float(timeout)
    if enable is not None:
        _ENABLED = enable
    return _ENABLED


def reset() -> None:
    """Start a new numbering of checked calls (every rank must call it, e.g. between runs).

    The local world calls this after each function it runs, so a run that failed
    with ranks at different call numbers (one rank raised before a check, the
    others timed out) does not offset the next run's checks.
    """
    with _STATE_LOCK:
        _EPOCH[0] += 1
        _SEQ.clear()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Skip checks on this thread inside the block (for helper threads of the library).

    Threads whose name starts with ``"shardfn-"`` (the library's own, such as the
    point-to-point poster) skip checks without it: checks run on the thread of the
    public call (or autograd's thread running its backward), in call order.

    Example:
        >>> with suspended():
        ...     check_call("psum", ax, x)   # not checked
    """
    before = getattr(_THREAD, "suspended", False)
    _THREAD.suspended = True
    try:
        yield
    finally:
        _THREAD.suspended = before


def _active(ax: Axis) -> bool:
    return (
        enabled()  # first: False while torch.compile traces (threads and locks untraceable)
        and ax.size > 1
        and not getattr(_THREAD, "suspended", False)
        and not threading.current_thread().name.startswith(_HELPER_THREAD_PREFIX)
        and dist.is_initialized()
    )


# --- the exchange ---------------------------------------------------------------------
#
# Round 1 (every check): each rank posts a short summary: a digest of everything compared,
# the call as text and its site. Equal digests: done. Otherwise round 2 (only on a
# mismatch, which every rank sees at once): each rank posts its whole fingerprint, so the
# message can say what differs. The store therefore carries a few hundred bytes per rank
# and check whatever the size of the tree.


def _posted(ranks: tuple[int, ...], key: str) -> None:
    """Remember that this rank's ``key`` of group ``ranks`` is in the store."""
    live = _LIVE.setdefault(ranks, [])
    if key not in live:
        live.append(key)


def _delete_read_keys(store: dist.Store, ranks: tuple[int, ...], keep: str) -> None:
    """Delete this rank's keys of group ``ranks`` but ``keep``, once every peer posted ``keep``'s
    call: a peer posts a call only after it read every earlier one, of this epoch or (after
    ``reset``, which all ranks call between runs) of an earlier epoch. So the store holds at
    most one call's keys per group and rank, however many calls and runs there were."""
    for key in _LIVE.get(ranks, []):
        if key != keep:
            store.delete_key(key)
    _LIVE[ranks] = [keep]


def _exchange(ax: Axis, fp: dict, label: str, details: Callable[[], dict] | None = None
              ) -> tuple[int, list[dict] | None]:
    """Post ``fp`` as the group's next checked call; ``(call number, None)`` when every rank
    posted the same, else ``(call number, every rank's fingerprint by rank)``, each with the
    fields ``details()`` adds (computed only then, on a mismatch).

    Raises:
        ConsistencyError: when a rank does not post within the timeout.
    """
    store = _default_store()
    rank = dist.get_rank()
    group = ",".join(str(r) for r in ax.ranks)
    summary = {"digest": digest(fp), "call": call_text(fp), "site": fp["site"]}
    with _STATE_LOCK:
        seq = _SEQ.get(ax.ranks, 0)
        _SEQ[ax.ranks] = seq + 1
        prefix = f"sfcheck/{_EPOCH[0]}/{group}/"
        mine = f"{prefix}{seq}/{rank}"
        keys = [f"{prefix}{seq}/{r}" for r in ax.ranks]
        store.set(mine, json.dumps(summary))
        _posted(ax.ranks, mine)
        deadline = monotonic() + _TIMEOUT_S
        with stats.collective_scope(f"check mode: waiting for the ranks of axis {ax.key!r} "
                                    f"{list(ax.ranks)} at {label} #{seq + 1}"):
            summaries = _read_fresh(store, keys, deadline)
        if summaries is None:
            message = timeout_message(store, ax, prefix, seq, keys, summary, fp["op"], label,
                                      _TIMEOUT_S)
            # Take the call back: mark the key (never delete it: a peer may be reading it) so
            # that a late peer waits for our next call at this number and pairs with that.
            with contextlib.suppress(Exception):
                store.set(mine, json.dumps({**summary, "gave_up": True}))
            _SEQ[ax.ranks] = seq
            raise ConsistencyError(message)
        _delete_read_keys(store, ax.ranks, keep=mine)
        if all(other["digest"] == summary["digest"] for other in summaries):
            return seq, None
        full_keys = [f"{prefix}{seq}/full/{r}" for r in ax.ranks]  # kept: errors are rare
        store.set(full_keys[ax.ranks.index(rank)], json.dumps({**fp, **(details or dict)()}))
        _posted(ax.ranks, full_keys[ax.ranks.index(rank)])
        if not _wait_keys(store, full_keys, _TIMEOUT_S):
            rows = [f"  rank {r}: {o['call']} at {o['site']}"
                    for r, o in zip(ax.ranks, summaries, strict=True)]
            raise ConsistencyError("\n".join([
                f"check mode: ranks of axis {ax.key!r} (ranks {list(ax.ranks)}) disagree at "
                f"{label} #{seq + 1} (a rank did not post the details):", *rows]))
        return seq, [json.loads(v) for v in store.multi_get(full_keys)]


# --- public checks --------------------------------------------------------------------


def check_call(op: str, ax: Axis, tree: Any = None, **static: Any) -> None:
    """In check mode, compare this call's fingerprint across the ranks of ``ax``.

    The fingerprint is ``op``, the axis, the tree structure with every leaf's shape
    and dtype, and ``static`` (e.g. ``dim=0``, ``perm=...``, ``src=0``), plus the
    caller's site for the error message. A no-op when check mode is off or the
    axis has one rank. Reads only ``.shape``/``.dtype`` of tensors, so it runs on
    functorch-wrapped tensors (under ``vmap`` the shape is the per-example shape).

    Args:
        op: the operation's public name, e.g. ``"psum"`` or ``"shard_params.apply"``.
        ax: the resolved axis.
        tree: the tensors (or pytree of tensors and Python values) the call is given.
        **static: other arguments that must agree across ranks.

    Raises:
        ConsistencyError: on every rank of the axis, when the fingerprints differ, or
            on the ranks that arrived when some rank does not reach the check within
            the timeout.

    Example:
        >>> check_call("psum", resolve("dp"), x)
    """
    if not _active(ax):
        return
    seq, fps = _exchange(ax, fingerprint(op, ax, tree, static), "collective")
    if fps is not None:
        raise ConsistencyError(mismatch_message(ax, seq, fps, "collective"))


def check_replicated(what: str, ax: Axis, tree: Any, hint: str = INIT_HINT, *,
                     rounding: bool = False) -> None:
    """In check mode, check that ``tree``'s values are the same on every rank of ``ax``.

    Used where a value must be replicated: parameters at ``init``/``shard`` (a
    different seed per rank), a broadcast source, the values declared replicated
    (``pvary``'s input, ``psum_invariant``'s output and the gradient reaching it,
    ``sf.check_replicated``). Compares a hash of each leaf's bytes (bitwise: ``-0.0``
    and ``0.0`` differ), and names the first leaf that differs and the ranks that
    disagree. Costs one pass over the bytes (CUDA tensors are copied to the CPU first).

    Args:
        what: what is being checked, for the message (``"shard_params.init params"``).
        ax: the axis over which the values must agree.
        tree: a pytree of tensors.
        hint: the message's last sentence: what the user should do.
        rounding: let floating leaves whose bits differ pass when they differ by no more
            than rounding (a sketch of the difference, exchanged only when the bits differ:
            see :func:`~shardfn.primitives._fingerprint.beyond_rounding`).

    Raises:
        ConsistencyError: on every rank of the axis, when values differ.

    Example:
        >>> check_replicated("sf.shard input", resolve("dp"), params)
    """
    if not _active(ax):
        return
    fp = fingerprint(f"check_replicated[{what}]", ax, tree, {})
    leaves = pt.tree_leaves(tree)
    fp["hashes"] = [_leaf_hash(leaf) for leaf in leaves]
    sketches = (lambda: {"sketches": [leaf_sketch(leaf) for leaf in leaves]}) if rounding \
        else None
    seq, fps = _exchange(ax, fp, "check", sketches)
    if fps is None:
        return
    if any(comparable(other) != comparable(fp) for other in fps):
        raise ConsistencyError(mismatch_message(ax, seq, fps, "check"))
    differing = beyond_rounding(fps) if rounding else None
    if differing == {}:
        return  # the bits differ, the values only by rounding: every rank returns here
    raise ConsistencyError(replicated_message(what, ax, seq, fps, hint, differing))


def check_same(what: str, ax: Axis, values: Mapping[str, Any], hint: str = "") -> None:
    """In check mode, check that named values are the same on every rank of ``ax``.

    One exchange for the whole mapping; a tensor is compared by a hash of its bytes
    (as :func:`check_replicated`), anything else by ``str``. The error lists each name
    whose value differs, with every rank's value (``<absent>`` where a rank has none).

    Args:
        what: what is checked, for the message (``"tensor_split.apply"``).
        ax: the axis over which the values must agree.
        values: ``name -> tensor or value`` (``{"plan 'fc1'": "Colwise()", "input x": x}``).
        hint: appended to the message (what the user should do).

    Raises:
        ConsistencyError: on every rank of the axis, when a value differs.

    Example:
        >>> check_same("tensor_split.apply", resolve("tp"), {"input 0": x})
    """
    if not _active(ax):
        return
    shown = {name: f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)} #{_leaf_hash(v)}"
             if isinstance(v, torch.Tensor) else str(v) for name, v in values.items()}
    fp = fingerprint(f"check_same[{what}]", ax, None, {})
    fp["values"] = shown
    seq, fps = _exchange(ax, fp, "check")
    if fps is None:
        return
    per_name = {name: [other.get("values", {}).get(name, "<absent>") for other in fps]
                for other in fps for name in other.get("values", {})}
    rows = [f"  {name}: " + "; ".join(f"rank {r}: {v}" for r, v in zip(ax.ranks, got, strict=True))
            for name, got in per_name.items() if len(set(got)) > 1]
    if not rows:
        raise ConsistencyError(mismatch_message(ax, seq, fps, "check"))
    more = [f"  ... and {len(rows) - 8} more"] if len(rows) > 8 else []
    raise ConsistencyError("\n".join([
        f"check mode: {what}: ranks of axis {ax.key!r} (ranks {list(ax.ranks)}) disagree at "
        f"check #{seq + 1} on {len(rows)} value(s) that must be the same on every rank:",
        *rows[:8], *more, *([f"  {hint}"] if hint else [])]))
