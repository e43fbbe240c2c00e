"""Stage-boundary shapes: declared (``shapes=``), inferred once per batch signature, or dynamic.

Every message carries a header (status, and per tensor its dtype and shape).
When the receiver does not know the shapes it must wait for the header before
it can post the payloads: one round trip more per message. Three modes:

* ``shapes=None`` (the default, as ``torch.distributed.pipelining`` infers shapes
  at the first step): the first call for a *batch signature* (the inputs' and
  targets' structure, each tensor's shape and dtype and each plain value, the
  micro-batch count, the autocast state) exchanges headers first;
  the activation shapes it found are cached in the pipeline model
  (:class:`ShapeCache`) and later calls with that signature declare them. A
  later stage output that differs raises on its rank (every rank stops), and the
  message says to pass ``shapes="dynamic"``.
* ``shapes="dynamic"``: headers first on every message, every call.
* ``shapes=<declarations>``: one per stage boundary (or one for all), parsed by
  :func:`parse_shapes`; a tuple output is declared by a tuple of entries.

Example:
    >>> parse_shapes([((2, 8), ((2, 8), torch.int64))], 1)   # one boundary, a tuple
    ((Declared(shape=(2, 8), dtype=torch.float32), Declared(shape=(2, 8), dtype=torch.int64)),)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Literal

import torch

from shardfn.transforms.pipeline._p2p import Declared, DeclaredValue

__all__ = ["DYNAMIC", "Dynamic", "ShapeCache", "cache_key", "parse_shapes"]

#: ``shapes="dynamic"``: exchange shapes in a header before every payload, every call
Dynamic = Literal["dynamic"]
DYNAMIC: Dynamic = "dynamic"


def _is_shape(entry: Any) -> bool:
    return isinstance(entry, (tuple, list, torch.Size)) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in entry)


def _one(entry: Any) -> Declared | None:
    """One tensor's declaration: a shape, an object with ``.shape``/``.dtype``
    (``sf.ShapeDtype``), or a ``(shape, dtype)`` pair; None if ``entry`` is none."""
    if hasattr(entry, "shape") and hasattr(entry, "dtype"):
        return Declared(tuple(int(d) for d in entry.shape), entry.dtype)
    if _is_shape(entry):
        return Declared(tuple(entry), torch.get_default_dtype())
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and _is_shape(entry[0]) and \
            isinstance(entry[1], torch.dtype):
        return Declared(tuple(entry[0]), entry[1])
    return None


def _boundary(entry: Any, where: str) -> DeclaredValue:
    found = _one(entry)
    if found is not None:
        return found
    if isinstance(entry, (tuple, list)) and entry:
        parts = [None if e is None else _one(e) for e in entry]
        if all(p is not None or e is None for p, e in zip(parts, entry, strict=True)):
            return tuple(parts)
    raise TypeError(f"shapes= {where} is {entry!r}: give a shape (a tuple of ints), a (shape, "
                    "dtype) pair or an sf.ShapeDtype, or for a tuple output a tuple of those "
                    "(None for a None entry)")


def parse_shapes(shapes: Any, n_boundaries: int) -> tuple[DeclaredValue, ...] | None:
    """``shapes=`` as one :data:`~._p2p.DeclaredValue` per stage boundary, or None
    (not declared: ``None`` or ``"dynamic"``).

    Args:
        shapes: one declaration for every boundary (a shape, ``(shape, dtype)`` or
            ``sf.ShapeDtype``), or a list with one per boundary, each a declaration or a
            tuple of them (a tuple output).
        n_boundaries: stages - 1.

    Raises:
        TypeError: an entry that is none of these.
        ValueError: a list whose length is not ``n_boundaries``, or an unknown string.
    """
    if shapes is None or shapes == DYNAMIC:
        return None
    if isinstance(shapes, str):
        raise ValueError(f"shapes={shapes!r}: use None (inferred at the first step), "
                         f"{DYNAMIC!r} (a header with every message) or declarations")
    one = _one(shapes)
    if one is not None:
        return (one,) * n_boundaries
    entries = list(shapes)
    if len(entries) != n_boundaries:
        raise ValueError(f"shapes= has {len(entries)} entries, but the pipeline has "
                         f"{n_boundaries} stage boundaries (stages - 1): give one output "
                         "shape per stage except the last, or one shape for all")
    return tuple(_boundary(e, f"entry {b} (output of stage {b})") for b, e in enumerate(entries))


def cache_key(agreed: tuple[int, int] | None, microbatches: int) -> tuple | None:
    """The batch signature shapes are cached under: the digests of the inputs' and targets'
    structure, every tensor leaf's shape and dtype and every plain value
    (:func:`~.batch.shape_digest`) that the pp ranks passing them agreed on
    (``agree_on_batch``'s result: the same on every pp rank, also on one given None for a
    side it does not read), the micro-batch count and the autocast state; None (no cache:
    headers every call) when ``agreed`` is None (a leaf neither a tensor nor a plain value).

    Example:
        >>> cache_key(agree_on_step(pp.plan, x, y, "value_and_grad"), 4)
    """
    if agreed is None:
        return None
    autocast = tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                     if torch.is_autocast_enabled(device))  # it changes activation dtypes
    return *agreed, microbatches, autocast


class ShapeCache:
    """One pipeline model's inferred shapes: batch signature -> activation shapes of this rank.

    Example:
        >>> cache = ShapeCache()
        >>> cache.get(sig) is None          # first call: headers first
        >>> cache.put(sig, report.shapes)   # after a call that succeeded on this rank
    """

    def __init__(self) -> None:
        self._found: dict[tuple, Mapping[tuple, DeclaredValue]] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple | None) -> Mapping[tuple, DeclaredValue] | None:
        if key is None:
            return None
        with self._lock:
            return self._found.get(key)

    def put(self, key: tuple | None, shapes: Mapping[tuple, DeclaredValue]) -> None:
        if key is not None:
            with self._lock:
                self._found[key] = dict(shapes)

    def clear(self) -> None:
        """Forget every inferred shape (the next call of each signature infers again)."""
        with self._lock:
            self._found.clear()

    def __len__(self) -> int:
        return len(self._found)
