"""Bytes a rank sends, counted the same way for torch and shardfn.

``sf.comm_stats()`` counts shardfn's own collectives only. :class:`CountCollectives`
counts every collective of the process while it is open, at the two places all of them
pass:

* the methods of ``torch.distributed.ProcessGroup`` (``send``, ``_allgather_base``,
  ``_reduce_scatter_base``, ``allreduce``, ...), patched for the block, in every thread:
  what ``torch.distributed``'s functions call (FSDP2, ``pipelining``, shardfn's
  point-to-point exchanges posted from its background thread);
* the functional collectives (``_c10d_functional::all_reduce``, ... : DTensor and
  shardfn's differentiable collectives), seen by a ``TorchDispatchMode`` on the thread
  that opens the block. Their kernels call the process group in C++, not through the
  Python methods, so nothing is counted twice.

Each collective adds the bytes this rank sends under the ring algorithm, the figures
``sf.comm_stats`` uses (``shardfn/primitives/stats.py``), for ``N`` ranks in the group
and ``B`` bytes:

=====================  ==================
all-reduce             ``2 B (N-1)/N``
all-gather             ``B_out (N-1)/N``
reduce-scatter         ``B_in (N-1)/N``
all-to-all, broadcast  ``B (N-1)/N``
send                   ``B``
=====================  ==================

Receives, waits and barriers send nothing; a collective without a formula here (a
functional one not listed, or the methods ``gather``, ``scatter``, ``reduce``) raises,
naming it, rather than go uncounted. ``N`` is the process group's size for the methods,
and the given ``world`` for functional collectives, which name their group by a string
(every group in these benchmarks spans the world).

Example:
    >>> with CountCollectives(dist.get_world_size()) as counter:
    ...     loss.backward()
    >>> counter.sent_bytes
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CountCollectives", "sent_bytes"]

_REDUCE, _GATHER, _SCATTER, _P2P = "reduce", "gather", "scatter", "p2p"
# ProcessGroup method -> (index of what it sends among the arguments after self, formula)
_METHODS = {
    "allreduce": (0, _REDUCE), "allreduce_coalesced": (0, _REDUCE),
    "allgather": (1, _GATHER), "_allgather_base": (1, _GATHER),
    "allgather_into_tensor_coalesced": (1, _GATHER), "allgather_coalesced": (1, _GATHER),
    "all_gather_single": (1, _GATHER), "all_gather_single_coalesced": (1, _GATHER),
    "reduce_scatter": (1, _SCATTER), "_reduce_scatter_base": (1, _SCATTER),
    "reduce_scatter_tensor_coalesced": (1, _SCATTER), "reduce_scatter_single": (1, _SCATTER),
    "reduce_scatter_single_coalesced": (1, _SCATTER), "alltoall": (1, _SCATTER),
    "alltoall_base": (1, _SCATTER), "all_to_all_single": (1, _SCATTER),
    "broadcast": (0, _SCATTER), "send": (0, _P2P),
}
# _c10d_functional op -> the same (its input is the first argument)
_FUNCTIONAL = {
    **dict.fromkeys(("all_reduce", "all_reduce_", "all_reduce_coalesced",
                     "all_reduce_coalesced_"), (0, _REDUCE)),
    **dict.fromkeys(("all_gather_into_tensor", "all_gather_into_tensor_out",
                     "all_gather_into_tensor_coalesced"), (0, _GATHER)),
    **dict.fromkeys(("reduce_scatter_tensor", "reduce_scatter_tensor_out",
                     "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
                     "broadcast_"), (0, _SCATTER)),
    "isend": (0, _P2P),
}
_SILENT = {"irecv", "wait_tensor", "_wrap_tensor_autograd"}
_UNCOUNTED = ("gather", "scatter", "reduce")  # ProcessGroup methods without a formula here


def _nbytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor or nested lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def sent_bytes(kind: str, payload, group_size: int) -> float:
    """Bytes one rank sends in a collective of ``kind`` moving ``payload`` (what the rank
    contributes: the input of a gather or a reduction, the tensors of a send).

    Example:
        >>> sent_bytes("reduce", torch.zeros(4), 2)
        16.0
    """
    size, share = _nbytes(payload), (group_size - 1) / group_size
    return {_REDUCE: 2 * size * share, _GATHER: size * (group_size - 1),
            _SCATTER: size * share, _P2P: float(size)}[kind]


def _refuse(name: str):
    def refuse(group, *args, **kwargs):
        raise ValueError(f"CountCollectives: no byte count for ProcessGroup.{name}; add it "
                         "to _METHODS with its ring formula")

    return refuse


class CountCollectives(TorchDispatchMode):
    """Count the bytes this rank sends while the block is open (see the module docstring).

    Attributes:
        sent_bytes: the total (int).
        by_op: ``{op name: (calls, bytes)}``.
    """

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self._lock = threading.Lock()
        self._bytes: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)
        self._saved: dict[str, object] = {}

    def _add(self, op: str, nbytes: float) -> None:
        with self._lock:
            self._bytes[op] += nbytes
            self._calls[op] += 1

    def _wrap(self, name: str, method):
        index, kind = _METHODS[name]

        def counted(group, *args, **kwargs):
            payload = args[index] if len(args) > index else None
            self._add(name, sent_bytes(kind, payload, group.size()))
            return method(group, *args, **kwargs)

        return counted

    def __enter__(self):
        own = vars(dist.ProcessGroup)  # the class's own descriptors, put back as they were
        for name in (*_METHODS, *_UNCOUNTED):
            if name in own:
                self._saved[name] = own[name]
                method = getattr(dist.ProcessGroup, name)
                setattr(dist.ProcessGroup, name, self._wrap(name, method) if name in _METHODS
                        else _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, descriptor in self._saved.items():
                setattr(dist.ProcessGroup, name, descriptor)
            self._saved.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            op = func._schema.name.split("::", 1)[1]
            if op not in _SILENT:
                if op not in _FUNCTIONAL:
                    raise ValueError(f"CountCollectives: no byte count for functional "
                                     f"collective {op!r}; add its ring formula to _FUNCTIONAL")
                index, kind = _FUNCTIONAL[op]
                self._add(op, sent_bytes(kind, args[index], self.world))
        return func(*args, **(kwargs or {}))

    @property
    def sent_bytes(self) -> int:
        return int(round(sum(self._bytes.values())))

    @property
    def by_op(self) -> dict[str, tuple[int, int]]:
        return {op: (self._calls[op], int(self._bytes[op])) for op in self._calls}
