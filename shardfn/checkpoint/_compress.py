"""Compressed checkpoint files: DCP stream transforms for ``save(..., compression=...)``.

DCP's file-system writer can pass each stored item (one tensor chunk's or one
object's ``torch.save`` bytes) through stream transforms and records, per item,
a descriptor of those it used in ``.metadata`` (``transform_descriptors``), so
a reader knows how to undo them. Two codecs:

* ``"gzip"``: deflate in a gzip container with zlib-ng (already a dependency:
  it computes the checksums), level 3. Descriptor ``stream.gzip@shardfn/1``.
* ``"zstd"``: torch's own ``ZStandard`` transform (descriptor
  ``stream.zstd/1``; plain ``dcp.load`` reads it), which needs the
  ``zstandard`` or ``pyzstd`` package; saving without one is refused, naming them.

The load path (:mod:`._read`) reads each item's compressed bytes once, checks
the file's CRC-32 on them, and decodes them with :func:`decode`, refusing a
tensor item that would decompress past its own size (a crafted file cannot
make a small item fill the memory). DCP's own reader reads a gzip checkpoint
with ``FileSystemReader(path, _extension_registry=registry())``.

Example:
    >>> writer = FileSystemWriter(path, _extensions=extensions("gzip"))
    >>> data = decode(["stream.gzip@shardfn/1"], compressed, limit=1 << 20, where="...")
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import IO

# DCP's (experimental) stream transforms: their public module re-exports the two classes
from torch.distributed.checkpoint.filesystem import ExtensionRegistry, StreamTransformExtension

from shardfn.checkpoint.errors import CheckpointError, CorruptCheckpointError

try:  # zlib-ng: a dependency (the checksums); zlib has the same format
    from zlib_ng import zlib_ng as _zlib
except ImportError:  # pragma: no cover
    import zlib as _zlib

__all__ = ["CODECS", "Gzip", "check_codec", "decode", "extensions", "registry",
           "transforms_of", "zstd_available"]

CODECS = ("gzip", "zstd")
_GZIP_WBITS = 31  # deflate in a gzip container (header, CRC-32 and size trailer)
_BLOCK = 1 << 22
_ZSTD = "stream.zstd/1"  # torch's ZStandard transform, version 1


class _GzipWriter(io.RawIOBase):
    """A write stream that deflates what it is given into ``output`` (closed: the rest)."""

    def __init__(self, output: IO[bytes], level: int) -> None:
        super().__init__()
        self._output = output
        self._compress = _zlib.compressobj(level, _zlib.DEFLATED, _GZIP_WBITS)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        out = self._compress.compress(view)
        if out:
            self._output.write(out)
        return len(view)

    def close(self) -> None:
        if not self.closed:
            self._output.write(self._compress.flush())
            self._output.close()  # DCP's wrapper of the file: flushes, does not close it
        super().close()


class Gzip(StreamTransformExtension):
    """DCP stream transform: gzip (zlib-ng) at ``level`` (1 fastest .. 9 smallest).

    Args:
        level: the deflate level (default 3: on float weights as small as 6, faster).

    Example:
        >>> FileSystemWriter(path, _extensions=[Gzip()])
    """

    def __init__(self, level: int = 3) -> None:
        super().__init__()
        self.level = level

    @staticmethod
    def registry_name() -> str:
        return "stream.gzip@shardfn"

    @staticmethod
    def from_descriptor(version: str) -> Gzip:
        if version.partition(".")[0] != "1":
            raise ValueError(f"stream.gzip@shardfn: unknown version {version!r} (knows 1)")
        return Gzip()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _GzipWriter(output, self.level)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:  # noqa: A002 - DCP's name
        import gzip
        return gzip.GzipFile(fileobj=input, mode="rb")  # type: ignore[return-value]


def zstd_available() -> bool:
    """Whether torch's zstd transform can run here (``zstandard`` or ``pyzstd`` installed)."""
    return _zstd() is not None


def _zstd() -> StreamTransformExtension | None:
    try:  # torch's ZStandard, by its descriptor (it refuses without a zstd package)
        return ExtensionRegistry().from_descriptor_list([_ZSTD])[0]  # type: ignore[return-value]
    except ValueError:
        return None


def check_codec(compression: str | None) -> None:
    """Refuse an unknown codec, or ``"zstd"`` without a zstd package, naming what works."""
    if compression is None:
        return
    if compression not in CODECS:
        raise ValueError(f"save: compression={compression!r}; use one of {list(CODECS)} "
                         "or None")
    if compression == "zstd" and not zstd_available():
        raise ValueError("save: compression='zstd' needs the 'zstandard' or 'pyzstd' "
                         "package (neither is installed); compression='gzip' needs nothing "
                         "more")


def extensions(compression: str | None) -> list[StreamTransformExtension]:
    """The DCP stream transforms of ``compression`` (none for None)."""
    check_codec(compression)
    if compression is None:
        return []
    return [Gzip() if compression == "gzip" else _zstd()]


def registry() -> ExtensionRegistry:
    """DCP's extension registry with shardfn's gzip added (for DCP's own reader)."""
    out = ExtensionRegistry()
    out.register(Gzip)
    return out


def transforms_of(descriptors: Sequence[str], where: str) -> list[StreamTransformExtension]:
    """The transforms that undo ``descriptors`` (checked before any data is read).

    Raises:
        CheckpointError: an unknown transform, or its package is not installed (names
            ``where`` and the descriptors).
    """
    try:
        return list(registry().from_descriptor_list(list(descriptors)))
    except Exception as err:  # noqa: BLE001 - an unknown or unavailable transform
        raise CheckpointError(
            f"{where} is stored with stream transforms {list(descriptors)} that cannot be "
            f"undone here: {type(err).__name__}: {err}") from err


def _gunzip(data: memoryview, limit: int | None) -> bytes:
    decompress = _zlib.decompressobj(_GZIP_WBITS)
    out = decompress.decompress(data, 0 if limit is None else limit + 1)
    if not decompress.eof:
        if limit is not None and len(out) > limit:
            return out
        raise ValueError("the gzip stream ends early")
    if decompress.unused_data:
        raise ValueError(f"{len(decompress.unused_data)} bytes follow the gzip stream")
    return out


def _read_all(stream: IO[bytes], limit: int | None) -> bytes:
    parts, size = [], 0
    while limit is None or size <= limit:
        block = stream.read(_BLOCK if limit is None else min(_BLOCK, limit + 1 - size))
        if not block:
            break
        parts.append(block)
        size += len(block)
    return b"".join(parts)


def decode(descriptors: Sequence[str], data: memoryview, limit: int | None,
           where: str) -> memoryview:
    """Undo the stream transforms ``descriptors`` (as recorded, outermost first) on one
    stored item's bytes.

    Args:
        descriptors: the item's ``transform_descriptors`` from ``.metadata``.
        data: the item's bytes in the file.
        limit: the most bytes the item may decode to (None: no bound).
        where: the file and item, for messages.

    Returns:
        The item's ``torch.save`` bytes.

    Raises:
        CheckpointError: an unknown transform or a codec package missing.
        CorruptCheckpointError: bytes that do not decode, or more than ``limit`` bytes
            (names ``where``).
    """
    found = transforms_of(descriptors, where)
    try:
        for transform in found:
            if isinstance(transform, Gzip):
                out = _gunzip(data, limit)
            else:
                out = _read_all(transform.transform_from(io.BytesIO(data)), limit)
            data = memoryview(bytearray(out))  # writable: tensors are made over it
            if limit is not None and len(data) > limit:
                raise ValueError(f"it decompresses to more than {limit} bytes, the most its "
                                 "metadata allows")
    except Exception as err:  # noqa: BLE001 - damaged compressed bytes
        raise CorruptCheckpointError(f"{where} does not decompress "
                                     f"({list(descriptors)}): {type(err).__name__}: {err}"
                                     ) from err
    return data
