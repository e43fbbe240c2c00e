"""Point-to-point messages between pp ranks: a header, then the tensor, matched by tag.

Every message of a pipeline step (an activation, an output gradient, the loss)
travels as a small int32 *header* (status; one tensor, a tuple or a list; the
first entry's dtype and shape, or none) followed by its payloads, one per
tensor (a stage may return a tuple of up to :data:`MAX_ENTRIES` tensors and
Nones; the other entries' dtypes and shapes go in a second header, sent only for
a tuple of more than one entry).
The header lets the receiver allocate the payloads when shapes were not
declared, and it carries the *status*: ``OK``, ``NONE`` (no tensor, e.g. the
gradient of an integer activation) or ``ERROR`` (the sender failed). A
failed rank still sends every message it owes, as an error header, and still
receives every message it expects: so its peers stop with an error instead of
waiting for ever, and no message is left unmatched in the persistent process
group (see :meth:`Messenger.settle`).

With declared shapes (``shapes=``, or inferred by the first call) a message is
*one* transfer: the payloads' bytes, each at a 16-byte aligned offset, then the
header, in one uint8 buffer whose layout both sides compute from the
declaration (:func:`packed_layout`); the receiver returns views of it. The
sender always sends every declared payload (zeros where it has none, or after
an error), so both sides post the same messages. A point-to-point message costs
far more than copying an activation (about a millisecond on gloo), so one
transfer instead of a header and then payloads is what makes a step as fast as
torch's pipelining (whose stages infer shapes once and send bare tensors).

An error header is followed by the error's text (UTF-8 bytes, its length in the
header), so every rank's error says what went wrong first and where.

Tags: message ``k`` of a call uses tags ``base + 11k`` (the header, or the packed
message), ``base + 11k + 1`` (error text), ``base + 11k + 2`` (the second header)
and ``base + 11k + 3 + j`` (payload of entry ``j``), from :data:`PIPELINE` (a
block after ``shard_params``' tags).
Sends are non-blocking (``batch_isend_irecv``) and waited by :meth:`Messenger.finish`;
receives block, unless posted ahead (:meth:`Messenger.prepost`: a declared message's
receive posted while the rank still computes, so the transfer is done when it is
needed). Activation and gradient buffers can be kept from one call to the next
(:class:`MessageBuffers`). Nothing here is differentiable: the runtime detaches first.

Example:
    >>> messenger = Messenger(ax, tag_of={("act", 0, 0): 0}.__getitem__)
    >>> messenger.send(("act", 0, 0), dst=1, value=x)       # on pp rank 0
    >>> x = messenger.recv(("act", 0, 0), src=0)             # on pp rank 1
    >>> messenger.finish()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist

from shardfn.primitives import stats
from shardfn.primitives._comm import Axis
from shardfn.primitives.tags import UNITS, TagBlock
from shardfn.transforms.pipeline._buffers import POOLED_KINDS, MessageBuffers
from shardfn.transforms.pipeline._declared import (
    _FULL_LEN,
    _HEADER_LEN,
    _TENSOR,
    MAX_ENTRIES,
    Declared,
    DeclaredValue,
    Packed,
    _decode,
    _grad_flags,
    _header,
    _header_values,
    _nbytes,
    _rebuild,
    declared_entries,
    declared_of_value,
    entries_of,
    make_packed,
    packed_layout,
)
from shardfn.transforms.pipeline.kinds import MessageKey, Status

__all__ = ["ERROR", "MAX_ENTRIES", "NONE", "OK", "PIPELINE", "Declared", "DeclaredValue",
           "MessageBuffers", "Messenger", "Packed", "PeerFailed", "Status",
           "declared_entries", "declared_of_value", "entries_of", "make_packed",
           "packed_layout"]

#: the pipeline's message tags (right after shard_params' block)
PIPELINE = TagBlock("pipeline_stages messages", UNITS.start + UNITS.size, 1 << 22)

OK, ERROR, NONE = Status.OK, Status.ERROR, Status.NONE
_TAGS_PER_MESSAGE = 3 + MAX_ENTRIES  # header, error text, second header, one per payload
_MAX_TEXT = 4096  # bytes of an error's text sent with its header
Key = MessageKey  # (MessageKind, stage, microbatch); plain-string kinds compare equal


class PeerFailed(RuntimeError):
    """A peer sent an error header: it failed during this call (its own error says why)."""


class Messenger:
    """One call's messages over the pp axis: sends in flight, what was sent and received.

    Args:
        ax: the resolved pp axis (peers are axis indices).
        tag_of: message key -> its number ``k`` in this call (unique per pair of ranks).
        declared: message key -> :data:`DeclaredValue` when its payloads are declared
            (both sides know them), else None (the receiver reads them off the header first).
        device: where messages live (the mesh's device: CUDA for NCCL, CPU for gloo).
        pool: keeps the packed buffers of activations and gradients for the next call
            (:class:`MessageBuffers`); None: fresh buffers every time.

    Attributes:
        header_first: how many messages this rank sent or received whose payload had to
            wait for the header (shapes not declared): one round trip more each.
    """

    def __init__(self, ax: Axis, tag_of: Callable[[Key], int],
                 declared: Callable[[Key], DeclaredValue | None] = lambda key: None,
                 device: torch.device | str = "cpu", pool: MessageBuffers | None = None):
        self.ax = ax
        self.device = torch.device(device)
        self.pool = pool
        #: (key, src) -> (works, its Packed buffer) of a packed receive posted, not waited
        self.posted: dict[tuple[Key, int], tuple[list, Packed]] = {}
        self.tag_of = tag_of
        self.declared = declared
        #: (key, dst) -> (works, tensors kept alive until they are waited), in posting order
        self.pending: dict[tuple[Key, int], tuple[list, list]] = {}
        self.sent: set[tuple[Key, int]] = set()
        self.received: set[tuple[Key, int]] = set()
        self.header_first = 0
        #: key -> per entry, whether the sender's tensor required grad (from its header)
        self.grad_flags: dict[Key, tuple[bool, ...]] = {}

    def _tags(self, key: Key) -> tuple[int, int, int, list[int]]:
        """``(header, text, second header, payload tags per entry)`` of message ``key``."""
        k = self.tag_of(key)
        if not 0 <= _TAGS_PER_MESSAGE * (k + 1) <= PIPELINE.size:
            raise ValueError(f"pipeline message {key} needs tag number {k}, beyond the "
                             f"{PIPELINE.size // _TAGS_PER_MESSAGE} the pipeline's tag block "
                             "holds; use fewer stages or micro-batches")
        base = PIPELINE.start + _TAGS_PER_MESSAGE * k
        return base, base + 1, base + 2, [base + 3 + j for j in range(MAX_ENTRIES)]

    def _packed(self, direction: Literal["send", "recv"], key: Key, peer: int,
                declared: list[Declared | None]) -> Packed:
        """The packed buffer of this message: kept from the last call (``pool``) or fresh."""
        if self.pool is None or key[0] not in POOLED_KINDS:
            return make_packed(declared, self.device)
        return self.pool.get((direction, key, peer, tuple(declared), self.device),
                             lambda: make_packed(declared, self.device))

    def _post(self, ops: list, description: str) -> list:
        with stats.collective_scope(self.ax.describe(description)):
            return [w for w in dist.batch_isend_irecv(ops) if w is not None]

    def send(self, key: Key, dst: int, value: Any, status: Status = OK, error: str = "") -> None:
        """Post ``value`` (a tensor or a tuple/list of tensors and Nones; or a header of
        ``status`` alone) to axis index ``dst``; not waited.

        With declared payloads every declared entry is sent (zeros where ``value`` has
        none, or after an error), so both sides post the same messages.
        With ``status=ERROR`` the text ``error`` follows.

        Raises:
            ValueError: ``value`` has a payload where the declaration has none (checked
                before anything is posted).
        """
        declared = declared_entries(self.declared(key))
        header_tag, text_tag, second_tag, payload_tags = self._tags(key)
        container, entries = entries_of(value) if status == OK else (_TENSOR, [])
        payloads = [None if e is None else e.detach() for e in entries]
        if declared:
            wrong = [j for j, e in enumerate(payloads) if e is not None and
                     (j >= len(declared) or declared[j] != (tuple(e.shape), e.dtype))]
            if wrong:
                j = wrong[0]
                raise ValueError(f"pipeline message {key}: entry {j} has shape "
                                 f"{tuple(payloads[j].shape)} {payloads[j].dtype}, but its "
                                 f"declaration is {declared[j] if j < len(declared) else None} "
                                 "(from shapes=, or inferred by the first call with this batch: "
                                 "shapes='dynamic' exchanges shapes with every message)")
            payloads += [None] * (len(declared) - len(payloads))
            self._send_packed(key, dst, (header_tag, text_tag), declared,
                              _header_values(status, container, entries), payloads,
                              error if status == ERROR else None)
            return
        payloads = [None if e is None else e.to(self.device).contiguous() for e in payloads]
        self.header_first += int(any(e is not None for e in payloads))
        full = _header(status, container, entries)
        header = full[:_HEADER_LEN].clone().to(self.device)
        ops = [dist.P2POp(dist.isend, header, group=self.ax.group, group_peer=dst,
                          tag=header_tag)]
        if status == OK and len(entries) > 1:
            ops.append(dist.P2POp(dist.isend, full[_HEADER_LEN:].clone().to(self.device),
                                  group=self.ax.group, group_peer=dst, tag=second_tag))
        for payload, tag in zip(payloads, payload_tags, strict=False):
            if payload is not None:
                stats.record(self.ax.key, "pipeline_send",
                             payload.numel() * payload.element_size())
                ops.append(dist.P2POp(dist.isend, payload, group=self.ax.group,
                                      group_peer=dst, tag=tag))
        if status == ERROR:
            text, header[3] = self._error_text(error, dst, text_tag)
            ops.append(text)
        self._post_sends(key, dst, ops)

    def _send_packed(self, key: Key, dst: int, tags: tuple[int, int],
                     declared: list[Declared | None], header: list[int],
                     payloads: list[torch.Tensor | None], error: str | None) -> None:
        """One transfer: the declared payloads (zeros where ``payloads`` has None) and the
        header in one buffer; then the error text, if any."""
        header_tag, text_tag = tags
        packed = self._packed("send", key, dst, declared)
        for entry, view, payload in zip(declared, packed.payloads, payloads, strict=True):
            if entry is None:
                continue
            stats.record(self.ax.key, "pipeline_send", _nbytes(entry))
            if payload is None:
                view.zero_()
            else:
                view.copy_(payload)
        text = []
        if error is not None:
            op, header[3] = self._error_text(error, dst, text_tag)
            text.append(op)
        if header != packed.written:  # a kept buffer of an unchanged header: already there
            packed.header.copy_(torch.tensor(header, dtype=torch.int32))
            packed.written[:] = header
        self._post_sends(key, dst, [dist.P2POp(dist.isend, packed.buffer, group=self.ax.group,
                                               group_peer=dst, tag=header_tag), *text])

    def _error_text(self, error: str, dst: int, tag: int) -> tuple[dist.P2POp, int]:
        """The send of an error's text (UTF-8, at most ``_MAX_TEXT`` bytes), and its
        length (for the header)."""
        text = torch.frombuffer(bytearray(error.encode()[:_MAX_TEXT] or b" "),
                                dtype=torch.uint8).to(self.device)
        return dist.P2POp(dist.isend, text, group=self.ax.group, group_peer=dst, tag=tag), \
            text.numel()

    def _post_sends(self, key: Key, dst: int, ops: list) -> None:
        works = self._post(ops, f"pipeline send {key} to pp {dst}")
        self.pending[(key, dst)] = (works, [op.tensor for op in ops])
        self.sent.add((key, dst))

    def prepost(self, key: Key, src: int) -> bool:
        """Post the receive of message ``key`` from ``src`` now, to be waited by
        :meth:`recv`: the transfer then happens while this rank computes (a message
        whose payloads are declared only; the others wait for their header). On gloo
        (CPU) only: on NCCL a receive posted ahead would hold up the sends queued
        behind it on the communicator.

        Returns:
            Whether a receive was posted.
        """
        if self.device.type != "cpu":
            return False
        return self._post_recv(key, src)

    def _post_recv(self, key: Key, src: int) -> bool:
        """Post the packed receive of ``key`` into :attr:`posted` (declared messages not
        yet posted or received only)."""
        declared = declared_entries(self.declared(key))
        if not declared or (key, src) in self.posted or (key, src) in self.received:
            return False
        packed = self._packed("recv", key, src, declared)
        works = self._post([dist.P2POp(dist.irecv, packed.buffer, group=self.ax.group,
                                       group_peer=src, tag=self._tags(key)[0])],
                           f"pipeline recv {key} from pp {src}")
        self.posted[(key, src)] = (works, packed)
        return True

    def _recv_packed(self, key: Key, src: int, declared: list[Declared | None]) -> Any:
        self._post_recv(key, src)  # unless posted ahead
        works, packed = self.posted.pop((key, src))
        self._wait(works, f"pipeline recv {key} from pp {src}")
        values = packed.header.tolist()
        status, container, found, text_len = _decode(values)
        self.grad_flags[key] = _grad_flags(values)
        wrong = [j for j, d in enumerate(found)
                 if d is not None and (j >= len(declared) or declared[j] != d)]
        if wrong:  # the sender checked its payloads against its own declaration
            j = wrong[0]
            self.received.add((key, src))  # taken: settling must not wait for it again
            raise RuntimeError(f"pipeline message {key} from pp rank {src}: entry {j} is "
                               f"{found[j]} on the sender, but this rank declares "
                               f"{declared[j] if j < len(declared) else None}; the ranks' "
                               "declared or inferred shapes disagree (pp.shape_cache.clear() "
                               "on every rank, or shapes='dynamic')")
        entries = [None if d is None else packed.payloads[j] for j, d in enumerate(found)]
        return self._finish_recv(key, src, status, container, entries, text_len,
                                 self._tags(key)[1])

    def _finish_recv(self, key: Key, src: int, status: Status, container: int,
                     entries: list[torch.Tensor | None], text_len: int, text_tag: int) -> Any:
        text = ""
        if status == ERROR:
            raw = torch.empty(text_len, dtype=torch.uint8, device=self.device)
            self._wait_all([dist.P2POp(dist.irecv, raw, group=self.ax.group, group_peer=src,
                                       tag=text_tag)], f"pipeline recv {key} from pp {src}")
            text = bytes(raw.cpu().tolist()).decode(errors="replace").strip()
        self.received.add((key, src))
        if status == ERROR:
            raise PeerFailed(f"pp rank {src} failed during this pipeline call (message {key}): "
                             f"{text}")
        if status != OK:
            return None
        return _rebuild(container, entries)

    def recv(self, key: Key, src: int) -> Any:
        """Receive message ``key`` from axis index ``src``: a tensor, a tuple/list of tensors
        (and Nones) as sent, or None for a ``NONE`` header.

        Raises:
            PeerFailed: the sender failed (it sent an error header).
        """
        declared = declared_entries(self.declared(key))
        if declared:
            return self._recv_packed(key, src, declared)
        header_tag, text_tag, second_tag, payload_tags = self._tags(key)
        header = torch.empty(_HEADER_LEN, dtype=torch.int32, device=self.device)
        second = torch.zeros(_FULL_LEN - _HEADER_LEN, dtype=torch.int32, device=self.device)
        payloads: list[torch.Tensor | None] = []
        description = f"pipeline recv {key} from pp {src}"
        self._wait_all([dist.P2POp(dist.irecv, header, group=self.ax.group, group_peer=src,
                                   tag=header_tag)], description)
        if int(header[0]) == OK and int(header[2]) > 1:
            self._wait_all([dist.P2POp(dist.irecv, second, group=self.ax.group,
                                       group_peer=src, tag=second_tag)], description)
        values = header.tolist() + second.tolist()
        status, container, found, text_len = _decode(values)
        self.grad_flags[key] = _grad_flags(values)
        if status == OK and any(d is not None for d in found):
            self.header_first += 1
            payloads = [None if d is None else torch.empty(d.shape, dtype=d.dtype,
                                                           device=self.device) for d in found]
            self._wait_all([dist.P2POp(dist.irecv, payload, group=self.ax.group,
                                       group_peer=src, tag=tag)
                            for payload, tag in zip(payloads, payload_tags, strict=False)
                            if payload is not None], description)
        entries = [None if d is None else payloads[j] for j, d in enumerate(found)]
        return self._finish_recv(key, src, status, container, entries, text_len, text_tag)

    def _wait_all(self, ops: list, description: str) -> None:
        if ops:
            self._wait(self._post(ops, description), description)

    def _wait(self, works: list, description: str) -> None:
        for work in works:
            with stats.collective_scope(self.ax.describe(description)):
                work.wait()

    def finish(self) -> None:
        """Wait for every send posted so far."""
        for sent in list(self.pending):
            self.wait_sent(*sent)

    def wait_sent(self, key: Key, dst: int) -> None:
        """Wait for the send of ``key`` to ``dst`` (if still pending) and drop its tensors."""
        works, _ = self.pending.pop((key, dst), ([], []))
        self._wait(works, f"pipeline send {key} to pp {dst}")

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
