"""A tensor straight from the bytes of one ``torch.save`` record, when it is the plain case.

DCP stores each tensor chunk as a ``torch.save`` zip (stored, not compressed).
``torch.load(weights_only=True)`` reads it with a pure-Python unpickler, about
half a millisecond per chunk. For the plain case, one contiguous tensor at
storage offset 0 of a storage of a standard dtype in this machine's byte
order, :func:`plain_tensor` reads the zip's central directory, unpickles the
small record with an allow-list (C) unpickler that only records the call's
arguments (it builds nothing but tuples and dtypes), checks them against the
data record, and returns a tensor viewing the bytes. Anything else returns
None, and the caller uses ``torch.load``.

Example:
    >>> buf = bytearray(item_bytes)
    >>> t = plain_tensor(buf)
    >>> t = t if t is not None else torch.load(io.BytesIO(buf), weights_only=True)
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import sys

import torch

__all__ = ["plain_tensor"]

_REBUILD = torch.empty(0).__reduce_ex__(2)[0]  # the function torch.save's pickles call
_GLOBAL = (_REBUILD.__module__, _REBUILD.__name__)
_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64,
           "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
           "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
           "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
           "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128}


def _arguments(*args):
    return ("tensor", *args)


class _Unpickler(pickle.Unpickler):
    """Resolves only the tensor-rebuild call (to :func:`_arguments`), ``OrderedDict``
    and the storage classes (to their dtypes); any other global is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == _GLOBAL:
            return _arguments
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor's")

    def persistent_load(self, pid):
        return tuple(pid)


def _members(buf: memoryview) -> dict[str, tuple[int, int]] | None:
    """``name -> (data start, size)`` of the members of a stored zip (None: another kind,
    zip64 included)."""
    tail = max(0, len(buf) - 65557)
    end = bytes(buf[tail:]).rfind(b"PK\x05\x06")
    end = end + tail if end >= 0 else -1
    if end < 0 or end + 22 > len(buf):
        return None
    entries, _, cd_offset = struct.unpack_from("<HII", buf, end + 10)
    if entries == 0xFFFF or cd_offset == 0xFFFFFFFF:
        return None
    members, pos = {}, cd_offset
    for _ in range(entries):
        if pos + 46 > len(buf) or bytes(buf[pos:pos + 4]) != b"PK\x01\x02":
            return None
        method, _, csize, usize, nlen, elen, clen = struct.unpack_from("<H4xIIIHHH", buf,
                                                                        pos + 10)
        local = struct.unpack_from("<I", buf, pos + 42)[0]
        name = bytes(buf[pos + 46:pos + 46 + nlen]).decode("utf-8", "replace")
        if method != 0 or csize != usize or local + 30 > len(buf) or \
                bytes(buf[local:local + 4]) != b"PK\x03\x04":
            return None
        lnlen, lelen = struct.unpack_from("<HH", buf, local + 26)
        start = local + 30 + lnlen + lelen
        if start + csize > len(buf):
            return None
        members[name] = (start, csize)
        pos += 46 + nlen + elen + clen
    return members


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def plain_tensor(data) -> torch.Tensor | None:
    """The tensor that the ``torch.save`` bytes ``data`` hold (a writable buffer: a
    bytearray, a memoryview), viewing them, when it is the plain case (see the module);
    else None."""
    buf = memoryview(data).cast("B")
    members = _members(buf)
    pickles = [n for n in members or () if n.endswith("/data.pkl")]
    if len(pickles) != 1:
        return None
    prefix = pickles[0][:-len("data.pkl")]
    order = members.get(prefix + "byteorder")
    if order is None or bytes(buf[order[0]:order[0] + order[1]]) != sys.byteorder.encode():
        return None
    start, size = members[pickles[0]]
    try:
        info = _Unpickler(io.BytesIO(bytes(buf[start:start + size]))).load()
        _, storage, offset, shape, stride = info[:5]
        kind, dtype, key, _, numel = storage
    except Exception:  # noqa: BLE001 - not the plain case: torch.load decides
        return None
    record = members.get(f"{prefix}data/{key}")
    if kind != "storage" or not isinstance(dtype, torch.dtype) or record is None:
        return None
    shape, stride = tuple(shape), tuple(stride)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if offset != 0 or numel != math.prod(shape) or stride != _contiguous(shape) or \
            record[1] != numel * itemsize:
        return None
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=record[0]).view(shape)
