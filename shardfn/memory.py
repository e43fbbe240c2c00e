"""Memory tracker: live bytes of the tensors a block of code allocates, by category.

``track()`` pushes a ``TorchDispatchMode`` that sees the outputs of every torch op
run inside the block: plain ops, ops inside autograd backward, inside
``torch.func`` transforms, inside ``autograd.Function`` forward/backward and the
outputs of collectives. Each output whose storage is new (not one of the op's
inputs' storages, not already counted) is counted once, with the category that
was innermost when it was made, and a weak reference to its storage subtracts it
again when the storage is freed (or resized in place with
FSDP's storage resize op, ``resize_storage_bytes_``: 0 bytes counts as freed). Views
share their base's storage, so they count once; a tensor kept alive by autograd
stays counted until the graph releases it.

What is counted: storages created by torch ops inside the block, on any device
(or only ``device=`` ones). Not counted: tensors that existed before the block
(even if freed inside), allocator rounding and workspace, and memory allocated
outside torch ops. On CUDA the tracker also reads ``torch.cuda`` memory stats
(``cuda_peak_bytes``), which include all of that.

Categories and the tracker stack are process-wide (not per thread), so ops that
the autograd engine runs on its own threads are tagged like the caller's.

Example:
    >>> import shardfn.memory as mem
    >>> with mem.track() as t:
    ...     with mem.category("activations"):
    ...         a = torch.empty(1024, dtype=torch.uint8)
    ...     mem.mark("after_a")
    ...     del a
    >>> t.peak_bytes, t.peak_by_category, t.current_bytes, t.marks
    (1024, {'activations': 1024}, 0, {'after_a': 1024})
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

from shardfn._torch_internals import (
    TorchDispatchMode,
    resize_storage_bytes_,
    torch_tree_leaves,
    unwrap_functorch,
)

__all__ = ["MemoryTracker", "category", "current_category", "mark", "track"]

OTHER = "other"

_CATEGORIES: list[str] = []  # innermost last
_ACTIVE: list[MemoryTracker] = []  # innermost last
_RESIZE_STORAGE = resize_storage_bytes_.default


def current_category() -> str:
    """The innermost active category name (``"other"`` outside any ``category`` block)."""
    return _CATEGORIES[-1] if _CATEGORIES else OTHER


@contextlib.contextmanager
def category(name: str) -> Iterator[None]:
    """Tag the tensors allocated inside this block with ``name`` (innermost wins).

    Args:
        name: the category, e.g. ``"gathered_params"`` or ``"activations"``.

    Example:
        >>> with mem.track() as t, mem.category("grads"):
        ...     g = torch.zeros(10)
        >>> t.max_by_category["grads"]
        40
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"mem.category takes a non-empty string name, got {name!r}")
    _CATEGORIES.append(name)
    try:
        yield
    finally:
        _CATEGORIES.pop()


def mark(name: str) -> None:
    """Record the live bytes under ``name`` in every active tracker (no-op without one).

    Example:
        >>> with mem.track() as t:
        ...     x = torch.zeros(4)
        ...     mem.mark("x")
        >>> t.marks
        {'x': 16}
    """
    for tracker in list(_ACTIVE):
        tracker._mark(name)


def _storage_of(t: torch.Tensor, device_type: str | None) -> torch.UntypedStorage | None:
    t = unwrap_functorch(t)
    if t.device.type == "meta" or (device_type is not None and t.device.type != device_type):
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested or wrapper-subclass tensors have no plain storage
    return storage if storage.nbytes() > 0 else None


class _AllocationMode(TorchDispatchMode):
    """Reports the outputs of every op to the tracker."""

    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _RESIZE_STORAGE:  # frees or regrows a storage in place (FSDP's trick)
            self.tracker._resized(args[0])
        else:
            self.tracker._record(out, args, kwargs)
        return out


class MemoryTracker:
    """What ``track()`` yields; read its fields during or after the block.

    Attributes:
        peak_bytes: the peak of live bytes of tensors allocated inside the block.
        peak_by_category: live bytes per category at the moment of that peak
            (categories with zero bytes left out; values sum to ``peak_bytes``).
        max_by_category: each category's own maximum of live bytes over the block.
        current_bytes: live bytes now (frozen at exit).
        current_by_category: live bytes per category now (frozen at exit).
        marks: ``{name: live bytes}`` recorded by :func:`mark`.
        cuda_peak_bytes: on CUDA, ``torch.cuda.max_memory_allocated()`` over the
            block minus the allocated bytes at entry (includes allocator rounding,
            workspaces and anything else on the device); ``None`` without CUDA.
    """

    def __init__(self, device: str | torch.device | None = None):
        self.device_type = None if device is None else torch.device(device).type
        self.peak_bytes = 0
        self.peak_by_category: dict[str, int] = {}
        self.max_by_category: dict[str, int] = {}
        self.marks: dict[str, int] = {}
        self.cuda_peak_bytes: int | None = None
        self._current = 0
        self._live_by_category: dict[str, int] = {}
        self._live: dict[int, tuple[weakref.ref, int, str]] = {}  # id(storage) -> entry
        self._lock = threading.RLock()
        self._open = False
        self._cuda_base = 0
        self._cuda_max = 0

    @property
    def current_bytes(self) -> int:
        return self._current

    @property
    def current_by_category(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self._live_by_category.items() if v}

    def __repr__(self) -> str:
        return (f"MemoryTracker(peak_bytes={self.peak_bytes}, current_bytes={self._current}, "
                f"peak_by_category={self.peak_by_category})")

    # -- recording ---------------------------------------------------------------------
    def _record(self, out, args, kwargs) -> None:
        input_ids: set[int] | None = None
        for t in torch_tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = _storage_of(t, self.device_type)
            if storage is None:
                continue
            key = id(storage)  # storages keep their Python object while alive
            if self._follow_size(key, storage.nbytes()):
                continue
            if input_ids is None:
                input_ids = self._input_storage_ids(args, kwargs)
            if key in input_ids:
                continue  # in-place or view on a tensor from before the block
            self._allocate(key, storage)

    def _resized(self, t: torch.Tensor) -> None:
        """A storage changed size in place: a counted one changes its bytes (to 0 when
        freed); one from before the block counts from when it grows."""
        t = unwrap_functorch(t)
        if self.device_type is not None and t.device.type != self.device_type:
            return
        storage = t.untyped_storage()
        if not self._follow_size(id(storage), storage.nbytes()) and storage.nbytes() > 0:
            self._allocate(id(storage), storage)

    def _follow_size(self, key: int, nbytes: int) -> bool:
        """If storage ``key`` is counted, count it at ``nbytes`` now (it may have been
        resized in place) and return True."""
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return False
            if entry[1] != nbytes:
                self._add(key, nbytes - entry[1], entry[2])
                self._live[key] = (entry[0], nbytes, entry[2])
            return True

    def _input_storage_ids(self, args, kwargs) -> set[int]:
        ids = set()
        for t in torch_tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                storage = _storage_of(t, None)
                if storage is not None:
                    ids.add(id(storage))
        return ids

    def _allocate(self, key: int, storage: torch.UntypedStorage) -> None:
        nbytes, cat = storage.nbytes(), current_category()
        ref = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        with self._lock:
            if not self._open:
                return
            self._live[key] = (ref, nbytes, cat)
            self._add(key, nbytes, cat)

    def _add(self, key: int, nbytes: int, cat: str) -> None:
        live = self._live_by_category
        live[cat] = live.get(cat, 0) + nbytes
        self._current += nbytes
        if live[cat] > self.max_by_category.get(cat, 0):
            self.max_by_category[cat] = live[cat]
        if self._current > self.peak_bytes:
            self.peak_bytes = self._current
            self.peak_by_category = {k: v for k, v in live.items() if v}

    def _free(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._live_by_category[entry[2]] -= entry[1]
                self._current -= entry[1]

    def _mark(self, name: str) -> None:
        with self._lock:
            self.marks[name] = self._current

    # -- lifetime ----------------------------------------------------------------------
    def _enter_cuda(self) -> None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        peak_now = torch.cuda.max_memory_allocated()
        for outer in _ACTIVE:  # resetting the peak below must not lose the outer ones'
            outer._cuda_max = max(outer._cuda_max, peak_now)
        self._cuda_base = torch.cuda.memory_allocated()
        self._cuda_max = self._cuda_base
        torch.cuda.reset_peak_memory_stats()

    def _exit_cuda(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = max(self._cuda_max, torch.cuda.max_memory_allocated())
            self.cuda_peak_bytes = peak - self._cuda_base

    def _close(self) -> None:
        with self._lock:
            self._open = False
            self._live_by_category = {k: v for k, v in self._live_by_category.items() if v}
            self._live.clear()  # drops the weak references: no callbacks after exit


@contextlib.contextmanager
def track(device: str | torch.device | None = None) -> Iterator[MemoryTracker]:
    """Count the live bytes of tensors allocated inside the block; yields the tracker.

    Works on CPU and CUDA, under plain autograd and ``torch.func`` transforms.
    Trackers nest (each counts its own block). Overhead: one Python call per op.

    Args:
        device: count only tensors on this device type (``"cuda"``, ``"cpu"``);
            ``None`` counts every non-meta device.

    Returns:
        A :class:`MemoryTracker` (``peak_bytes``, ``peak_by_category``,
        ``max_by_category``, ``current_bytes``, ``marks``, ``cuda_peak_bytes``).

    Example:
        >>> with mem.track() as t:
        ...     y = torch.randn(256, 256) @ torch.randn(256, 256)
        >>> t.current_bytes          # y is alive; the two operands were freed
        262144
    """
    tracker = MemoryTracker(device)
    tracker._open = True
    tracker._enter_cuda()
    _ACTIVE.append(tracker)
    try:
        with _AllocationMode(tracker):
            yield tracker
    finally:
        _ACTIVE.remove(tracker)
        tracker._exit_cuda()
        tracker._close()
