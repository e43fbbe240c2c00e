"""Crash safety: temporary directory, checksums, commit marker, atomic rename, retention.

A save writes into ``<final>.tmp-<id>``. Every rank fsyncs its files (DCP's
``sync_files``) and hashes them (size and CRC-32); after the ranks agree that
all of them succeeded, rank 0 writes the commit marker ``.shardfn_commit``
(the manifest: every file with its size and checksum, the step, the world
size), fsyncs it and the directory, renames the directory to its final name
and fsyncs the parent. A checkpoint is complete exactly when its marker
exists; a crash at any point leaves the previous complete checkpoints as they
were and, at worst, a ``.tmp-`` directory that :func:`latest` ignores and the
next save with ``keep_last`` removes.

Example:
    >>> manifest = read_manifest("ckpt/step_000100")   # raises IncompleteCheckpointError
    >>> verify_files("ckpt/step_000100", manifest, names)  # raises CorruptCheckpointError
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

try:  # zlib-ng's CRC-32: the same values as zlib's, several times faster (SIMD)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a dependency; zlib's (same values) without it
    from zlib import crc32

from shardfn.checkpoint.errors import CorruptCheckpointError, IncompleteCheckpointError

__all__ = ["MARKER", "check_digest", "check_manifest", "check_sizes", "commit", "crc32",
           "file_digest", "latest", "own_files", "read_manifest", "remove_partial", "retain",
           "step_path", "verify_files"]

MARKER = ".shardfn_commit"
FORMAT = "shardfn.checkpoint"
VERSION = 1
_STEP = re.compile(r"^step_(\d+)$")
_BLOCK = 1 << 22


def step_path(directory: str | os.PathLike, step: int) -> str:
    """``directory/step_000123`` (at least six digits; sorted by the number, not the text)."""
    return str(Path(directory) / f"step_{int(step):06d}")


def file_digest(path: str | os.PathLike) -> tuple[int, int]:
    """``(size in bytes, CRC-32)`` of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = crc32(block, crc)
            size += len(block)
    return size, crc


def own_files(directory: str | os.PathLike, rank: int) -> list[str]:
    """The files rank ``rank`` wrote into a DCP directory (``__<rank>_*``; rank 0 also
    ``.metadata``)."""
    names = sorted(p.name for p in Path(directory).iterdir()
                   if p.name.startswith(f"__{rank}_"))
    return names + ([".metadata"] if rank == 0 else [])


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, final: str, files: dict[str, tuple[int, int]], info: dict[str, Any],
           overwrite: bool, file_mode: int | None = None) -> None:
    """Write the marker into ``tmp``, then rename ``tmp`` to ``final`` (rank 0 only); the
    marker gets ``file_mode`` (None: the umask decides)."""
    manifest = {"format": FORMAT, "version": VERSION, "time": time.time(), **info,
                "files": {name: list(files[name]) for name in sorted(files)}}
    marker_tmp = Path(tmp) / (MARKER + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(marker_tmp, flags, 0o666 if file_mode is None else file_mode)
    if file_mode is not None:
        os.fchmod(fd, file_mode)
    with open(fd, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(marker_tmp, Path(tmp) / MARKER)
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        if not overwrite:
            raise FileExistsError(f"checkpoint {final!r} already exists (pass overwrite=True)")
        old = f"{final}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(Path(final).parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the complete checkpoint at ``path``.

    Raises:
        IncompleteCheckpointError: no commit marker (a partial save, or not a checkpoint),
            naming any partial ``.tmp-`` saves next to it.
    """
    marker = Path(path) / MARKER
    if not marker.exists():
        partial = sorted(str(p) for p in Path(path).parent.glob(Path(path).name + ".tmp-*"))
        what = ("a partial save (it has no commit marker)" if Path(path).is_dir()
                else "it does not exist")
        hint = f"; partial saves next to it: {partial}" if partial else ""
        newest = latest(Path(path).parent) if Path(path).parent.is_dir() else None
        raise IncompleteCheckpointError(
            f"checkpoint {str(path)!r} is incomplete: {what}{hint}; no save of it finished, "
            f"so it cannot be loaded. Newest complete checkpoint there: {newest}")
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise CorruptCheckpointError(f"checkpoint {str(path)!r}: its commit marker {MARKER} "
                                     f"cannot be read: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"checkpoint {str(path)!r}: {MARKER} is not a shardfn "
                                     "manifest")
    check_manifest(manifest, f"checkpoint {str(path)!r}: its commit marker {MARKER!r}")
    return manifest


def check_manifest(manifest: dict[str, Any], where: str) -> None:
    """Check the manifest's fields: ``files`` (plain file names -> ``[size, CRC-32]``,
    ``.metadata`` among them), ``world_size`` and ``step``.

    Raises:
        CorruptCheckpointError: naming the marker and the missing or malformed key.
    """
    if "files" not in manifest:
        raise CorruptCheckpointError(f"{where} has no 'files' key (the list of the "
                                     "checkpoint's files with their sizes and checksums)")
    files = manifest["files"]
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CorruptCheckpointError(f"{where}: 'files' is not a table of the checkpoint's "
                                     "files with '.metadata' among them")
    for name, digest in files.items():
        if Path(name).name != name or name in ("", ".", "..") or not (
                isinstance(digest, list) and len(digest) == 2 and
                all(type(v) is int and v >= 0 for v in digest)):
            raise CorruptCheckpointError(f"{where}: 'files' entry {name!r}: {digest!r} is not "
                                         "a file name with [size, CRC-32]")
    for key, least in (("world_size", 1), ("step", None)):
        value = manifest.get(key)
        if value is not None and (type(value) is not int or (least and value < least)):
            raise CorruptCheckpointError(f"{where}: {key!r} is {value!r}, not an int"
                                         f"{f' >= {least}' if least else ''}")


def check_sizes(path: str | os.PathLike, manifest: dict[str, Any], names: list[str]) -> None:
    """Check that the manifest's files ``names`` exist with their sizes (a ``stat`` each).

    Raises:
        CorruptCheckpointError: naming the first file that is missing or truncated (or
            extended).
    """
    for name in names:
        file = Path(path) / name
        if not file.exists():
            raise CorruptCheckpointError(f"checkpoint {str(path)!r}: file {name!r} is missing")
        check_digest(path, name, manifest, (file.stat().st_size, None))


def check_digest(path: str | os.PathLike, name: str, manifest: dict[str, Any],
                 got: tuple[int, int | None]) -> None:
    """Compare a file's ``(size, CRC-32)`` (CRC None: size only) with the manifest's.

    Raises:
        CorruptCheckpointError: naming the file, truncated (or extended) or corrupted.
    """
    size, crc = manifest["files"][name]
    if got[0] != size:
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: file {name!r} is truncated or extended: "
            f"{got[0]} bytes, the manifest says {size}")
    if got[1] is not None and got[1] != crc:
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r}: file {name!r} is corrupted: CRC-32 {got[1]:#010x}, "
            f"the manifest says {crc:#010x}")


def verify_files(path: str | os.PathLike, manifest: dict[str, Any], names: list[str]) -> None:
    """Check size and checksum of the manifest's files ``names`` (reads each whole).

    Raises:
        CorruptCheckpointError: naming the first file that is missing, truncated (or
            extended) or whose checksum differs.
    """
    check_sizes(path, manifest, names)
    for name in names:
        check_digest(path, name, manifest, file_digest(Path(path) / name))


def _steps(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for p in directory.iterdir() if directory.is_dir() else ():
        m = _STEP.match(p.name)
        if m and (p / MARKER).exists():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete ``step_*`` checkpoint in ``directory`` (None: there is none).

    Example:
        >>> sf.checkpoint.latest("ckpt")
        'ckpt/step_000200'
    """
    steps = _steps(Path(directory))
    return str(steps[-1][1]) if steps else None


def remove_partial(tmp: str | os.PathLike) -> None:
    """Remove a failed save's temporary directory (every rank calls it; races are fine)."""
    shutil.rmtree(tmp, ignore_errors=True)


def retain(directory: str | os.PathLike, keep_last: int, keep: str | None) -> list[str]:
    """Remove all but the newest ``keep_last`` complete checkpoints and every partial one
    (``step_*.tmp-*``) except ``keep``'s own; returns what was removed."""
    removed = []
    steps = _steps(Path(directory))
    for _, p in steps[:max(0, len(steps) - keep_last)]:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(str(p))
    for p in Path(directory).glob("step_*.tmp-*"):
        if str(p) != keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(str(p))
    return removed
