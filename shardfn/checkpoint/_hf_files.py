"""The files of a Hugging Face ``save_pretrained`` directory: find, read, plan and write them.

A directory holds ``model.safetensors``, or ``model.safetensors.index.json`` (its
``weight_map``: key -> shard file) and the shards ``model-00001-of-0000N.safetensors``.
:class:`WeightFiles` opens the files lazily (a header read: no data) and reads a
tensor, or a window of it (rows/columns of each dim: ``safe_open(...).get_slice``),
so a rank reads only the bytes of its shards. :func:`plan_files` cuts a list of
tensors into files of at most ``max_shard_size`` bytes as ``transformers`` does, and
:func:`write_file` writes one atomically.

Example:
    >>> with WeightFiles("llama-dir") as files:
    ...     rows = files.read("model.embed_tokens.weight", [(0, 32, 32), (0, 64, 64)])
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from shardfn.checkpoint.errors import CorruptCheckpointError

__all__ = ["INDEX", "SINGLE", "WeightFiles", "file_names", "parse_size", "plan_files",
           "remove_stale", "write_file", "write_json"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_OURS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# Window of one dim: (first row read, rows read, rows of the local shard: the rest is
# zero padding at the end).
Window = tuple[int, int, int]


class WeightFiles:
    """The safetensors files of a ``save_pretrained`` directory, opened on first use.

    Attributes:
        path: the directory.
        where: key -> the file (name in ``path``) that holds it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}
        if (self.path / INDEX).is_file():
            index = self.path / INDEX
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise CorruptCheckpointError(f"{index}: not a safetensors index (a JSON "
                                             f"object with a 'weight_map'): {err}") from err
            if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and "/" not in f and f not in ("", ".", "..")
                    for f in weight_map.values()):
                raise CorruptCheckpointError(f"{index}: 'weight_map' must map each key to a "
                                             "file name in the directory")
            self.where = dict(weight_map)
        elif (self.path / SINGLE).is_file():
            self.where = dict.fromkeys(self._file(SINGLE).keys(), SINGLE)
        else:
            raise FileNotFoundError(f"{self.path}: no {SINGLE} nor {INDEX} (a directory "
                                    "written by save_pretrained)")

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _file(self, name: str):
        if name not in self._open:
            from safetensors import safe_open

            file = self.path / name
            if not file.is_file():
                raise CorruptCheckpointError(f"{self.path}: {name}, named by {INDEX}, is "
                                             "missing")
            try:
                self._open[name] = self._stack.enter_context(safe_open(str(file), "pt"))
            except Exception as err:  # noqa: BLE001 - safetensors' own error types
                raise CorruptCheckpointError(f"{file}: not a safetensors file: "
                                             f"{err}") from err
        return self._open[name]

    def _slice(self, key: str):
        handle = self._file(self.where[key])
        try:
            return handle.get_slice(key)
        except Exception as err:  # noqa: BLE001 - a key the index names but the file lacks
            raise CorruptCheckpointError(f"{self.path / self.where[key]}: has no tensor "
                                         f"{key!r} (the index says it does)") from err

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape stored for ``key`` (a header read)."""
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, windows: Sequence[Window] | None = None) -> torch.Tensor:
        """``key``'s tensor (``windows`` None), or the rows ``windows`` say, zero-padded.

        Args:
            key: the stored name.
            windows: one ``(start, count, length)`` per dim: rows ``start .. start+count``
                are read and zeros appended up to ``length``.

        Returns:
            A CPU tensor in the stored dtype.
        """
        stored = self._slice(key)
        if not windows:  # the whole tensor (a 0-dim one too)
            return self._file(self.where[key]).get_tensor(key)
        x = stored[tuple(slice(start, start + count) for start, count, _ in windows)]
        for dim, (_, count, length) in enumerate(windows):
            if count < length:
                pad = list(x.shape)
                pad[dim] = length - count
                x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        return x


def parse_size(size: int | str) -> int:
    """Bytes of ``5000``, ``"5GB"`` (10**9), ``"20KB"``, ``"2GiB"`` (2**30), as transformers.

    Example:
        >>> parse_size("20KB")
        20000
    """
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size: a positive number of bytes or a size such as "
                         f"'5GB', '500MB', '2GiB', got {size!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def plan_files(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group ``(key, bytes)`` in order into files of at most ``max_bytes`` (a bigger tensor
    gets a file of its own), as ``transformers``' ``save_pretrained`` does.

    Example:
        >>> plan_files([("a", 6), ("b", 6), ("c", 3)], 10)
        [['a'], ['b', 'c']]
    """
    groups: list[list[str]] = []
    used = 0
    for key, size in sizes:
        if not groups or (used + size > max_bytes and groups[-1]):
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += size
    return groups or [[]]


def file_names(count: int) -> list[str]:
    """The file names of ``count`` shards: ``model.safetensors`` alone, else numbered."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one safetensors file (``format: pt``), atomically."""
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    _replace(tmp, path)


def write_json(path: Path, value: dict) -> None:
    """Write ``value`` as indented JSON, atomically."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    _replace(tmp, path)


def remove_stale(path: Path, written: Sequence[str]) -> None:
    """Remove weight files of an earlier save in ``path`` that this save did not write
    (so the directory holds one model: ``from_pretrained`` prefers the index)."""
    for entry in path.iterdir():
        if entry.name not in written and _OURS.fullmatch(entry.name) and entry.is_file():
            entry.unlink()
