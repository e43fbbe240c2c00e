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
group's key-value store (a ``FileStore`` in the local world, a ``TCPStore``
under ``torchrun``), never through the axis's communicator, so it works the
same on gloo and NCCL, inside backward passes, and can time out. Each group of
ranks counts its checked calls; call ``#n`` of rank ``r`` is the key
``sfcheck/<epoch>/<group ranks>/<n>/<r>``. A rank that makes an extra or a
different call therefore disagrees with the others at that number (or, if the
others never make another checked call there, times out naming it). A key
holds a digest of the fingerprint (the full fingerprints are exchanged only on
a mismatch, for the message). A rank deletes its own key of call ``n - 1`` once
it has read every key of call ``n`` (every peer has then finished reading call
``n - 1``); a call that timed out is marked "gave up", never deleted, so no
read can block on a missing key. Comm stats do not count this traffic. See
docs/check_mode.md.

Example:
    >>> sf.check_consistency(True)     # every later collective is checked
    True
    >>> sf.check_consistency()         # -> True: the current setting
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta
from time import monotonic, sleep
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardfn import pytree as pt
from shardfn.primitives import stats

if TYPE_CHECKING:
    from shardfn.primitives._comm import Axis

__all__ = [
    "ConsistencyError",
    "check_call",
    "check_consistency",
    "check_replicated",
    "check_timeout",
    "enabled",
    "env_setting",
    "reset",
    "suspended",
]


# --- private torch names (each behind one helper; another issue gathers them in one module) ---


def _default_store() -> dist.Store:
    """The default process group's key-value store (private: ``distributed_c10d``)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _unwrap_functorch(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under functorch wrappers (grad/vmap levels); private: ``_functorch``."""
    from torch._C import _functorch

    while _functorch.is_functorch_wrapped_tensor(x):
        x = _functorch.get_unwrapped(x)
    return x


def _no_functorch() -> contextlib.AbstractContextManager:
    """Ops on unwrapped tensors run plain, not re-wrapped by an active grad/vmap (private)."""
    return torch._C._DisableFuncTorch()


def _polls_files(store: dist.Store) -> bool:
    """Whether ``store`` (under any ``PrefixStore``) is a FileStore (its ``wait`` sleeps 10 ms)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.FileStore)


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
_THREAD = threading.local()  # .suspended: checks skipped on this thread
_HELPER_THREAD_PREFIX = "shardfn-"  # shardfn's own threads ("shardfn-p2p-poster") never check


def enabled() -> bool:
    """Whether check mode is on in this process (a module-level bool: cheap in hot paths)."""
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
        _ENABLED
        and ax.size > 1
        and not getattr(_THREAD, "suspended", False)
        and not threading.current_thread().name.startswith(_HELPER_THREAD_PREFIX)
        and dist.is_initialized()
        and not torch.compiler.is_compiling()
    )


# --- fingerprints ---------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIP_DIRS = tuple(os.path.join(d, "") for d in (_PACKAGE_DIR, _TORCH_DIR))
_REPR_LIMIT = 200
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


_SHOWN: dict[str, str | None] = {}  # code file name -> as shown, or None for shardfn/torch


def _shown_file(filename: str) -> str | None:
    if filename not in _SHOWN:
        name = os.path.abspath(filename)
        if name.startswith(_SKIP_DIRS):
            _SHOWN[filename] = None
        else:
            cwd = os.path.join(os.getcwd(), "")
            _SHOWN[filename] = os.path.relpath(name) if name.startswith(cwd) else name
    return _SHOWN[filename]


def _call_site() -> str:
    """``file:line in function`` of the first frame outside shardfn and torch."""
    frame = sys._getframe(2)
    while frame is not None:
        shown = _shown_file(frame.f_code.co_filename)
        if shown is not None:
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown site>"


def _describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):  # metadata only: works on functorch-wrapped tensors
        dims = ", ".join(str(d) for d in leaf.shape)
        return f"{str(leaf.dtype).removeprefix('torch.')}[{dims}]"
    text = _ADDRESS.sub("", repr(leaf))  # "<function f at 0x7f..>": the address is per process
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def _fingerprint(op: str, ax: Axis, tree: Any, static: Mapping[str, Any]) -> dict:
    names, leaves, spec = pt.tree_flatten_with_path(tree)
    return {
        "op": op,
        "axis": ax.key,
        "ranks": list(ax.ranks),
        "tree": str(spec),
        "leaves": [[n, _describe_leaf(leaf)] for n, leaf in zip(names, leaves, strict=True)],
        "static": {k: _describe_leaf(v) for k, v in sorted(static.items())},
        "site": _call_site(),
    }


def _call_text(fp: dict, max_leaves: int = 4) -> str:
    """``psum(float32[4, 3], dim=0)`` or ``psum({a: float32[2], b: int32[3]})``."""
    leaves = fp["leaves"]
    if len(leaves) == 1 and leaves[0][0] == "<root>":
        args = [leaves[0][1]]
    else:
        shown = [f"{n}: {d}" for n, d in leaves[:max_leaves]]
        if len(leaves) > max_leaves:
            shown.append(f"... {len(leaves) - max_leaves} more")
        args = ["{" + ", ".join(shown) + "}"] if leaves else (
            [] if fp["tree"] == "PyTreeSpec(None)" else [fp["tree"]])
    args += [f"{k}={v}" for k, v in fp["static"].items()]
    return f"{fp['op']}({', '.join(args)})"


def _first_difference(a: dict, b: dict) -> str:
    """What differs between two fingerprints, for the message's first line."""
    for key, what in (("op", "the op"), ("axis", "the axis")):
        if a[key] != b[key]:
            return what
    if a["tree"] != b["tree"]:
        return f"the tree structure ({a['tree']} vs {b['tree']})"
    for (name, da), (_, db) in zip(a["leaves"], b["leaves"], strict=True):
        if da != db:
            return f"{'the tensor' if name == '<root>' else f'leaf {name!r}'} ({da} vs {db})"
    for key in sorted(set(a["static"]) | set(b["static"])):
        if a["static"].get(key) != b["static"].get(key):
            return f"argument {key}= ({a['static'].get(key)} vs {b['static'].get(key)})"
    return "the check itself (one rank checked values, another a call)"


def _comparable(fp: dict) -> dict:
    return {k: v for k, v in fp.items() if k not in ("site", "hashes")}


# --- the exchange ---------------------------------------------------------------------
#
# Round 1 (every check): each rank posts a short summary: a digest of everything compared,
# the call as text and its site. Equal digests: done. Otherwise round 2 (only on a
# mismatch, which every rank sees at once): each rank posts its whole fingerprint, so the
# message can say what differs. The store therefore carries a few hundred bytes per rank
# and check whatever the size of the tree.


def _wait_keys(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Wait until every key is set; False after ``timeout_s``.

    A TCPStore (and other stores) ``wait``: the server wakes the waiter, nothing polls
    it, and a timed-out wait leaves the client usable (tested). A FileStore's ``wait``
    sleeps 10 ms between looks: poll ``check`` with a back-off from 20 µs instead.
    """
    if not _polls_files(store):
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
            return True
        except (RuntimeError, dist.DistError):
            return store.check(keys)
    deadline = monotonic() + timeout_s
    pause = 2e-5
    while not store.check(keys):
        now = monotonic()
        if now > deadline:
            return False
        sleep(min(pause, deadline - now))
        pause = min(pause * 2, 2e-3)
    return True


def _digest(fp: dict) -> str:
    comparable = {k: v for k, v in fp.items() if k != "site"}
    text = json.dumps(comparable, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _exchange(ax: Axis, fp: dict, label: str) -> tuple[int, list[dict] | None]:
    """Post ``fp`` as the group's next checked call; ``(call number, None)`` when every rank
    posted the same, else ``(call number, every rank's fingerprint by rank)``.

    Raises:
        ConsistencyError: when a rank does not post within the timeout.
    """
    store = _default_store()
    rank = dist.get_rank()
    group = ",".join(str(r) for r in ax.ranks)
    summary = {"digest": _digest(fp), "call": _call_text(fp), "site": fp["site"]}
    with _STATE_LOCK:
        seq = _SEQ.get(ax.ranks, 0)
        _SEQ[ax.ranks] = seq + 1
        prefix = f"sfcheck/{_EPOCH[0]}/{group}/"
        mine = f"{prefix}{seq}/{rank}"
        keys = [f"{prefix}{seq}/{r}" for r in ax.ranks]
        store.set(mine, json.dumps(summary))
        deadline = monotonic() + _TIMEOUT_S
        with stats.collective_scope(f"check mode: waiting for the ranks of axis {ax.key!r} "
                                    f"{list(ax.ranks)} at {label} #{seq + 1}"):
            summaries = _read_fresh(store, keys, deadline)
        if summaries is None:
            message = _timeout_message(store, ax, prefix, seq, keys, summary, fp["op"], label)
            # Take the call back: mark the key (never delete it: a peer may be reading it) so
            # that a late peer waits for our next call at this number and pairs with that.
            with contextlib.suppress(Exception):
                store.set(mine, json.dumps({**summary, "gave_up": True}))
            _SEQ[ax.ranks] = seq
            raise ConsistencyError(message)
        if seq > 0:  # every peer has posted call seq, so none still reads our call seq - 1
            store.delete_key(f"{prefix}{seq - 1}/{rank}")
        if all(other["digest"] == summary["digest"] for other in summaries):
            return seq, None
        full_keys = [f"{prefix}{seq}/full/{r}" for r in ax.ranks]  # kept: errors are rare
        store.set(full_keys[ax.ranks.index(rank)], json.dumps(fp))
        if not _wait_keys(store, full_keys, _TIMEOUT_S):
            rows = [f"  rank {r}: {o['call']} at {o['site']}"
                    for r, o in zip(ax.ranks, summaries, strict=True)]
            raise ConsistencyError("\n".join([
                f"check mode: ranks of axis {ax.key!r} (ranks {list(ax.ranks)}) disagree at "
                f"{label} #{seq + 1} (a rank did not post the details):", *rows]))
        return seq, [json.loads(v) for v in store.multi_get(full_keys)]


def _read_fresh(store: dist.Store, keys: list[str], deadline: float) -> list[dict] | None:
    """Every key's summary once all are posted and none is a call its rank gave up on
    (that rank's next call will replace it); None at the deadline."""
    pause = 2e-5
    while True:
        if not _wait_keys(store, keys, max(0.0, deadline - monotonic())):
            return None
        summaries = [json.loads(v) for v in store.multi_get(keys)]
        if not any(other.get("gave_up") for other in summaries):
            return summaries
        if monotonic() > deadline:
            return None
        sleep(pause)
        pause = min(pause * 2, 2e-3)


def _timeout_message(store: dist.Store, ax: Axis, prefix: str, seq: int, keys: list[str],
                     summary: dict, op: str, label: str) -> str:
    here = store.check  # one key at a time: some may have arrived meanwhile
    # Keys of call seq are only ever overwritten (never deleted) while a rank waits at seq,
    # and a missing rank's key of seq - 1 stays until it has read all keys of seq: every
    # get below is of a key known to exist (a get of a missing key would block).
    posted = {r: json.loads(store.get(key))
              for r, key in zip(ax.ranks, keys, strict=True) if here([key])}
    lines = []
    for r in ax.ranks:
        if r in posted:
            continue
        last = "it made no checked call on this axis before"
        previous = f"{prefix}{seq - 1}/{r}"
        if seq > 0 and here([previous]):
            other = json.loads(store.get(previous))
            last = f"its last checked call was #{seq}: {other['call']} at {other['site']}"
        lines.append(f"  rank {r} never reached {label} #{seq + 1} ({op} over {ax.key!r} at "
                     f"{summary['site']}); {last}")
    for r, other in posted.items():
        how = "arrived, then gave up waiting" if other.get("gave_up") else "arrived"
        lines.append(f"  rank {r} {how}: {other['call']} at {other['site']}")
    head = (f"check mode: ranks of axis {ax.key!r} (ranks {list(ax.ranks)}) timed out after "
            f"{_TIMEOUT_S:g} s at {label} #{seq + 1}:")
    hint = ("  (a rank skipped this call, made an extra one, raised before it, or is blocked "
            "elsewhere; raise the timeout with sf.check_consistency(True, timeout=...) or "
            "SHARDFN_CHECK_TIMEOUT if it is only slow)")
    return "\n".join([head, *lines, hint])


def _mismatch_message(ax: Axis, seq: int, fps: list[dict], label: str) -> str:
    first = _comparable(fps[0])
    odd = next(i for i, fp in enumerate(fps) if _comparable(fp) != first)
    head = (f"check mode: ranks of axis {ax.key!r} (ranks {list(ax.ranks)}) disagree at "
            f"{label} #{seq + 1}: rank {ax.ranks[odd]} differs from rank {ax.ranks[0]} in "
            f"{_first_difference(fps[0], fps[odd])}:")
    rows = [f"  rank {r}: {_call_text(fp)} at {fp['site']}"
            for r, fp in zip(ax.ranks, fps, strict=True)]
    return "\n".join([head, *rows])


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
    seq, fps = _exchange(ax, _fingerprint(op, ax, tree, static), "collective")
    if fps is not None:
        raise ConsistencyError(_mismatch_message(ax, seq, fps, "collective"))


def _leaf_hash(leaf: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    if isinstance(leaf, torch.Tensor):
        with _no_functorch(), torch.no_grad():
            t = _unwrap_functorch(leaf).detach()
            h.update(_describe_leaf(t).encode())
            if t.device.type != "meta":  # a meta tensor has no values: shape and dtype only
                t = t.to("cpu")
                t = t.to_dense() if t.layout != torch.strided else t  # sparse: its values
                t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
                h.update(memoryview(t.view(torch.uint8).numpy()))
    else:
        h.update(repr(leaf).encode())
    return h.hexdigest()


def check_replicated(what: str, ax: Axis, tree: Any) -> None:
    """In check mode, check that ``tree``'s values are the same on every rank of ``ax``.

    Used where a value must be replicated: parameters at ``init``/``shard`` (a
    different seed per rank), a broadcast source. Compares a hash of each leaf's
    bytes (bitwise: ``-0.0`` and ``0.0`` differ), and names the first leaf that
    differs and the ranks that disagree. Costs one pass over the bytes (CUDA
    tensors are copied to the CPU first).

    Args:
        what: what is being checked, for the message (``"shard_params.init params"``).
        ax: the axis over which the values must agree.
        tree: a pytree of tensors.

    Raises:
        ConsistencyError: on every rank of the axis, when values differ.

    Example:
        >>> check_replicated("sf.shard input", resolve("dp"), params)
    """
    if not _active(ax):
        return
    fp = _fingerprint(f"check_replicated[{what}]", ax, tree, {})
    fp["hashes"] = [_leaf_hash(leaf) for leaf in pt.tree_leaves(tree)]
    seq, fps = _exchange(ax, fp, "check")
    if fps is None:
        return
    if any(_comparable(other) != _comparable(fp) for other in fps):
        raise ConsistencyError(_mismatch_message(ax, seq, fps, "check"))
    raise ConsistencyError(_replicated_message(what, ax, seq, fps))


def _replicated_message(what: str, ax: Axis, seq: int, fps: list[dict]) -> str:
    per_rank = [fp["hashes"] for fp in fps]
    differing = [i for i in range(len(per_rank[0])) if len({h[i] for h in per_rank}) > 1]
    first = differing[0]
    name = fps[0]["leaves"][first][0]
    groups: dict[str, list[int]] = {}
    for r, hashes in zip(ax.ranks, per_rank, strict=True):
        groups.setdefault(hashes[first], []).append(r)
    held = "; ".join(f"ranks {rs} hold value {h[:8]}" for h, rs in groups.items())
    head = (f"check mode: {what} must be the same on every rank of axis {ax.key!r} (ranks "
            f"{list(ax.ranks)}) but differ at check #{seq + 1}: {len(differing)} of "
            f"{len(per_rank[0])} leaves differ, the first is {name!r} ({held}). Did every rank "
            f"call init with the same seed and pass the same values?")
    rows = [f"  rank {r}: {what} at {fp['site']}" for r, fp in zip(ax.ranks, fps, strict=True)]
    return "\n".join([head, *rows])
