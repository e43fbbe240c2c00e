"""What a pipeline message carries and how it is laid out: one tensor or a tuple/list of
them, what it declares, its int32 header, and the packed layout of a declared message
(payloads at 16-byte aligned offsets, then the header, in one uint8 buffer).

Example:
    >>> declared_of_value((torch.zeros(2, 3), None))
    (Declared(shape=(2, 3), dtype=torch.float32), None)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from shardfn.transforms.pipeline.kinds import Status

__all__ = ["MAX_ENTRIES", "Declared", "DeclaredValue", "Packed", "declared_entries",
           "declared_of_value", "entries_of", "make_packed", "packed_layout"]

_TENSOR, _TUPLE, _LIST = 0, 1, 2  # what a message's value is: one tensor, a tuple, a list
MAX_ENTRIES = 8  # tensors in one message (a stage's tuple output)
_MAX_DIMS = 8
_ENTRY = 3 + _MAX_DIMS  # per entry: present (2: requires grad), dtype, ndim, dims
_HEADER_LEN = 4 + _ENTRY  # status, container, entries, text length, entry 0
_FULL_LEN = 4 + MAX_ENTRIES * _ENTRY  # with the second header: entries 1, 2, ...
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)


class Declared(NamedTuple):
    """A message's shape and dtype, known to both sides before it is sent."""

    shape: tuple[int, ...]
    dtype: torch.dtype


#: what a message may declare: one tensor, or per entry of a tuple (None: no payload there)
DeclaredValue = Declared | tuple[Declared | None, ...]


def entries_of(value: Any) -> tuple[int, list[torch.Tensor | None]]:
    """``(container, entries)`` of a message value: one tensor (``_TENSOR``), or a tuple /
    list of tensors and Nones (``_TUPLE`` / ``_LIST``).

    Raises:
        TypeError: anything else (a dict, a nested tuple, a number).
        ValueError: more than ``MAX_ENTRIES`` entries.
    """
    if isinstance(value, torch.Tensor):
        return _TENSOR, [value]
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        bad = [j for j, e in enumerate(value) if e is not None and not isinstance(e, torch.Tensor)]
        if bad:
            raise TypeError(f"pipeline messages carry a tensor or a tuple/list of tensors (and "
                            f"None); entry {bad[0]} is a {type(value[bad[0]]).__name__}")
        if len(value) > MAX_ENTRIES:
            raise ValueError(f"pipeline messages carry at most {MAX_ENTRIES} tensors, got a "
                             f"{type(value).__name__} of {len(value)}")
        return (_TUPLE if isinstance(value, tuple) else _LIST), list(value)
    raise TypeError("pipeline messages carry a tensor or a tuple/list of tensors (and None), "
                    f"got a {type(value).__name__}")


def declared_of_value(value: Any) -> DeclaredValue:
    """The :data:`DeclaredValue` that ``value`` (a tensor or tuple/list of them) meets."""
    container, entries = entries_of(value)
    found = tuple(None if e is None else Declared(tuple(e.shape), e.dtype) for e in entries)
    return found[0] if container == _TENSOR else found


def declared_entries(declared: DeclaredValue | None) -> list[Declared | None]:
    """The per-entry payloads ``declared`` announces (one for a single tensor)."""
    if declared is None:
        return []
    return [declared] if isinstance(declared, Declared) else list(declared)


_ALIGN = 16  # bytes: a packed payload's offset suits every dtype's view


def _nbytes(entry: Declared) -> int:
    return math.prod(entry.shape) * entry.dtype.itemsize


def packed_layout(declared: list[Declared | None]) -> tuple[list[int | None], int, int]:
    """``(offsets, header offset, total bytes)`` of a packed message with these payloads.

    Example:
        >>> packed_layout([Declared((3,), torch.float32), None])
        ([0, None], 16, 384)
    """
    offsets: list[int | None] = []
    at = 0
    for entry in declared:
        if entry is None:
            offsets.append(None)
            continue
        offsets.append(at)
        at += -(-_nbytes(entry) // _ALIGN) * _ALIGN
    return offsets, at, at + _FULL_LEN * 4


class Packed(NamedTuple):
    """A packed message's buffer with its views, made once per buffer.

    Attributes:
        buffer: the uint8 bytes sent or received in one transfer.
        payloads: per declared entry, its typed and shaped view into ``buffer`` (None
            for an entry with no payload).
        header: the header's int32 view (at the end of ``buffer``).
        written: the header values last written into it (a kept send buffer's header
            is rewritten only when they change); empty when none was.
    """

    buffer: torch.Tensor
    payloads: list[torch.Tensor | None]
    header: torch.Tensor
    written: list[int]


def make_packed(declared: list[Declared | None], device: torch.device) -> Packed:
    """A fresh :class:`Packed` for a message with these payloads (:func:`packed_layout`)."""
    offsets, at, total = packed_layout(declared)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    views = [None if d is None else buffer[o:o + _nbytes(d)].view(d.dtype).view(d.shape)
             for d, o in zip(declared, offsets, strict=True)]
    return Packed(buffer, views, buffer[at:].view(torch.int32), [])


def _header(status: Status, container: int, entries: list[torch.Tensor | None]) -> torch.Tensor:
    return torch.tensor(_header_values(status, container, entries), dtype=torch.int32)


def _header_values(status: Status, container: int, entries: list[torch.Tensor | None]
                   ) -> list[int]:
    values = [0] * _FULL_LEN  # filled as a list: one tensor op instead of a dozen
    values[0:3] = status, container, len(entries)
    for j, tensor in enumerate(entries):
        if tensor is None:
            continue
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline messages carry tensors of at most {_MAX_DIMS} dims, "
                             f"got shape {tuple(tensor.shape)} (entry {j})")
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"pipeline messages cannot carry dtype {tensor.dtype} (entry {j})")
        at = 4 + j * _ENTRY
        values[at:at + 3] = 1 + tensor.requires_grad, _DTYPES.index(tensor.dtype), tensor.dim()
        values[at + 3:at + 3 + tensor.dim()] = tensor.shape
    return values


def _decode(values: list[int]) -> tuple[Status, int, list[Declared | None], int]:
    """``(status, container, entries, text length)`` of a header's values."""
    entries: list[Declared | None] = []
    for j in range(values[2]):
        at = 4 + j * _ENTRY
        present, dtype, ndim = values[at:at + 3]
        entries.append(Declared(tuple(values[at + 3:at + 3 + ndim]), _DTYPES[dtype])
                       if present else None)
    return Status(values[0]), values[1], entries, values[3]


def _grad_flags(values: list[int]) -> tuple[bool, ...]:
    """Per entry of a header's values: whether the sender's tensor required grad."""
    return tuple(values[4 + j * _ENTRY] == 2 for j in range(values[2]))


def _rebuild(container: int, entries: list[torch.Tensor | None]) -> Any:
    if container == _TENSOR:
        return entries[0]
    return tuple(entries) if container == _TUPLE else list(entries)
