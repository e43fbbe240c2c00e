"""The glue to torch.distributed.checkpoint (DCP): planners, the writer, the process group.

shardfn gives DCP one value per checkpoint key: a :class:`Staged` leaf (this
rank's chunks of a global tensor, each with its global offsets, or a Python
object). The save planner turns them into DCP ``WriteItem``s (chunk metadata:
offsets, sizes, the global size and dtype), so the files and ``.metadata`` are
a plain DCP checkpoint: ``dcp.load`` into full tensors, or
``format_utils.dcp_to_torch_save``, read it without shardfn. DCP's storage
writer writes the files; the plan exchange is shardfn's own (the local plans
travel in the save's first rank agreement, :mod:`._plan` makes the global plan:
chunks that several ranks hold, replicated leaves, are written once). The load
planner asks DCP's resharding helper which stored chunks overlap each of this
rank's chunks and copies them straight into views of the new local tensors
(read by :mod:`._read`).

Checkpoint I/O runs on its own gloo process group, so an async save's
collectives never interleave with the training step's.

Example:
    >>> planner, plan = local_plan(staged, rank)     # plans: every rank's, all-gathered
    >>> written = write_local(planner, plans, rank, "ckpt.tmp-1")
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardfn.checkpoint import _commit, _hooks
from shardfn.checkpoint._compress import extensions
from shardfn.checkpoint._layout import Entry
from shardfn.checkpoint._metadata import read_metadata
from shardfn.checkpoint._plan import global_plans, metadata_of

__all__ = ["Reader", "Staged", "Written", "checkpoint_group", "dir_mode", "local_plan",
           "write_local", "write_metadata"]


class Staged(NamedTuple):
    """One checkpoint key on this rank: its entry and data.

    Attributes:
        entry: the leaf's :class:`~shardfn.checkpoint._layout.Entry`.
        data: chunk offsets -> the chunk's tensor (a view of the local tensor, or a copy)
            for tensors; unused for objects.
        value: the Python object (objects only).
        dtype: the tensor's dtype.
    """

    entry: Entry
    data: dict[tuple[int, ...], torch.Tensor]
    value: Any
    dtype: torch.dtype | None


class _Target:
    """A key being loaded: views of the new local tensor per chunk, or the object read."""

    def __init__(self, entry: Entry, views: dict[tuple[int, ...], torch.Tensor] | None):
        self.entry, self.views, self.value = entry, views, None


_GROUP: list[tuple[Any, Any]] = []  # [(the default group it was made under, the gloo group)]


def checkpoint_group():
    """The gloo group over the whole world that checkpoint I/O uses (None: no world).

    Made on first use (a collective call: every rank saves or loads together).
    """
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if not _GROUP or _GROUP[0][0] is not world:
        _GROUP[:] = [(world, dist.new_group(backend="gloo"))]
    return _GROUP[0][1]


class _SavePlanner(DefaultSavePlanner):
    """Write items from :class:`Staged` leaves (chunks with global offsets)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator, self.mappings = state_dict, is_coordinator, {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, staged in self.state_dict.items():
            if not staged.entry.tensor:
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
                continue
            for chunk in staged.entry.chunks:
                props = TensorProperties(dtype=staged.dtype)
                items.append(WriteItem(
                    index=MetadataIndex(key, chunk.offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets),
                                                   sizes=torch.Size(chunk.sizes)),
                        properties=props, size=torch.Size(staged.entry.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        staged = self.state_dict[write_item.index.fqn]
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(staged.value, buffer)
            return buffer
        return staged.data[tuple(write_item.index.offset)].detach()


class _LoadPlanner(DefaultLoadPlanner):
    """Read items into views of the new local tensors (DCP's resharding helper)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator, self.mappings = metadata, is_coordinator, {}

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for key, target in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]
            if not target.entry.tensor:
                index = MetadataIndex(key)
                zero = torch.Size([0])
                requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index,
                                         dest_offsets=zero, storage_index=index,
                                         storage_offsets=zero, lengths=zero))
                continue
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                           sizes=torch.Size(c.sizes))
                      for c in target.entry.chunks]
            requests += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn].value = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.state_dict[read_item.dest_index.fqn]
        view = target.views[tuple(read_item.dest_index.offset)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths,
                                                  strict=True)):
            view = view.narrow(dim, start, length)
        return view


class _HashingStream:
    """A write stream that keeps the size and CRC-32 of what passes through it (no read
    back); a seek (never done by DCP's writer) marks it unusable, so the file is re-read."""

    def __init__(self, stream) -> None:
        self._stream, self.size, self.crc, self.sequential = stream, 0, 0, True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = _commit.crc32(view, self.crc)
        self.size += len(view)
        return self._stream.write(data)

    def seek(self, *args):
        self.sequential = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _HookedFileSystem(FileSystem):
    """DCP's local file system: fires the ``write_file`` test hook before each data file and
    hashes every file as it is written (``digests``: name -> (size, CRC-32))."""

    def __init__(self, file_mode: int | None = None) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, int]] = {}
        self.file_mode = file_mode

    def mkdir(self, path) -> None:
        if self.file_mode is None:
            return super().mkdir(path)
        made = [p for p in [Path(path), *Path(path).parents] if not p.exists()]
        super().mkdir(path)
        for directory in made:  # made with the umask's bits: now the checkpoint's
            os.chmod(directory, dir_mode(self.file_mode))

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        name = Path(path).name
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if not name.startswith(".metadata"):
            _hooks.fire("write_file", name=name)
        if self.file_mode is not None:  # made with its mode before a byte is written
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, self.file_mode)
            os.fchmod(fd, self.file_mode)
            os.close(fd)
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream)
            yield hashing
        if hashing.sequential and "a" not in mode and "+" not in mode:
            self.digests[name] = (hashing.size, hashing.crc)


def dir_mode(file_mode: int) -> int:
    """The mode of the directories of a checkpoint whose files have ``file_mode``: the
    same bits, with search (x) wherever read (r) is allowed (0o600 -> 0o700)."""
    return file_mode | ((file_mode & 0o444) >> 2)


def _writer(path: str, thread_count: int, file_mode: int | None = None,
            compression: str | None = None) -> FileSystemWriter:
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True,
                              thread_count=thread_count, overwrite=False,
                              _extensions=extensions(compression))
    writer.fs = _HookedFileSystem(file_mode)
    return writer


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        yield


def local_plan(staged: dict[str, Staged], rank: int) -> tuple[_SavePlanner, SavePlan]:
    """This rank's planner over ``staged`` and its local DCP plan (sent to every rank in
    the save's first agreement, so no rank needs DCP's own plan exchange)."""
    planner = _SavePlanner()
    planner.set_up_planner(staged, is_coordinator=rank == 0)
    return planner, planner.create_local_plan()


@contextlib.contextmanager
def _no_record_crc(skip: bool) -> Iterator[None]:
    """With ``skip``, ``torch.save`` writes no CRC-32 per zip record while the block runs:
    the whole file's CRC-32 is computed anyway (``torch.load`` reads either). Process-wide,
    so only a synchronous save (the caller's thread waits in it) uses it."""
    before = torch.serialization.get_crc32_options()
    if skip:
        torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class Written(NamedTuple):
    """What one rank's :func:`write_local` did.

    Attributes:
        plans: the global plans (the same on every rank; rank 0 writes their metadata).
        results: this rank's DCP write results (where each item lies in its file).
        digests: ``name -> (size, CRC-32)`` of this rank's data files, hashed as written.
    """

    plans: list[SavePlan]
    results: list
    digests: dict[str, tuple[int, int]]


def write_local(planner: _SavePlanner, plans: list[SavePlan], rank: int, path: str,
                thread_count: int = 1, fast: bool = False,
                file_mode: int | None = None, compression: str | None = None) -> Written:
    """Write this rank's part of a DCP checkpoint into the directory ``path`` (no
    collective): the global plan (dedup of chunks several ranks hold, chunk checks) is
    made from every rank's local plan ``plans`` on each rank (:mod:`._plan`).

    Args:
        fast: skip ``torch.save``'s per-record CRC (see :func:`_no_record_crc`).
        file_mode: the files' permission bits (None: the process's umask decides).
        compression: each stored item's codec (:mod:`._compress`; None: raw).
    """
    deduped = global_plans(plans)
    writer = _writer(path, thread_count, file_mode, compression)
    writer.set_up_storage_writer(rank == 0, rank=rank)
    writer.prepare_local_plan(plans[rank])  # makes the directory
    final = planner.finish_plan(writer.prepare_global_plan(deduped)[rank])
    with _quiet(), _no_record_crc(fast):
        future = writer.write_data(final, planner)
        future.wait()
    return Written(deduped, future.value(), dict(writer.fs.digests))


def write_metadata(path: str, plans: list[SavePlan], results: list[list],
                   file_mode: int | None = None) -> tuple[int, int]:
    """Write DCP's ``.metadata`` file for the global ``plans`` (rank 0, once every rank's
    ``results`` are in); returns its ``(size, CRC-32)``, hashed as written."""
    writer = _writer(path, 1, file_mode)
    writer.set_up_storage_writer(True, rank=0)
    writer.finish(metadata_of(plans), results)
    return writer.fs.digests[".metadata.tmp"]


class Reader(FileSystemReader):
    """A DCP reader of one checkpoint that reads its metadata file once: ``load`` checks
    ``like`` against it, then the local read plan (:func:`._read.read_plan`) asks for it
    again."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.cached_metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled with an allow-list (DCP's own reader runs
        ``pickle.load``, which would run code a crafted file names; see :mod:`._metadata`)."""
        if args or kwargs:  # another rank's metadata file: not cached
            return self._read_metadata(kwargs.get("rank"))
        if self.cached_metadata is None:
            self.cached_metadata = self._read_metadata(None)
        return self.cached_metadata

    def _read_metadata(self, rank: int | None) -> Metadata:
        file = Path(self._get_metadata_path(rank))
        metadata = read_metadata(file.parent, file.name)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
