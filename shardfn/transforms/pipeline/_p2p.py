"""Point-to-point messages between pp ranks: a header, then the tensor, matched by tag.

Every message of a pipeline step (an activation, an output gradient, the loss)
travels as a small int64 *header* (status, dtype, shape) followed by its
payload. The header lets the receiver allocate the payload when shapes were
not declared, and it carries the *status*: ``OK``, ``NONE`` (no tensor, e.g.
the gradient of an integer activation) or ``ERROR`` (the sender failed). A
failed rank still sends every message it owes, as an error header, and still
receives every message it expects: so its peers stop with an error instead of
waiting for ever, and no message is left unmatched in the persistent process
group (see :meth:`Messenger.settle`).

With declared shapes the receiver posts the header and the payload at once;
the sender then always sends a payload of the declared shape (zeros after an
error), so both sides post the same messages.

An error header is followed by the error's text (UTF-8 bytes, its length in the
header), so every rank's error says what went wrong first and where.

Tags: message ``k`` of a call uses tags ``base + 3k`` (header), ``base + 3k + 1``
(payload) and ``base + 3k + 2`` (error text), from :data:`PIPELINE` (a block after
``shard_params``' tags).
Sends are non-blocking (``batch_isend_irecv``) and waited by :meth:`Messenger.finish`;
receives block. Nothing here is differentiable: the runtime detaches first.

Example:
    >>> messenger = Messenger(ax, tag_of={("act", 0, 0): 0}.__getitem__)
    >>> messenger.send(("act", 0, 0), dst=1, tensor=x)      # on pp rank 0
    >>> x = messenger.recv(("act", 0, 0), src=0)             # on pp rank 1
    >>> messenger.finish()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist

from shardfn.primitives import stats
from shardfn.primitives._comm import Axis
from shardfn.primitives.tags import UNITS, TagBlock

__all__ = ["ERROR", "NONE", "OK", "PIPELINE", "Declared", "Messenger", "PeerFailed"]

#: the pipeline's message tags (right after shard_params' block)
PIPELINE = TagBlock("pipeline_stages messages", UNITS.start + UNITS.size, 1 << 22)

OK, ERROR, NONE = 0, 1, 2
_MAX_DIMS = 8
_HEADER_LEN = 3 + _MAX_DIMS
_MAX_TEXT = 4096  # bytes of an error's text sent with its header
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)

Key = tuple  # ("act" | "grad" | "loss" | "out" | "leaf", stage, microbatch)


class Declared(NamedTuple):
    """A message's shape and dtype, known to both sides before it is sent."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class PeerFailed(RuntimeError):
    """A peer sent an error header: it failed during this call (its own error says why)."""


def _header(status: int, tensor: torch.Tensor | None) -> torch.Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = status
    if tensor is not None:
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline messages carry tensors of at most {_MAX_DIMS} dims, "
                             f"got shape {tuple(tensor.shape)}")
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"pipeline messages cannot carry dtype {tensor.dtype}")
        header[1] = _DTYPES.index(tensor.dtype)
        header[2] = tensor.dim()
        header[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def _decode(header: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    values = header.tolist()
    ndim = values[2]
    return values[0], tuple(values[3:3 + ndim]), _DTYPES[values[1]]


class Messenger:
    """One call's messages over the pp axis: sends in flight, what was sent and received.

    Args:
        ax: the resolved pp axis (peers are axis indices).
        tag_of: message key -> its number ``k`` in this call (unique per pair of ranks).
        declared: message key -> :class:`Declared` when its payload is declared, else None.
        device: where messages live (the mesh's device: CUDA for NCCL, CPU for gloo).
    """

    def __init__(self, ax: Axis, tag_of: Callable[[Key], int],
                 declared: Callable[[Key], Declared | None] = lambda key: None,
                 device: torch.device | str = "cpu"):
        self.ax = ax
        self.device = torch.device(device)
        self.tag_of = tag_of
        self.declared = declared
        #: (key, dst) -> (works, tensors kept alive until they are waited), in posting order
        self.pending: dict[tuple[Key, int], tuple[list, list]] = {}
        self.sent: set[tuple[Key, int]] = set()
        self.received: set[tuple[Key, int]] = set()

    def _tags(self, key: Key) -> tuple[int, int, int]:
        k = self.tag_of(key)
        if not 0 <= 3 * k + 2 < PIPELINE.size:
            raise ValueError(f"pipeline message {key} needs tag number {k}, beyond the "
                             f"{PIPELINE.size // 3} the pipeline's tag block holds; use fewer "
                             "stages or micro-batches")
        return tuple(PIPELINE.start + 3 * k + j for j in range(3))

    def _post(self, ops: list, description: str) -> list:
        with stats.collective_scope(self.ax.describe(description)):
            return [w for w in dist.batch_isend_irecv(ops) if w is not None]

    def send(self, key: Key, dst: int, tensor: torch.Tensor | None, status: int = OK,
             error: str = "") -> None:
        """Post ``tensor`` (or a header of ``status`` alone) to axis index ``dst``; not waited.

        With a declared payload the declared shape is always sent (zeros when
        ``tensor`` is None); the caller has checked that ``tensor`` matches it.
        With ``status=ERROR`` the text ``error`` follows.
        """
        declared = self.declared(key)
        header_tag, payload_tag, text_tag = self._tags(key)
        payload = None if status != OK else tensor.detach().to(self.device).contiguous()
        if declared is not None and payload is None:
            payload = torch.zeros(declared.shape, dtype=declared.dtype, device=self.device)
        header = _header(status, tensor if status == OK else None)
        header = header.to(self.device)
        ops = [dist.P2POp(dist.isend, header, group=self.ax.group, group_peer=dst,
                          tag=header_tag)]
        if payload is not None:
            stats.record(self.ax.key, "pipeline_send", payload.numel() * payload.element_size())
            ops.append(dist.P2POp(dist.isend, payload, group=self.ax.group, group_peer=dst,
                                  tag=payload_tag))
        if status == ERROR:
            text = torch.frombuffer(bytearray(error.encode()[:_MAX_TEXT] or b" "),
                                    dtype=torch.uint8).to(self.device)
            header[3] = text.numel()
            ops.append(dist.P2POp(dist.isend, text, group=self.ax.group, group_peer=dst,
                                  tag=text_tag))
        works = self._post(ops, f"pipeline send {key} to pp {dst}")
        self.pending[(key, dst)] = (works, [op.tensor for op in ops])
        self.sent.add((key, dst))

    def recv(self, key: Key, src: int) -> torch.Tensor | None:
        """Receive message ``key`` from axis index ``src``; None for a ``NONE`` header.

        Raises:
            PeerFailed: the sender failed (it sent an error header).
        """
        declared = self.declared(key)
        header_tag, payload_tag, text_tag = self._tags(key)
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        ops = [dist.P2POp(dist.irecv, header, group=self.ax.group, group_peer=src,
                          tag=header_tag)]
        payload = None
        if declared is not None:
            payload = torch.empty(declared.shape, dtype=declared.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, payload, group=self.ax.group, group_peer=src,
                                  tag=payload_tag))
        description = f"pipeline recv {key} from pp {src}"
        for work in self._post(ops, description):
            with stats.collective_scope(self.ax.describe(description)):
                work.wait()
        status, shape, dtype = _decode(header)
        if declared is None and status == OK:
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            self._receive(payload, src, payload_tag, description)
        text = ""
        if status == ERROR:
            raw = torch.empty(int(header[3]), dtype=torch.uint8, device=self.device)
            self._receive(raw, src, text_tag, description)
            text = bytes(raw.cpu().tolist()).decode(errors="replace").strip()
        self.received.add((key, src))
        if status == ERROR:
            raise PeerFailed(f"pp rank {src} failed during this pipeline call (message {key}): "
                             f"{text}")
        return payload if status == OK else None

    def _receive(self, buffer: torch.Tensor, src: int, tag: int, description: str) -> None:
        op = dist.P2POp(dist.irecv, buffer, group=self.ax.group, group_peer=src, tag=tag)
        for work in self._post([op], description):
            with stats.collective_scope(self.ax.describe(description)):
                work.wait()

    def finish(self) -> None:
        """Wait for every send posted so far."""
        for sent in list(self.pending):
            self.wait_sent(*sent)

    def wait_sent(self, key: Key, dst: int) -> None:
        """Wait for the send of ``key`` to ``dst`` (if still pending) and drop its tensors."""
        works, _ = self.pending.pop((key, dst), ([], []))
        for work in works:
            with stats.collective_scope(self.ax.describe(f"pipeline send {key} to pp {dst}")):
                work.wait()

    def settle(self, owed: Iterable[tuple[Key, int]], expected: Iterable[tuple[Key, int]],
               error: str) -> None:
        """After a failure: send an error header for every message still owed, receive
        (and drop) every message still expected, and wait for all sends.

        Every rank that fails does this, so each message of the call is matched once
        and the group is clean for the next call.

        Args:
            owed: ``(key, dst)`` of every message this rank sends in the call.
            expected: ``(key, src)`` of every message it receives in the call.
            error: what went wrong (sent with each error header).
        """
        for key, dst in owed:
            if (key, dst) not in self.sent:
                self.send(key, dst, None, status=ERROR, error=error)
        for key, src in expected:
            if (key, src) not in self.received:
                try:
                    self.recv(key, src)
                except PeerFailed:
                    pass
        self.finish()
