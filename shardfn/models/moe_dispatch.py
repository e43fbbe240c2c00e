"""How a mixture-of-experts layer reaches its experts: on this rank, or over an ``"ep"`` axis.

A :class:`~shardfn.models.moe.MoE` layer routes its tokens, sorts the kept assignments by
expert and hands the rows with the count per expert to its *dispatch*:

* :data:`LOCAL` runs every expert here (the unsplit layer);
* :class:`AllToAllExperts` is expert parallelism (what ``sf.expert_parallel`` installs):
  this rank holds experts ``[i * E/ep, (i+1) * E/ep)`` of the axis; the counts go first (an
  ``all_to_all`` of the ``[ep, E/ep]`` count matrix), then the rows with variable splits
  (:func:`~shardfn.primitives.all_to_all_v.all_to_all_v`), grouped by local expert, computed,
  put back in arrival order and sent home by the reverse exchange. Every op is
  differentiable, so the expert gradients come back summed over every rank's tokens.

Communication per layer call and rank, ``R`` the rows this rank sends to other ranks and
``R'`` the rows it receives from them, ``H`` the hidden size, ``b`` bytes per element:
the counts ``8 E (ep-1)/ep`` bytes, dispatch ``R H b``, combine ``R' H b``; backward sends
the gradients of the same rows the other way: ``R H b`` (combine's) and, when the layer's
input needs a gradient, ``R' H b`` (dispatch's). A step: ``2 (R + R') H b`` per layer.

Example:
    >>> moe.dispatch = AllToAllExperts(mesh, "ep")   # done by sf.expert_parallel on a copy
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from shardfn.mesh import Mesh
from shardfn.primitives.all_to_all_v import all_to_all_v
from shardfn.primitives.collectives import all_to_all

__all__ = ["LOCAL", "AllToAllExperts", "Dispatch", "LocalExperts", "expert_major_order"]


class Dispatch(Protocol):
    """``(experts, rows, counts) -> outputs``: rows sorted by global expert, ``counts[e]``
    rows for expert ``e``; the outputs in the same row order."""

    def __call__(self, experts: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class LocalExperts:
    """Every expert on this rank: ``experts.run(rows, counts)``."""

    def __call__(self, experts: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return experts.run(rows, counts)

    def __deepcopy__(self, memo: dict) -> LocalExperts:
        return self


LOCAL = LocalExperts()


def expert_major_order(received: torch.Tensor) -> torch.Tensor:
    """Row indices that regroup rows arrived source-major into local-expert-major order.

    Args:
        received: ``[ep, local]`` int, rows from source ``s`` for local expert ``e``;
            the rows arrived grouped by source, then by expert.

    Returns:
        int64 indices: for expert 0 the rows from source 0, 1, ..., then expert 1, ...

    Example:
        >>> expert_major_order(torch.tensor([[1, 2], [1, 0]])).tolist()
        [0, 3, 1, 2]
    """
    counts = received.tolist()
    starts, at = [], 0
    for row in counts:
        starts.append([])
        for n in row:
            starts[-1].append(at)
            at += n
    order = [i for e in range(received.shape[1]) for s in range(received.shape[0])
             for i in range(starts[s][e], starts[s][e] + counts[s][e])]
    return torch.tensor(order, dtype=torch.int64, device=received.device)


@dataclasses.dataclass(frozen=True, eq=False)
class AllToAllExperts:
    """Expert parallelism over ``axis``: this rank's experts are its block of ``E / ep``.

    Attributes:
        mesh: the mesh of the axis.
        axis: the expert-parallel axis name.
    """

    mesh: Mesh
    axis: str

    def __deepcopy__(self, memo: dict) -> AllToAllExperts:
        return self  # the mesh holds process groups: shared, never copied

    def __call__(self, experts: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep = self.mesh.size(self.axis)
        local = experts.gate_up_proj.shape[0]
        if local * ep != len(counts):
            raise ValueError(f"expert parallel over axis {self.axis!r} (ep={ep}): this rank holds "
                             f"{local} experts, but the router chose among {len(counts)}; "
                             f"expected {len(counts)} / {ep} local experts")
        sent = torch.tensor(counts, dtype=torch.int64, device=rows.device).view(ep, local)
        received = all_to_all(sent, self.axis, 0, 0, mesh=self.mesh)  # [source, local expert]
        send_rows, receive_rows = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_v(rows, self.axis, send_rows, receive_rows, mesh=self.mesh)
        order = expert_major_order(received)
        outputs = experts.run(arrived[order], received.sum(0).tolist())
        in_arrival_order = outputs[torch.argsort(order)]
        return all_to_all_v(in_arrival_order, self.axis, receive_rows, send_rows, mesh=self.mesh)
