"""The exchange layer of `shard_params`: the gather and the reduction of one unit.

A unit's all-gather writes straight into the unit's full parameters and its
reduce-scatter reads straight from the full gradients: no flat buffer is
packed before the collective or unpacked after it.

* :class:`UnitGather` owns one buffer per (compute) dtype holding the unit's
  sharded parameters at full size, each padded to whole shards, end to end.
  Rank ``j``'s shard of a parameter is one contiguous range of it (dim-0
  sharding), so the rank copies its own shards in and receives every other
  rank's range in place. The full parameters are aliases of the buffer
  (``set_`` on its storage, each with its own version counter), so
  :meth:`UnitGather.release` can free the storage after forward while
  autograd still holds the aliases, and :meth:`UnitGather.start` refills the
  same storage before backward (FSDP's storage-resize trick). Everything that
  writes into the buffer runs with functorch disabled: under
  ``torch.func.grad`` the backward runs inside the transform, which refuses
  in-place writes to tensors it did not create.
* :class:`UnitReduce` sends every other rank its rows of each full gradient
  and sums the rows this rank owns into zero-padded shard gradients.

Both use the piece exchange of :mod:`shardfn.primitives.piece_exchange` (gloo
point-to-point sends and receives, about twice as fast as gloo's all_gather /
reduce_scatter on a 2-rank CPU world, and free of their copies), posted from a
background thread on CPU (:mod:`shardfn.primitives._poster`: gloo's connection lock
would otherwise stall the compute thread behind a transfer in flight). Every exchange
of an apply call gets its own tag (from :data:`shardfn.primitives.tags.UNITS`), so several may be in
flight between the same ranks.

* :class:`Reduction` wraps :class:`UnitReduce` with what a gradient needs around the
  exchange: the leaves asked for, FSDP2's pre/post division, the HSDP sum over the
  replica axis, the replicated (0-dim) leaves, the ignored ones (returned untouched),
  the copy back to the storage device.

Example:
    >>> tags = Tags()
    >>> full = UnitGather(unit, shards, plan.ax, plan.place, tags()).wait()
    >>> shard_grads = Reduction(plan, unit, full_grads, tags()).wait()
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from shardfn import _torch_internals as ti
from shardfn.primitives import _comm, stats
from shardfn.primitives._comm import Axis
from shardfn.primitives.flat import all_reduce_async
from shardfn.primitives.piece_exchange import (
    BucketPlan,
    Exchange,
    finish_reduce_scatter,
    start_all_gather,
    start_reduce_scatter,
)
from shardfn.primitives.reduce_scaling import divide_factors
from shardfn.primitives.reduced import mark_reduced
from shardfn.primitives.tags import UNITS
from shardfn.transforms.shard_params.placement import Placement
from shardfn.transforms.shard_params.plan import Flat, Plan, Unit

__all__ = ["Reduction", "Tags", "UnitGather", "UnitReduce", "no_functorch"]

Params = dict[str, torch.Tensor]

no_functorch = ti.DisableFuncTorch
"""Context manager: run plain tensor ops even inside a torch.func transform's backward."""

# The storage resize goes through the op (not ``untyped_storage().resize_()``, which is
# public but invisible to dispatch modes): ``shardfn.memory``'s tracker sees the frees.
_resize = ti.resize_storage_bytes_


def _on_cpu(tensors: list[torch.Tensor]) -> bool:
    """Post from the background thread (gloo on CPU; a CUDA post stays on the caller's
    stream)."""
    return bool(tensors) and tensors[0].device.type == "cpu"


def _plan(size: int, segments: list[list[tuple[int, int, int]]]) -> BucketPlan:
    """A plan whose block ``j`` is ``segments[j]`` (pieces need not be adjacent)."""
    length = sum(hi - lo for block in segments for _, lo, hi in block)
    block = max([sum(hi - lo for _, lo, hi in b) for b in segments] + [1])
    return BucketPlan(size, length, block, tuple(tuple(b) for b in segments))


def _alias(buffer: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor of ``shape`` on ``buffer``'s storage (its own version counter)."""
    out = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    return out.set_(buffer.untyped_storage(), offset, shape)


class UnitGather:
    """The full parameters of one unit call, all-gathered in place from every rank's shards.

    Args:
        unit: the unit.
        shards: ``name -> this rank's shard`` (at least the unit's sharded leaves).
        ax: the sharding axis.
        place: dtypes and devices (the shards are cast / copied as they are copied in).
        tag: the message tag of the first exchange.

    Example:
        >>> gather = UnitGather(unit, shards, ax, place, tag)   # issued
        >>> full = gather.wait()                                # name -> full tensor
        >>> gather.release(); gather.start(shards, tag2); gather.wait()   # refilled
    """

    def __init__(self, unit: Unit, shards: Mapping[str, torch.Tensor], ax: Axis,
                 place: Placement, tag: int):
        self.unit, self.ax, self.place = unit, ax, place
        self.buffers: list[torch.Tensor] = []
        self.full: dict[str, torch.Tensor] = {}
        self.own: list[str] = []  # the leaf of each piece of this rank's block
        n = ax.size
        segments: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        with no_functorch():
            for k, flat in enumerate(unit.gather):
                device = place.compute or shards[flat.names[0]].device
                buffer = torch.empty(n * flat.chunk, dtype=flat.dtype, device=device)
                self.buffers.append(buffer)
                for name, shape, local, offset in zip(flat.names, flat.shapes,
                                                      flat.local_shapes, flat.offsets,
                                                      strict=True):
                    numel, start = math.prod(local), n * offset
                    if numel:
                        for j in range(n):
                            segments[j].append((k, start + j * numel, start + (j + 1) * numel))
                        self.own.append(name)
                    self.full[name] = _alias(buffer, start, shape)
        self.plan = _plan(n, segments)
        self.exchange: Exchange | None = None
        self.start(shards, tag)

    def start(self, shards: Mapping[str, torch.Tensor], tag: int) -> UnitGather:
        """(Re)allocate the storage, copy this rank's shards in and issue the exchange."""
        ax, unit = self.ax, self.unit
        with no_functorch():
            for buffer in self.buffers:
                nbytes = buffer.numel() * buffer.element_size()
                if buffer.untyped_storage().nbytes() != nbytes:
                    _resize(buffer, nbytes)
            # send each shard as it is when it has the compute dtype (and copy it in while
            # the exchange runs); cast it into place first otherwise
            own, later = [], []
            for name, (k, lo, hi) in zip(self.own, self.plan.blocks[ax.index], strict=True):
                piece, source = self.buffers[k][lo:hi], self.place.to_compute(shards[name])
                if source.dtype == piece.dtype and ax.size > 1:
                    own.append(source.reshape(-1))
                    later.append((piece, own[-1]))
                else:
                    piece.copy_(source.reshape(-1))  # casts
                    own.append(piece)
            if ax.size > 1:
                for flat in unit.gather:
                    stats.record(ax.key, "all_gather",
                                 flat.chunk * flat.dtype.itemsize * (ax.size - 1))
                self.exchange = start_all_gather(self.plan, own, self.buffers, ax, tag=tag,
                                                 what=f"all_gather of unit {unit.label}",
                                                 background=_on_cpu(self.buffers))
            for piece, source in later:
                piece.copy_(source)
        return self

    def wait(self) -> dict[str, torch.Tensor]:
        """The unit's full parameters (``name -> tensor`` of the global shape)."""
        if self.exchange is not None:
            with no_functorch():
                self.exchange.wait()
            self.exchange = None
        return self.full

    def release(self) -> None:
        """Free the storage (the aliases stay valid objects, without data, until refilled)."""
        self.wait()
        with no_functorch():
            for buffer in self.buffers:
                _resize(buffer, 0)


class UnitReduce:
    """The reduce-scatter of one unit's full gradients, in flight.

    Takes ownership of ``grads``: each is divided by its flat's ``pre`` factor (FSDP2's
    pre-division, so that a low-precision sum does not overflow where the mean fits),
    cast to its reduce dtype (a no-op without ``precision``) and read by the exchange;
    nothing is packed.

    Args:
        unit: the unit.
        grads: ``name -> full gradient`` of the leaves of ``flats`` (popped).
        ax: the sharding axis.
        tag: the message tag.
        flats: the flats to reduce (default ``unit.scatter``: every trainable sharded leaf).
        pre: per flat, the divisor applied before the sum (default 1 each).

    Example:
        >>> chunks = UnitReduce(unit, grads, ax, tag).wait()  # one flat shard per dtype
    """

    def __init__(self, unit: Unit, grads: dict[str, torch.Tensor], ax: Axis, tag: int,
                 flats: tuple[Flat, ...] | None = None, pre: Sequence[float] | None = None):
        self.ax, self.unit = ax, unit
        self.flats = unit.scatter if flats is None else flats
        self.leaves: list[torch.Tensor] = []
        self.outs: list[torch.Tensor] = []  # this rank's piece of each leaf, in its chunk
        self.chunks: list[torch.Tensor] = []
        n = ax.size
        segments: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        with no_functorch():
            for k, flat in enumerate(self.flats):
                grad0 = grads[flat.names[0]]
                divisor = 1.0 if pre is None else pre[k]
                chunk = torch.empty(flat.chunk, dtype=flat.dtype, device=grad0.device)
                self.chunks.append(chunk)
                for name, shape, local, offset in zip(flat.names, flat.shapes,
                                                      flat.local_shapes, flat.offsets,
                                                      strict=True):
                    grad = grads.pop(name).detach()
                    if divisor != 1.0:  # before the cast: a float32 value may not fit fp16
                        grad = grad / divisor
                    grad = grad.to(flat.dtype).reshape(-1)
                    leaf, numel, total = len(self.leaves), math.prod(local), math.prod(shape)
                    self.leaves.append(grad)
                    for j in range(n):
                        lo, hi = j * numel, min((j + 1) * numel, total)
                        if lo < hi:
                            segments[j].append((leaf, lo, hi))
                        if j == ax.index:
                            if lo < hi:
                                self.outs.append(chunk[offset:offset + hi - lo])
                            chunk[offset + max(hi - lo, 0):offset + numel].zero_()  # padding
            self.plan = _plan(n, segments)
            self.exchange: Exchange | None = None
            if n > 1 and self.flats:  # nothing to reduce (frozen, or no gradient wanted)
                for flat in self.flats:
                    stats.record(ax.key, "psum_scatter",
                                 flat.chunk * flat.dtype.itemsize * (n - 1))
                self.exchange = start_reduce_scatter(self.plan, self.leaves, ax, tag=tag,
                                                     what=f"psum_scatter of unit {unit.label}",
                                                     outs=self.outs,
                                                     background=_on_cpu(self.leaves))

    def wait(self) -> list[torch.Tensor]:
        """This rank's summed shard of every flat (``flats``), zero-padded."""
        with no_functorch():
            if self.exchange is not None:
                finish_reduce_scatter(self.plan, self.leaves, self.exchange, self.ax, self.outs,
                                      None)
                self.exchange = None
            elif self.leaves:
                for (leaf, lo, hi), out in zip(self.plan.blocks[self.ax.index], self.outs,
                                               strict=True):
                    out.copy_(self.leaves[leaf][lo:hi])
        self.leaves = []
        return self.chunks


class Reduction:
    """The reduction of one unit's gradients: reduce-scatters issued now, finished by wait().

    Takes ownership of ``grads`` (full gradients of the unit's owned trainable leaves).
    Only the leaves in ``wanted`` (None: all) are reduced: a leaf left out of the
    differentiation costs no communication. They are reduced in the reduce dtype; the
    shard gradients come back in the master dtype, on the storage device. With HSDP the
    shards are then summed over the replica axis. The gradients of ignored leaves
    (``ignored_params=``) come back as computed (master dtype, storage device): the
    caller reduces them.

    In fp16/bf16 the gradients are divided by ``pre`` before the sum and by ``post``
    after it (``divide_factors`` over every data-parallel rank, as FSDP2 does), so a
    mean that fits the dtype does not overflow on the way; ``grad_reduce="sum"``
    multiplies ``pre`` back instead (in the master dtype).
    """

    def __init__(self, plan: Plan, unit: Unit, grads: dict[str, torch.Tensor],
                 tag: int, wanted: frozenset[str] | None = None):
        self.plan, self.unit = plan, unit
        if wanted is not None:
            grads = {n: g for n, g in grads.items() if n in wanted}
        self.flats = unit.scatter_for(wanted)
        count = plan.all_ax.size
        self.factors = [divide_factors(count, flat.dtype) for flat in self.flats]
        self.replicated = {n: grads.pop(n).detach() for n in unit.replicated if n in grads}
        self.ignored = {n: grads.pop(n).detach() for n in unit.ignored if n in grads}
        self.exchange = UnitReduce(unit, grads, plan.ax, tag, self.flats,
                                   [pre for pre, _ in self.factors])

    def _finish(self, chunk: torch.Tensor, pre: float, post: float) -> None:
        """Scale a reduced chunk (a fresh tensor of ours, in the master dtype) in place."""
        with no_functorch():
            if self.plan.grad_reduce == "mean":
                if post != 1.0:
                    chunk.div_(post)
            elif pre != 1.0:
                chunk.mul_(pre)

    def wait(self) -> Params:
        """This rank's shard gradients (``name -> tensor`` of the local shard shape)."""
        plan, unit = self.plan, self.unit
        chunks = self.exchange.wait()
        rep = plan.replicate_ax
        if rep is not None and rep.size > 1 and chunks:
            with stats.collective_scope(rep.describe(f"psum of unit {unit.label}")):
                handles = [all_reduce_async(c, rep) for c in chunks]
                chunks = [ti.c10d_functional.wait_tensor(h) for h in handles]
        place, out = plan.place, {}
        for flat, chunk, (pre, post) in zip(self.flats, chunks, self.factors, strict=True):
            chunk = chunk.to(flat.master)  # a fresh tensor of ours: scaled in place
            self._finish(chunk, pre, post)
            for name, local, offset in zip(flat.names, flat.local_shapes, flat.offsets,
                                           strict=True):
                out[name] = place.to_storage(chunk[offset:offset + math.prod(local)].view(local))
        for name, grad in self.replicated.items():
            master = plan.masters[name]
            dtype = place.comm_reduce_dtype(master)
            pre, post = divide_factors(plan.all_ax.size, dtype)
            reduced = _comm.psum((grad / pre if pre != 1.0 else grad).to(dtype), plan.all_ax)
            reduced = reduced.to(master)
            scaled = (reduced / post if post != 1.0 else reduced) if plan.grad_reduce == "mean" \
                else (reduced * pre if pre != 1.0 else reduced)
            out[name] = place.to_storage(scaled)
        for name, grad in self.ignored.items():  # not reduced, so not marked either
            out[name] = place.to_storage(grad.to(plan.masters[name]))
        # a second reduction over this axis (data_parallel, shard_opt_state) is refused
        mark_reduced([t for n, t in out.items() if n not in self.replicated
                      and n not in self.ignored], plan.all_ax,
                     "sf.shard_params", sharded=plan.ax)
        mark_reduced([out[n] for n in self.replicated if n in out], plan.all_ax,
                     "sf.shard_params", sharded=())
        return out


class Tags:
    """Hands out one apply call's message tags in order, from :data:`UNITS`: every rank
    starts the same exchanges in the same order, so the same exchange gets the same tag."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> int:
        tag = UNITS.tag(self.next)
        self.next += 1
        return tag
