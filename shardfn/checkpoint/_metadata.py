"""Reading DCP's ``.metadata`` without running code from it, and checking what it says.

DCP's reader loads ``.metadata`` with ``pickle.load``, which calls any function a
crafted file names (``os.system``...): loading a checkpoint from elsewhere would
run its code, checksums or not (the commit marker is written by the same hand).
:func:`read_metadata` unpickles it with an allow-list instead: DCP's metadata
classes, ``torch.Size``, the dtypes and layouts, the memory-format enum and the
path class a ``StorageMeta`` holds; every other global is refused, naming the
file and the global, before anything is called. It then checks the structure
(:func:`check_metadata`): each entry's kind, shape, dtype and chunks (inside the
tensor), each stored item's file (a plain name in the checkpoint directory),
offset and length, so that a damaged file fails here, naming itself, and not
deep inside DCP. :func:`check_coverage` checks that the stored chunks a load reads
tile each of this rank's chunks exactly (no region left unread).

The allow-list is what DCP's writer puts in the file (recorded from real saves of
every layout the tests use); the classes are only constructed (``__new__``,
their own ``__setstate__``/``__init__``, a dict update), none reads or writes a
file or calls out.

Example:
    >>> metadata = read_metadata(Path("ckpt/step_000100"))   # CorruptCheckpointError if bad
"""

from __future__ import annotations

import io
import math
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.serialization
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from shardfn.checkpoint.errors import CorruptCheckpointError

__all__ = ["allowed_globals", "check_coverage", "check_metadata", "read_metadata"]

_METADATA = ".metadata"
_DCP_CLASSES = ("Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                "_MEM_FORMAT_ENCODING")
_STORAGE_INFO = "_StorageInfo"  # DCP's file system reader's record of where an item is
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")


def allowed_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object``: every global a DCP metadata file may name."""
    found: dict[tuple[str, str], Any] = {}
    metadata_module = dcp_metadata.__name__
    for name in _DCP_CLASSES:
        found[(metadata_module, name)] = getattr(dcp_metadata, name)
    found[(dcp_filesystem.__name__, _STORAGE_INFO)] = getattr(dcp_filesystem, _STORAGE_INFO)
    found[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            found[("torch", name)] = value
    get_layout = "_get_layout"  # a lookup in a table of torch.layout values
    found[(torch.serialization.__name__, get_layout)] = getattr(torch.serialization,
                                                                get_layout)
    for module in ("pathlib", "pathlib._local"):  # the writer's Python: 3.13 moved them
        for name in _PATHS:
            found[(module, name)] = getattr(pathlib, name)
    found[("collections", "OrderedDict")] = OrderedDict
    return found


_ALLOWED: dict[tuple[str, str], Any] = {}


def _allowed() -> dict[tuple[str, str], Any]:
    if not _ALLOWED:
        _ALLOWED.update(allowed_globals())
    return _ALLOWED


class _Unpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving only :func:`allowed_globals` (no persistent ids)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (its dotted name is the message)."""


def read_metadata(directory: str | Path, name: str = _METADATA) -> Metadata:
    """The checked :class:`Metadata` of the DCP checkpoint in ``directory``, unpickled with
    the allow-list.

    Args:
        directory: the checkpoint directory.
        name: the metadata file's name in it.

    Returns:
        DCP's ``Metadata``, its structure checked (:func:`check_metadata`).

    Raises:
        CorruptCheckpointError: naming the file: it names a global outside the allow-list
            (and could run code), does not parse, or does not hold valid metadata.

    Example:
        >>> md = read_metadata("ckpt/step_000100")
    """
    file = Path(directory) / name
    where = f"checkpoint {str(directory)!r}: file {name!r}"
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise CorruptCheckpointError(f"{where} cannot be read: {err}") from err
    try:
        metadata = _Unpickler(io.BytesIO(raw)).load()
    except _Refused as err:
        raise CorruptCheckpointError(
            f"{where} names {err}, which DCP metadata never holds: refused, unpickling it "
            "could run code (the file is not DCP metadata, or was crafted); only DCP's "
            "metadata classes and the torch types they hold are loaded") from None
    except Exception as err:  # noqa: BLE001 - any parse failure: the file is damaged
        raise CorruptCheckpointError(f"{where} is not valid DCP metadata (truncated or "
                                     f"damaged): {type(err).__name__}: {err}") from None
    check_metadata(metadata, where)
    return metadata


def _ints(value: Any, what: str, where: str, length: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(
            type(v) is int and v >= 0 for v in value) or (length is not None and
                                                         len(value) != length):
        raise CorruptCheckpointError(f"{where}: {what} is {value!r}, not "
                                     f"{'a' if length is None else length} non-negative ints")
    return tuple(value)


def _field(obj: Any, name: str, kinds: type | tuple, where: str) -> Any:
    """``obj.name``, checked to be one of ``kinds`` (a damaged file may lack it)."""
    value = getattr(obj, name, _field)
    if not isinstance(value, kinds):
        got = "nothing" if value is _field else type(value).__name__
        raise CorruptCheckpointError(f"{where}: a {type(obj).__name__}'s {name!r} is {got}")
    return value


def _check_tensor(key: str, md: Any, where: str) -> None:
    what = f"entry {key!r}"
    properties = _field(md, "properties", TensorProperties, f"{where}: {what}")
    _field(properties, "dtype", torch.dtype, f"{where}: {what}")
    size = _ints(_field(md, "size", tuple, where), f"{what}'s shape", where)
    for chunk in _field(md, "chunks", list, f"{where}: {what}"):
        if not isinstance(chunk, ChunkStorageMetadata):
            raise CorruptCheckpointError(f"{where}: {what} holds a chunk of type "
                                         f"{type(chunk).__name__}")
        lo = _ints(_field(chunk, "offsets", tuple, where), f"a chunk offset of {key!r}",
                   where, len(size))
        sizes = _ints(_field(chunk, "sizes", tuple, where), f"a chunk size of {key!r}",
                      where, len(size))
        if any(o + s > n for o, s, n in zip(lo, sizes, size, strict=True)):
            raise CorruptCheckpointError(f"{where}: a chunk of {key!r} (offsets {lo}, sizes "
                                         f"{sizes}) leaves its tensor of shape {size}")


def _check_storage(storage: dict, where: str) -> None:
    info_type = _allowed()[(dcp_filesystem.__name__, _STORAGE_INFO)]
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, info_type):
            raise CorruptCheckpointError(f"{where}: its storage table holds "
                                         f"{type(index).__name__} -> {type(info).__name__}")
        fqn = _field(index, "fqn", str, where)
        name = _field(info, "relative_path", str, where)
        if Path(name).name != name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"{where}: item {fqn!r} is stored in {name!r}, "
                                         "not a file of the checkpoint directory")
        _ints((_field(info, "offset", int, where), _field(info, "length", int, where)),
              f"item {fqn!r}'s offset and length", where)
        _field(info, "transform_descriptors", (list, tuple, type(None)), where)


_SEQUENCES = (torch.Size, tuple, list)
_INT = {int}


def _is_ints(value: Any, length: int | None = None) -> bool:
    """Whether ``value`` is a sequence of non-negative ints (of ``length``): the fast
    check (C-level ``map``/``min``); the slow one (:func:`_ints`) words the error."""
    return type(value) in _SEQUENCES and (length is None or len(value) == length) and \
        set(map(type, value)) <= _INT and (not value or min(value) >= 0)


def _tensor_ok(md: Any) -> bool:
    properties, size = getattr(md, "properties", None), getattr(md, "size", None)
    chunks = getattr(md, "chunks", None)
    if type(properties) is not TensorProperties or type(chunks) is not list or \
            type(getattr(properties, "dtype", None)) is not torch.dtype or not _is_ints(size):
        return False
    for chunk in chunks:
        lo, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if type(chunk) is not ChunkStorageMetadata or not _is_ints(lo, len(size)) or \
                not _is_ints(sizes, len(size)) or any(map(int.__gt__, map(int.__add__, lo,
                                                                          sizes), size)):
            return False
    return True


def _stored_ok(index: Any, info: Any, info_type: type, names: set[str]) -> bool:
    name = getattr(info, "relative_path", None)
    if type(index) is not MetadataIndex or type(info) is not info_type or \
            type(getattr(index, "fqn", None)) is not str or type(name) is not str or \
            not _is_ints((getattr(info, "offset", None), getattr(info, "length", None))) or \
            not isinstance(getattr(info, "transform_descriptors", None), list | tuple | None):
        return False
    if name not in names:
        if Path(name).name != name or name in ("", ".", ".."):
            return False
        names.add(name)
    return True


def check_metadata(metadata: Any, where: str) -> None:
    """Check that ``metadata`` is DCP metadata a load can use.

    Args:
        metadata: what ``.metadata`` unpickled to.
        where: how errors name the file (``"checkpoint 'c': file '.metadata'"``).

    Raises:
        CorruptCheckpointError: naming the file and what is wrong.

    Example:
        >>> check_metadata(metadata, "checkpoint 'c': file '.metadata'")
    """
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP "
                                     "Metadata")
    for key, md in _field(metadata, "state_dict_metadata", dict, where).items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{where}: an entry's key is {key!r}, not a string")
        if type(md) is TensorStorageMetadata:
            if not _tensor_ok(md):
                _check_tensor(key, md, where)  # raises, saying what is wrong
                raise CorruptCheckpointError(f"{where}: entry {key!r} is malformed")
        elif type(md) is not BytesStorageMetadata:
            raise CorruptCheckpointError(f"{where}: entry {key!r} is a {type(md).__name__}")
    storage = _field(metadata, "storage_data", dict, where)
    info_type, names = _allowed()[(dcp_filesystem.__name__, _STORAGE_INFO)], set()
    if not all(_stored_ok(i, info, info_type, names) for i, info in storage.items()):
        _check_storage(storage, where)  # raises, saying what is wrong
        raise CorruptCheckpointError(f"{where}: its storage table is malformed")
    _field(metadata, "storage_meta", (StorageMeta, type(None)), where)


def _overlap(a: tuple, b: tuple) -> bool:
    (lo_a, n_a), (lo_b, n_b) = a, b
    return all(x < y + m and y < x + n for x, n, y, m in zip(lo_a, n_a, lo_b, n_b, strict=True))


def check_coverage(items: list, chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]],
                   where: str) -> None:
    """Check that the read items tile each of this rank's chunks exactly.

    Args:
        items: the local load plan's ``ReadItem``s of tensors.
        chunk_sizes: ``(key, chunk offsets) -> chunk sizes`` of every chunk this rank loads.
        where: how errors name the checkpoint.

    Raises:
        CorruptCheckpointError: a chunk that the stored chunks leave partly unread, or
            that two stored chunks both write (the metadata's chunks overlap).

    Example:
        >>> check_coverage(plan.items, {("w", (0, 0)): (4, 8)}, "checkpoint 'c'")
    """
    pieces: dict[tuple[str, tuple[int, ...]], list[tuple]] = {k: [] for k in chunk_sizes}
    for item in items:
        key = (item.dest_index.fqn, tuple(item.dest_index.offset))
        pieces.setdefault(key, []).append((tuple(item.dest_offsets), tuple(item.lengths)))
    for key, boxes in pieces.items():
        sizes = chunk_sizes.get(key)
        volume = sum(math.prod(n) for _, n in boxes)
        overlapping = len(boxes) > 1 and (_overlap_any(boxes) if len(boxes) <= 64 else
                                          _overlap_counted(boxes, sizes))
        if sizes is None or volume != math.prod(sizes) or overlapping:
            raise CorruptCheckpointError(
                f"{where}: the stored chunks of {key[0]!r} do not tile it (its part at "
                f"{key[1]} of size {sizes}: {volume} elements stored"
                f"{', some twice' if overlapping else ''}); the metadata is damaged")


def _overlap_any(boxes: list[tuple]) -> bool:
    full = [b for b in boxes if all(b[1])]
    return any(_overlap(a, b) for i, a in enumerate(full) for b in full[i + 1:])


def _overlap_counted(boxes: list[tuple], sizes: tuple[int, ...] | None) -> bool:
    """Many pieces: count the writes per element (vectorised) instead of pairs."""
    if sizes is None:
        return False
    count = torch.zeros(sizes, dtype=torch.int32)
    for lo, n in boxes:
        view = count
        for dim, (start, length) in enumerate(zip(lo, n, strict=True)):
            view = view.narrow(dim, start, length)
        view += 1
    return bool((count > 1).any())
