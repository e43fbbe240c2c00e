"""``TokenFile``: a memory-mapped file of token ids, read as fixed-length windows.

The file is the nanoGPT format: the token ids back to back as raw little-endian
``uint16`` (vocabularies up to 65,536) or ``uint32``, no header. Window ``i`` is the
``seq_len + 1`` tokens from ``i * stride``; its item is ``(inputs, targets)``, the
window without its last token and without its first (next-token targets), both
int64. The file is opened with ``numpy.memmap`` on first use in each process
(DataLoader workers open their own; nothing is copied into memory, the pages come
from the OS cache).

Example:
    >>> write_tokens("train.bin", torch.arange(10))
    10
    >>> data = TokenFile("train.bin", seq_len=4)
    >>> len(data), data[1][0].tolist(), data[1][1].tolist()
    (2, [4, 5, 6, 7], [5, 6, 7, 8])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["TokenDtype", "TokenFile", "write_tokens"]

#: the element type of a token file (it has no header: reader and writer must agree)
TokenDtype = Literal["uint16", "uint32"]
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def _numpy_dtype(dtype: Any) -> np.dtype:
    name = str(dtype).removeprefix("torch.").removeprefix("numpy.")
    if name not in _DTYPES:
        raise ValueError(f"token files hold 'uint16' or 'uint32' ids, got dtype={dtype!r}")
    return _DTYPES[name]


class TokenFile(Dataset):
    """Fixed-length windows of a memory-mapped token file.

    Args:
        path: the file (as :func:`write_tokens` or nanoGPT's ``prepare.py`` write it).
        seq_len: tokens per window's inputs (and targets).
        dtype: ``"uint16"`` (default, nanoGPT's) or ``"uint32"``: what the file holds.
        stride: tokens between the starts of two windows (default ``seq_len``: the
            windows tile the file, each target's last token is the next window's first
            input).

    Raises:
        ValueError: a file whose size is not a whole number of tokens, one with fewer
            than ``seq_len + 1`` tokens, a bad dtype, seq_len or stride.

    Example:
        >>> data = TokenFile("train.bin", seq_len=256)
        >>> inputs, targets = data[0]            # int64, 256 each
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype: TokenDtype = "uint16",
                 *, stride: int | None = None):
        for name, value in (("seq_len", seq_len), ("stride", stride)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"TokenFile {name} must be an int >= 1, got {value!r}")
        self.path = os.fspath(path)
        self.seq_len = seq_len
        self.stride = seq_len if stride is None else stride
        self.dtype = _numpy_dtype(dtype)
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            raise ValueError(f"TokenFile {self.path!r}: {size} bytes is not a whole number of "
                             f"{self.dtype.name} tokens ({self.dtype.itemsize} bytes each); "
                             "is the dtype the one it was written with?")
        self.num_tokens = size // self.dtype.itemsize
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"TokenFile {self.path!r} holds {self.num_tokens} tokens, fewer "
                             f"than one window of seq_len + 1 = {seq_len + 1}")
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        """The number of whole windows in the file."""
        return (self.num_tokens - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of window ``index``: int64, ``seq_len`` each."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or \
                not 0 <= index < len(self):
            raise IndexError(f"TokenFile {self.path!r} has {len(self)} windows; no window "
                             f"{index!r}")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = int(index) * self.stride
        window = torch.from_numpy(self._tokens[start:start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the mapping (a worker started by spawn maps the file itself)."""
        return {**self.__dict__, "_tokens": None}

    def __repr__(self) -> str:
        return (f"TokenFile({self.path!r}, seq_len={self.seq_len}, dtype={self.dtype.name!r}, "
                f"stride={self.stride}: {len(self)} windows of {self.num_tokens} tokens)")


def write_tokens(path: str | os.PathLike, tokens: torch.Tensor | np.ndarray | Sequence[int],
                 dtype: TokenDtype = "uint16") -> int:
    """Write token ids as a token file (raw, no header), replacing ``path`` atomically.

    Args:
        path: the file to write.
        tokens: the ids, 1-D (a tensor, an array or a list of ints).
        dtype: ``"uint16"`` (ids below 65,536) or ``"uint32"``.

    Returns:
        The number of tokens written.

    Raises:
        ValueError: ids that are negative, not integers, not 1-D, or too large for the
            dtype (naming the largest and the dtype that holds it).

    Example:
        >>> write_tokens("train.bin", tokenizer(text)["input_ids"])
        51200
    """
    np_dtype = _numpy_dtype(dtype)
    array = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) \
        else np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"write_tokens takes a 1-D sequence of ids, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"write_tokens takes integer ids, got dtype {array.dtype}")
    if array.size:
        low, high = int(array.min()), int(array.max())
        limit = np.iinfo(np_dtype).max
        if low < 0 or high > limit:
            bad = low if low < 0 else high
            raise ValueError(f"write_tokens: id {bad} does not fit {np_dtype.name} (0..{limit})"
                             + ("; use dtype='uint32'" if high > limit and
                                np_dtype.itemsize == 2 else ""))
    path = os.fspath(path)
    partial = f"{path}.partial-{os.getpid()}"
    array.astype(np_dtype).tofile(partial)
    os.replace(partial, path)
    return int(array.size)
