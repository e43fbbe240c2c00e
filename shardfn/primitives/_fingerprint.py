"""Check mode's fingerprints and messages: what a rank posts, and what a mismatch says.

A fingerprint is a JSON-able dict describing one checked call: the op, the
axis, the tree structure with each leaf's shape and dtype, the static
arguments and the caller's site (the first frame outside shardfn and torch).
:func:`digest` hashes everything but the site; :func:`leaf_hash` hashes a
tensor's bytes for ``check_replicated``; :func:`leaf_sketch` and
:func:`beyond_rounding` tell a value whose bits differ only by rounding from one
that really differs (values declared replicated). The ``*_message`` functions turn the
fingerprints the ranks posted into the error text. Everything here is a pure
function of its arguments (the store is only read); the exchange itself, its
state and the public checks are in :mod:`shardfn.primitives.consistency`.

Example:
    >>> fp = fingerprint("psum", ax, torch.ones(4, 3), {})
    >>> call_text(fp)
    'psum(float32[4, 3])'
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardfn import pytree as pt
from shardfn._torch_internals import DisableFuncTorch, unwrap_functorch

if TYPE_CHECKING:
    from shardfn.primitives._comm import Axis

__all__ = [
    "call_text",
    "comparable",
    "digest",
    "beyond_rounding",
    "fingerprint",
    "leaf_hash",
    "leaf_sketch",
    "mismatch_message",
    "replicated_message",
    "timeout_message",
]

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


def call_site() -> str:
    """``file:line in function`` of the first frame outside shardfn and torch."""
    frame = sys._getframe(2)
    while frame is not None:
        shown = _shown_file(frame.f_code.co_filename)
        if shown is not None:
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown site>"


def describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):  # metadata only: works on functorch-wrapped tensors
        dims = ", ".join(str(d) for d in leaf.shape)
        return f"{str(leaf.dtype).removeprefix('torch.')}[{dims}]"
    text = _ADDRESS.sub("", repr(leaf))  # "<function f at 0x7f..>": the address is per process
    return text if len(text) <= _REPR_LIMIT else text[:_REPR_LIMIT] + "..."


def fingerprint(op: str, ax: Axis, tree: Any, static: Mapping[str, Any]) -> dict:
    names, leaves, spec = pt.tree_flatten_with_path(tree)
    return {
        "op": op,
        "axis": ax.key,
        "ranks": list(ax.ranks),
        "tree": str(spec),
        "leaves": [[n, describe_leaf(leaf)] for n, leaf in zip(names, leaves, strict=True)],
        "static": {k: describe_leaf(v) for k, v in sorted(static.items())},
        "site": call_site(),
    }


def call_text(fp: dict, max_leaves: int = 4) -> str:
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


def first_difference(a: dict, b: dict) -> str:
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


def comparable(fp: dict) -> dict:
    return {k: v for k, v in fp.items() if k not in ("site", "hashes", "sketches")}


def digest(fp: dict) -> str:
    comparable = {k: v for k, v in fp.items() if k != "site"}
    text = json.dumps(comparable, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def timeout_message(store: dist.Store, ax: Axis, prefix: str, seq: int, keys: list[str],
                    summary: dict, op: str, label: str, timeout_s: float) -> str:
    """Why a check timed out: which ranks never arrived and their last checked call."""
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
            f"{timeout_s:g} s at {label} #{seq + 1}:")
    hint = ("  (a rank skipped this call, made an extra one, raised before it, or is blocked "
            "elsewhere; raise the timeout with sf.check_consistency(True, timeout=...) or "
            "SHARDFN_CHECK_TIMEOUT if it is only slow)")
    return "\n".join([head, *lines, hint])


def mismatch_message(ax: Axis, seq: int, fps: list[dict], label: str) -> str:
    first = comparable(fps[0])
    odd = next(i for i, fp in enumerate(fps) if comparable(fp) != first)
    head = (f"check mode: ranks of axis {ax.key!r} (ranks {list(ax.ranks)}) disagree at "
            f"{label} #{seq + 1}: rank {ax.ranks[odd]} differs from rank {ax.ranks[0]} in "
            f"{first_difference(fps[0], fps[odd])}:")
    rows = [f"  rank {r}: {call_text(fp)} at {fp['site']}"
            for r, fp in zip(ax.ranks, fps, strict=True)]
    return "\n".join([head, *rows])


def leaf_hash(leaf: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    if isinstance(leaf, torch.Tensor):
        with DisableFuncTorch(), torch.no_grad():
            t = unwrap_functorch(leaf).detach()
            h.update(describe_leaf(t).encode())
            if t.device.type != "meta":  # a meta tensor has no values: shape and dtype only
                t = t.to("cpu")
                t = t.to_dense() if t.layout != torch.strided else t  # sparse: its values
                t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
                h.update(_raw_bytes(t))
    else:
        h.update(repr(leaf).encode())
    return h.hexdigest()


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, read in place through ctypes (no copy).

    Not ``t.numpy()``: it marks the storage it views non-resizable for good, and the
    caller's storage may be one that is freed by a resize later (shard_params' gathered
    parameters); a copy instead would add a leaf's size to a check-mode step's memory.
    ``t`` stays alive (and unchanged) while the caller hashes the view.
    """
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


# A value declared replicated may differ in its last bits across ranks without a bug: a GPU
# kernel with atomics sums in another order on each rank. Its sketch tells that apart from a
# real difference: 64 sums of the values with pseudo-random signs (the same on every rank),
# whose difference between two ranks estimates the norm of the values' difference.
SKETCH_BUCKETS = 64
ROUNDING_RTOL = {torch.float64: 1e-9, torch.complex128: 1e-9, torch.float32: 1e-4,
                 torch.complex64: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
INIT_HINT = "Did every rank call init with the same seed and pass the same values?"


def leaf_sketch(leaf: Any) -> dict | None:
    """A floating leaf's sketch: ``{"rtol", "norm", "sums", "special"}`` (None: compare bits).

    ``sums`` are :data:`SKETCH_BUCKETS` signed sums of the finite values (element ``i`` goes
    to bucket ``i % 64`` with a sign drawn from a fixed seed), ``norm`` their 2-norm, and
    ``special`` a hash of where the NaNs and infinities are.
    """
    if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
        return None
    with DisableFuncTorch(), torch.no_grad():
        t = unwrap_functorch(leaf).detach()
        if t.device.type == "meta" or t.layout != torch.strided:
            return None
        t = t.to("cpu").resolve_conj().resolve_neg()
        flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1).double()
        finite = torch.isfinite(flat)
        special = torch.where(finite, 0, torch.where(flat.isnan(), 1, torch.sign(flat) + 3))
        values = torch.where(finite, flat, 0.0)
        signs = torch.randint(0, 2, values.shape, generator=torch.Generator().manual_seed(0))
        signed = torch.nn.functional.pad(values * (2.0 * signs - 1), (0, -len(values) % 64))
        return {"rtol": ROUNDING_RTOL.get(leaf.dtype, 8 * torch.finfo(leaf.dtype).eps),
                "norm": float(values.norm()), "sums": signed.reshape(-1, 64).sum(0).tolist(),
                "special": leaf_hash(special.to(torch.int8))}


def beyond_rounding(fps: list[dict]) -> dict[int, float]:
    """``leaf index -> relative difference`` of every leaf whose bits differ across ranks by
    more than rounding (``inf``: a non-floating leaf, or NaNs/infinities in other places).

    The relative difference is ``|sums_r - sums_0| / max(norm_r, norm_0)`` (the largest over
    the ranks ``r``); it is beyond rounding above the dtype's :data:`ROUNDING_RTOL`.
    """
    out: dict[int, float] = {}
    for i, first in enumerate(fps[0]["hashes"]):
        if all(fp["hashes"][i] == first for fp in fps):
            continue
        sketches = [fp["sketches"][i] for fp in fps]
        if any(s is None or s["special"] != sketches[0]["special"] for s in sketches):
            out[i] = float("inf")
            continue
        worst, tolerated = 0.0, True
        for s in sketches[1:]:
            gap = sum((a - b) ** 2 for a, b in zip(s["sums"], sketches[0]["sums"],
                                                   strict=True)) ** 0.5
            scale = max(s["norm"], sketches[0]["norm"])
            worst = max(worst, gap / scale if scale > 0 else float("inf"))
            tolerated = tolerated and gap <= s["rtol"] * scale
        if not tolerated:
            out[i] = worst
    return out


def replicated_message(what: str, ax: Axis, seq: int, fps: list[dict], hint: str = INIT_HINT,
                       differing: dict[int, float] | None = None) -> str:
    """What differs in a value that must be replicated: the first leaf that differs, which
    ranks hold which value (and, from :func:`beyond_rounding`, by how much), then ``hint``."""
    per_rank = [fp["hashes"] for fp in fps]
    if differing is None:
        differing = {i: None for i in range(len(per_rank[0]))
                     if len({h[i] for h in per_rank}) > 1}
    first = min(differing)
    name = fps[0]["leaves"][first][0]
    groups: dict[str, list[int]] = {}
    for r, hashes in zip(ax.ranks, per_rank, strict=True):
        groups.setdefault(hashes[first], []).append(r)
    held = "; ".join(f"ranks {rs} hold value {h[:8]}" for h, rs in groups.items())
    if differing[first] is not None:
        held += f"; relative difference {differing[first]:.3g}"
    where = (f"the tensor differs ({held})" if name == "<root>" and len(per_rank[0]) == 1 else
             f"{len(differing)} of {len(per_rank[0])} leaves differ, the first is {name!r} "
             f"({held})")
    head = (f"check mode: {what} must be the same on every rank of axis {ax.key!r} (ranks "
            f"{list(ax.ranks)}) but differ at check #{seq + 1}: {where}. {hint}")
    rows = [f"  rank {r}: {what} at {fp['site']}" for r, fp in zip(ax.ranks, fps, strict=True)]
    return "\n".join([head, *rows])
