"""Reading a checkpoint's files once, checking their checksums on the bytes read.

A :class:`VerifyingReader` is DCP's file-system reader with its ``read_data``
replaced: each file is read front to back, once; every stored item this rank
needs is read whole (one read) and loaded from those bytes (a plain tensor
without ``torch.load``'s Python unpickler, :mod:`._zipread`), and, for the files
this rank verifies, the bytes between them are read too, so the file's size
and CRC-32 are computed on exactly the bytes read and compared with the
manifest. A compressed item (``save(..., compression=)``) is decompressed
from the bytes read, a tensor chunk to at most its own size. A file that no
rank reads is checked by one rank with a plain pass. A file whose bytes fail
to parse (or to decompress) is checked whole before the error is raised, so a
corrupted file is always reported as such, by name.

The read plan is made locally (DCP's global load plan changes nothing for a
file-system reader), so a load needs none of DCP's collectives.

Example:
    >>> reader = VerifyingReader("ckpt/step_000100", manifest)
    >>> planner, plan = read_plan(targets, reader, rank)
    >>> reader.assign(verify={"__0_0.distcp"}, check_only=set())
    >>> read(planner, plan, reader)
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.futures import Future

from shardfn.checkpoint import _commit
from shardfn.checkpoint._compress import decode, transforms_of
from shardfn.checkpoint._dcp import Reader, _LoadPlanner, _Target
from shardfn.checkpoint._metadata import check_coverage
from shardfn.checkpoint._zipread import plain_tensor
from shardfn.checkpoint.errors import CheckpointError, CorruptCheckpointError

__all__ = ["VerifyingReader", "assign_files", "read", "read_plan"]

_BLOCK = 1 << 22
_WRAPPING = 1 << 20  # torch.save's zip records around a tensor's bytes: far less than this


class VerifyingReader(Reader):
    """DCP's reader of one checkpoint that reads each file once and checks the checksums
    of the files it is given (:meth:`assign`) on the bytes it reads.

    Args:
        path: the checkpoint directory.
        manifest: its manifest (None: check nothing).
    """

    def __init__(self, path: str, manifest: dict[str, Any] | None) -> None:
        super().__init__(path)
        self.manifest = manifest
        self.verify: set[str] = set()
        self.check_only: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.manifest is not None and self.cached_metadata is None and not (args or kwargs):
            _commit.check_digest(self.path, ".metadata", self.manifest,
                                 _commit.file_digest(Path(self.path) / ".metadata"))
        return super().read_metadata(*args, **kwargs)

    def assign(self, verify: set[str], check_only: set[str]) -> None:
        """Files whose checksums this rank checks: while reading them (``verify``), or
        in a pass of their own (``check_only``: files no rank reads)."""
        self.verify, self.check_only = set(verify), set(check_only)

    def read_data(self, plan: LoadPlan, planner) -> Future:
        per_file: dict[str, dict[Any, list[ReadItem]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            stored = per_file.setdefault(info.relative_path, {})
            stored.setdefault((info.offset, info.length), []).append(item)
        for name, stored in per_file.items():
            self._read_file(name, stored, planner)
        for name in sorted(self.check_only - set(per_file)):
            self._check_whole(name)
        future: Future = Future()
        future.set_result(None)
        return future

    def _check_whole(self, name: str) -> None:
        if self.manifest is not None and name in self.manifest["files"]:
            _commit.check_digest(self.path, name, self.manifest,
                                 _commit.file_digest(Path(self.path) / name))

    def _read_file(self, name: str, stored: dict[tuple[int, int], list[ReadItem]],
                   planner) -> None:
        verify = self.manifest is not None and name in self.verify
        crc, pos = 0, 0
        try:
            with open(Path(self.path) / name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                for (offset, length), items in sorted(stored.items()):
                    if offset + length > size:  # before allocating for it
                        raise CorruptCheckpointError(
                            f"checkpoint {str(self.path)!r}: file {name!r} is truncated: "
                            f"{size} bytes, an item ends at {offset + length}")
                    if verify and offset >= pos:
                        gap = f.read(offset - pos)
                        crc, pos = _commit.crc32(gap, crc), pos + len(gap)
                    else:  # not checked here (or items overlap): go to the item
                        verify = False
                        f.seek(offset)
                    data = memoryview(torch.empty(length, dtype=torch.uint8).numpy())
                    got = f.readinto(data)  # into memory not zeroed first
                    if got != length:
                        raise CorruptCheckpointError(
                            f"checkpoint {str(self.path)!r}: file {name!r} is truncated: "
                            f"{offset + got} bytes, an item ends at {offset + length}")
                    if verify:
                        crc, pos = _commit.crc32(data, crc), pos + length
                    _load_item(self._decoded(name, data, items[0], planner), items, planner)
                while verify and (block := f.read(_BLOCK)):
                    crc, pos = _commit.crc32(block, crc), pos + len(block)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure to read or parse the file
            self._check_whole(name)  # a corrupted file: say so, naming it
            raise CorruptCheckpointError(
                f"checkpoint {str(self.path)!r}: file {name!r} cannot be read or does not "
                f"hold what the metadata says: {type(err).__name__}: {err}") from err
        if verify:
            _commit.check_digest(self.path, name, self.manifest, (pos, crc))
        elif name in self.verify:
            self._check_whole(name)


    def _decoded(self, name: str, data: memoryview, item: ReadItem, planner) -> memoryview:
        """An item's ``torch.save`` bytes: ``data`` itself, or decompressed (a tensor chunk
        to at most its own bytes plus the ``torch.save`` wrapping)."""
        descriptors = self.storage_data[item.storage_index].transform_descriptors
        if not descriptors:
            return data
        limit = None
        if item.type != LoadItemType.BYTE_IO:
            md = planner.metadata.state_dict_metadata[item.storage_index.fqn]
            sizes = next((c.sizes for c in md.chunks
                          if tuple(c.offsets) == tuple(item.storage_index.offset)), None)
            if sizes is not None:
                limit = math.prod(sizes) * md.properties.dtype.itemsize + _WRAPPING
        where = (f"checkpoint {str(self.path)!r}: file {name!r}, item "
                 f"{item.storage_index.fqn!r}")
        try:
            return decode(descriptors, data, limit, where)
        except CorruptCheckpointError:
            self._check_whole(name)  # a damaged file: say that first, naming it
            raise


def _load_item(data: memoryview, items: list[ReadItem], planner) -> None:
    """One stored item's bytes into every request for it (objects, or tensor chunks)."""
    if items[0].type == LoadItemType.BYTE_IO:
        for item in items:
            planner.load_bytes(item, io.BytesIO(data))
        return
    tensor = plain_tensor(data)
    if tensor is None:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    for item in items:
        part = tensor
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                  strict=True)):
            part = part.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        stored = planner.metadata.state_dict_metadata[item.storage_index.fqn].properties.dtype
        if target.size() != part.size() or part.dtype != stored:
            raise CorruptCheckpointError(
                f"stored chunk {item.storage_index.fqn!r} at {tuple(item.storage_offsets)} "
                f"is {part.dtype} of shape {tuple(part.size())}, expected {stored} (as its "
                f"metadata says) of shape {tuple(target.size())}")
        target.copy_(part)  # a cast where load(cast=True) allowed one (like's dtype)
        planner.commit_tensor(item, target)


def read_plan(targets: dict[str, _Target], reader: VerifyingReader, rank: int
              ) -> tuple[_LoadPlanner, LoadPlan]:
    """DCP's load plan for ``targets`` on this rank, made locally."""
    metadata = reader.read_metadata()
    planner = _LoadPlanner()
    planner.set_up_planner(targets, metadata, rank == 0)
    reader.set_up_storage_reader(metadata, rank == 0)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    _check_items(plan, targets, reader)
    return planner, plan


def _check_items(plan: LoadPlan, targets: dict[str, _Target], reader: VerifyingReader) -> None:
    """Every item the plan reads has a stored place, in a file the manifest lists (when
    verifying), and the stored chunks tile this rank's chunks exactly."""
    where = f"checkpoint {str(reader.path)!r}: file '.metadata'"
    files = None if reader.manifest is None else reader.manifest["files"]
    for item in plan.items:
        info = reader.storage_data.get(item.storage_index)
        if info is None:
            raise CorruptCheckpointError(f"{where} says where {item.storage_index.fqn!r} is "
                                         "stored for none of its chunks read here")
        if info.transform_descriptors:  # a codec this process cannot undo: before any read
            transforms_of(info.transform_descriptors,
                          f"checkpoint {str(reader.path)!r}: {info.relative_path!r}")
        if files is not None and info.relative_path not in files:
            raise CorruptCheckpointError(f"{where} stores {item.storage_index.fqn!r} in "
                                         f"{info.relative_path!r}, a file the commit marker "
                                         "does not list")
    sizes = {(key, tuple(c.offsets)): tuple(c.sizes) for key, target in targets.items()
             if target.entry.tensor for c in target.entry.chunks}
    check_coverage([i for i in plan.items if i.type != LoadItemType.BYTE_IO], sizes, where)


def file_bytes(plan: LoadPlan, reader: VerifyingReader) -> dict[str, int]:
    """``file -> bytes`` that ``plan`` reads from it."""
    out: dict[str, int] = {}
    seen = set()
    for item in plan.items:
        info = reader.storage_data[item.storage_index]
        if (info.relative_path, info.offset) not in seen:
            seen.add((info.relative_path, info.offset))
            out[info.relative_path] = out.get(info.relative_path, 0) + info.length
    return out


def assign_files(names: list[str], reads: list[dict[str, int]], rank: int
                 ) -> tuple[set[str], set[str]]:
    """Which files rank ``rank`` checks, given what every rank reads (``reads``): each
    file read by some rank is checked by the rank that reads most of it (the lowest such
    rank), while reading; the files no rank reads are dealt out, checked in a pass."""
    verify, unread = set(), []
    for name in names:
        readers = [(-r[name], i) for i, r in enumerate(reads) if name in r]
        if readers:
            if min(readers)[1] == rank:
                verify.add(name)
        else:
            unread.append(name)
    return verify, set(unread[rank::len(reads)])


def read(planner: _LoadPlanner, plan: LoadPlan, reader: VerifyingReader) -> None:
    """Run ``plan``: tensor data lands in the targets' views, objects in ``.value``."""
    reader.read_data(planner.finish_plan(plan), planner).wait()
