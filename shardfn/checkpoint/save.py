"""``sf.checkpoint.save``: every rank writes its own shards of any state pytree, crash-safe.

Example:
    >>> state = {"params": params, "opt": opt_state, "step": 100, "rng": gen.get_state()}
    >>> sf.checkpoint.save("ckpt", state, layouts={"params": model, "opt": opt}, step=100,
    ...                    keep_last=3)                       # -> "ckpt/step_000100"
    >>> handle = sf.checkpoint.save("ckpt", state, layouts=..., step=200, async_=True)
    >>> ...                                                   # train on; then
    >>> handle.wait()
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import queue
import shutil
import threading
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardfn import pytree
from shardfn.checkpoint import _commit, _hooks
from shardfn.checkpoint._agree import agree, local
from shardfn.checkpoint._compress import check_codec
from shardfn.checkpoint._dcp import (
    Staged,
    checkpoint_group,
    local_plan,
    write_local,
    write_metadata,
)
from shardfn.checkpoint._layout import Entry, resolve
from shardfn.checkpoint._staging import snapshot
from shardfn.checkpoint.errors import CheckpointError
from shardfn.mesh import Mesh, get_mesh
from shardfn.primitives.reduced import marks_of

__all__ = ["SaveHandle", "save", "wait_pending"]

_PENDING: list[SaveHandle] = []


_WORKER: list[tuple[int, queue.SimpleQueue]] = []  # [(pid, the save thread's queue)]


def _submit(job) -> None:
    """Run ``job`` on this process's save thread (started once, then reused: starting a
    thread per save makes the caller wait for the new thread to take and give back the
    GIL, milliseconds that the step would be blocked for)."""
    if not _WORKER or _WORKER[0][0] != os.getpid():  # none yet, or a forked child
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(jobs,), daemon=True,
                         name="shardfn-checkpoint-save").start()
        _WORKER[:] = [(os.getpid(), jobs)]
    _WORKER[0][1].put(job)


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        jobs.get()()


class SaveHandle:
    """An asynchronous save in flight: :meth:`wait` for it (it raises what the save raised).

    Attributes:
        path: the checkpoint's final path.
    """

    def __init__(self, path: str, work) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._done = threading.Event()
        _submit(lambda: self._run(work))

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - re-raised by wait()
            self._error = err
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> str:
        """Block until the checkpoint is committed; returns its path.

        Raises:
            CheckpointError: what the save raised (on every rank).
        """
        self._done.wait()
        if self in _PENDING:
            _PENDING.remove(self)
        if self._error is not None:
            raise self._error
        return self.path


def wait_pending() -> None:
    """Wait for this process's asynchronous saves (a save or load first calls this)."""
    while _PENDING:
        _PENDING[0].wait()


def _world(group) -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)


def _mesh(mesh: Mesh | None) -> Mesh | None:
    """``mesh``, else the current mesh, else None; it must span the whole world (a save or
    load is collective over every rank)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"checkpoint: mesh= must be an sf.Mesh, got {type(mesh).__name__}; a "
                        "model or an optimizer that lays out the state goes in layouts=")
    try:
        mesh = get_mesh(mesh)
    except ValueError:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        raise ValueError(f"checkpoint: the mesh {mesh} spans {mesh.size()} of the world's "
                         f"{world} ranks; save/load run on every rank: give a mesh over all")
    return mesh


def stage(entries: list[Entry], leaves: list) -> dict[str, Staged]:
    """One :class:`Staged` per saved key: views of each leaf's chunks (an async save stages
    a CPU copy of the state first, see :func:`~shardfn.checkpoint._staging.snapshot`)."""
    if len(entries) != len(leaves):
        raise AssertionError(f"{len(entries)} entries for {len(leaves)} leaves")
    out = {}
    for entry, x in zip(entries, leaves, strict=True):
        if entry.key is None:
            continue
        if not entry.tensor:
            out[entry.key] = Staged(entry, {}, x, None)
            continue
        data = {}
        for chunk in entry.chunks:
            data[chunk.offsets] = chunk.view(x.detach())
        out[entry.key] = Staged(entry, data, None, x.dtype)
    return out


def _prepare(state, layouts, mesh: Mesh | None, rank: int) -> tuple[Any, Any, dict[str, int]]:
    """Resolve the layouts, stage views of ``state``'s chunks and plan their DCP write
    items, digest its replicated leaves; returns ``(planner, local plan, digests)``."""
    entries = resolve(state, layouts, mesh, rank)
    leaves = pytree.tree_leaves(state)
    planner, plan = local_plan(stage(entries, leaves), rank)
    digests = {e.key: _digest(x) for e, x in zip(entries, leaves, strict=True)
               if e.replicated and e.key}
    return planner, plan, digests


def _digest(x) -> int:
    if isinstance(x, torch.Tensor):
        raw = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return zlib.crc32(raw, zlib.crc32(f"{x.dtype}{tuple(x.shape)}".encode()))
    return zlib.crc32(repr(x).encode())


def _check_replicated(digests: list[dict[str, int]]) -> None:
    """Raise naming every leaf without a layout whose value differs between the ranks that
    hold it (a leaf only some ranks hold, e.g. a pipeline stage's, is written by them)."""
    bad = []
    for key in sorted({k for d in digests for k in d}):
        holders = [(r, d[key]) for r, d in enumerate(digests) if key in d]
        if len({value for _, value in holders}) > 1:
            first = holders[0][1]
            bad.append(f"{key!r} (rank {holders[0][0]} differs from ranks "
                       f"{[r for r, v in holders if v != first]})")
    if bad:
        raise CheckpointError(
            f"checkpoint save: leaves with no layout (replicated) differ between ranks: "
            f"{', '.join(bad)}. Give each its layout, or sf.checkpoint.PerRank() to save every "
            "rank's own value")


def save(path: str | os.PathLike, state, mesh: Mesh | None = None, layouts=None,
         step: int | None = None, *, keep_last: int | None = None, async_: bool = False,
         overwrite: bool = False, thread_count: int = 1,
         mode: int | None = None, compression: str | None = None) -> str | SaveHandle:
    """Save ``state`` (any pytree) as a sharded DCP checkpoint; every rank calls it.

    Each rank writes only its own shards (replicated leaves once, by one rank), in
    parallel, with no gather; padding is cut off. Crash-safe: the checkpoint is written
    under ``<final>.tmp-<id>``, fsynced, checksummed, marked complete and renamed (see
    :mod:`shardfn.checkpoint._commit`).

    Args:
        path: the checkpoint directory; with ``step``, a directory of checkpoints and the
            checkpoint is ``path/step_<step:06d>``.
        state: a pytree of tensors (local shards), ints, floats, strings, None.
        mesh: the mesh the layouts refer to (default: the current mesh, if any).
        layouts: a prefix of ``state`` of layout sources (see
            :mod:`shardfn.checkpoint._layout`), e.g. ``{"params": model, "opt": opt}``;
            leaves without one are replicated (checked equal on every rank).
        step: the training step (names the checkpoint, recorded in the manifest).
        keep_last: keep only the newest ``keep_last`` complete checkpoints in ``path``
            (needs ``step``), and remove partial ones.
        async_: copy the shards to CPU memory now, write them in a background thread,
            return a :class:`SaveHandle` (the step may go on and change ``state``); the
            ranks agree, check and write in that thread, so errors (a bad layout too)
            are raised by ``handle.wait()``. The CPU copy goes into buffers kept for
            the next async save of the same shapes (no allocation then; freed by
            :func:`~shardfn.checkpoint.release_staging`).
        overwrite: replace an existing checkpoint of the same name.
        thread_count: writer threads (files) per rank.
        mode: the permission bits of the checkpoint's files, e.g. ``0o600`` (owner only);
            its directories get the same bits plus search where read is allowed
            (``0o700``). Files are created with it, before any byte is written. Default
            None: the process's umask decides, as for any file (umask 022: files 0644 and
            directories 0755, readable by every user of the machine). Must allow the
            owner to read and write (``mode & 0o600 == 0o600``).
        compression: ``"gzip"`` (zlib-ng, level 3) or ``"zstd"`` (torch's DCP transform;
            needs the ``zstandard`` or ``pyzstd`` package) compresses every stored item
            (a DCP stream transform, recorded per item in ``.metadata``; ``load``
            detects it); None (default) stores raw bytes. Costs CPU time on save and
            load; pays on compressible state (zeros, low-entropy values), little on
            random float weights.

    Returns:
        The checkpoint's path, or a :class:`SaveHandle` with ``async_``.

    Raises:
        CheckpointError: on every rank when any rank fails (names the rank and why; a
            full disk: ENOSPC and the path). Every rank then removes the failed save's
            temporary directory, so the space is free again for the next save.
            ValueError / TypeError naming the leaf for a layout that does not fit.

    Example:
        >>> sf.checkpoint.save("ckpt", {"params": p, "opt": s}, layouts={"params": model,
        ...                    "opt": opt}, step=10, keep_last=2)
    """
    wait_pending()
    if keep_last is not None and (step is None or int(keep_last) < 1):
        raise ValueError("save: keep_last=k needs step= (a directory of step_* checkpoints) "
                         "and k >= 1")
    _check_mode(mode)
    check_codec(compression)
    final = _commit.step_path(path, step) if step is not None else str(path)
    the_mesh = _mesh(mesh)  # before any collective: a mesh over part of the world raises here
    group = checkpoint_group()
    rank, world = _world(group)
    prepared: tuple[Any, Any, dict[str, int]] = (None, None, {})
    info: dict[str, Any] = {}
    source = state
    with local() as outcome:  # the only part an async save runs before returning
        info = {"step": step, "world_size": world, "mesh": None if the_mesh is None else
                dict(zip(the_mesh.axis_names, the_mesh.shape, strict=True))}
        if async_:  # the staging copy, and nothing else: layouts are read in the background
            if any(marks_of(pytree.tree_leaves(state))):  # the copy has no marks: check now
                resolve(state, layouts, the_mesh, rank)   # (a gradient shard as a whole)
            source = snapshot(state)
        else:
            prepared = _prepare(state, layouts, the_mesh, rank)
        outcome.payload = uuid.uuid4().hex[:12]

    def write() -> str:
        nonlocal prepared
        if async_ and outcome.error is None:
            with local() as background:
                prepared = _prepare(source, layouts, the_mesh, rank)
            outcome.error = background.error
        with local() as checked:
            if rank == 0 and os.path.exists(final) and not overwrite:
                raise FileExistsError(f"checkpoint {final!r} already exists (overwrite=True "
                                      "replaces it)")
            if rank == 0 and keep_last:  # a killed save's leftovers: free their space first
                for partial in Path(path).glob("step_*.tmp-*"):
                    _commit.remove_partial(partial)
        if checked.error is not None and outcome.error is None:
            outcome.error = checked.error
        planner, plan, digests = prepared
        outcome.payload = (digests, outcome.payload, plan)
        payloads = agree(group, outcome, f"checkpoint save to {final!r} (staging)")
        _check_replicated([p[0] for p in payloads])
        tmp = f"{final}.tmp-{payloads[0][1]}"
        try:
            return _write_and_commit(planner, [p[2] for p in payloads], tmp, final, group,
                                     info, overwrite,
                                     (str(path), keep_last) if keep_last else None,
                                     (thread_count, not async_, mode, compression))
        except BaseException:
            _commit.remove_partial(tmp)  # every rank: this save's files go, on any disk
            raise

    if not async_:
        return write()
    handle = SaveHandle(final, write)
    _PENDING.append(handle)
    return handle


def _check_mode(mode: int | None) -> None:
    if mode is not None and (type(mode) is not int or not 0 <= mode <= 0o777 or
                             mode & 0o600 != 0o600):
        raise ValueError(f"save: mode is the files' permission bits, from 0o600 (owner only) "
                         f"to 0o777, with owner read and write; got {mode!r}")


def _bytes_planned(plan) -> int:
    return sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize
               for i in plan.items if i.tensor_data is not None)


def _errno_of(err: BaseException | None) -> int | None:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err.errno
        err = err.__cause__ or err.__context__
    return None


def _free_bytes(path: str) -> int | None:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    for place in (Path(path), *Path(path).parents):
        if place.exists():
            try:
                return shutil.disk_usage(place).free
            except OSError:
                return None
    return None


@contextlib.contextmanager
def _explained(directory: str, rank: int, need: int) -> Iterator[None]:
    """Re-raise a failure to write into ``directory`` as a CheckpointError naming the rank
    and the path, and ENOSPC when the disk is full (torch.save's writer reports a full
    disk as a bare ``RuntimeError: [enforce fail at inline_container.cc]``)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - explained, then raised
        code, free = _errno_of(err), _free_bytes(directory)
        known = code in (errno.ENOSPC, errno.EDQUOT)
        inferred = code is None and free is not None and free < max(need, 1 << 16)
        why = (f"no space left on device ({errno.errorcode[code] if known else 'ENOSPC'}"
               f"{', inferred from the free space' if inferred else ''}): {free} bytes free "
               f"on the file system of {directory!r}, this rank writes {need}; "
               if known or inferred else "")
        raise CheckpointError(f"rank {rank} could not write {directory!r}: {why}"
                              f"{type(err).__name__}: {err}") from err


def _write_and_commit(planner, plans: list, tmp: str, final: str, group,
                      info: dict[str, Any], overwrite: bool, retention,
                      how: tuple[int, bool, int | None, str | None]) -> str:
    """Write this rank's files (the ranks' local ``plans`` are known to all: DCP's
    global plan is made on each rank), agree, then rank 0 writes DCP's ``.metadata``
    from every rank's write results, the commit marker, and renames; agree again.
    ``how``: (writer threads, skip torch.save's record CRCs, the files' mode, codec)."""
    rank, _ = _world(group)
    thread_count, fast, mode, compression = how
    with local() as outcome, _explained(tmp, rank, _bytes_planned(plans[rank])):
        written = write_local(planner, plans, rank, tmp, thread_count, fast, mode,
                              compression)
        _hooks.fire("before_commit", rank=rank)
        outcome.payload = ({name: written.digests[name] if name in written.digests else
                            _commit.file_digest(Path(tmp) / name)
                            for name in _commit.own_files(tmp, rank) if name != ".metadata"},
                           written.results)
    files: dict[str, tuple[int, int]] = {}
    parts = agree(group, outcome, f"checkpoint save to {tmp!r} (writing)")
    for digests, _ in parts:
        files.update(digests)
    with local() as outcome, _explained(tmp, rank, 1 << 16):
        if rank == 0:
            files[".metadata"] = write_metadata(tmp, written.plans, [r for _, r in parts],
                                                mode)
            _hooks.fire("commit", rank=rank)
            _commit.commit(tmp, final, files, info, overwrite, mode)
            if retention is not None:
                _commit.retain(retention[0], retention[1], keep=tmp)
    agree(group, outcome, f"checkpoint commit of {final!r}")
    return final
