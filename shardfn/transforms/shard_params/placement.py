"""Where a sharded model's tensors live and in which dtypes they travel.

:class:`OffloadPolicy` is what a user passes (``shard_params(..., offload=)``);
:class:`Placement` is the resolved, validated form the plan carries: the
storage device (shards, shard gradients, so optimizer state), the compute
device (where units are gathered and run) and the dtypes of the gathers and
reductions (from a :class:`~shardfn.transforms.precision.Precision`). Every
host<->device copy of the offload path is counted in ``sf.comm_stats()`` under
the axis keys ``"h2d"`` and ``"d2h"``.

Example:
    >>> place = Placement.of(sf.Precision(param_dtype=torch.bfloat16), offload=None)
    >>> place.compute_dtype(torch.float32)
    torch.bfloat16
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from shardfn.primitives import stats
from shardfn.transforms.precision import Precision

__all__ = ["OffloadPolicy", "Placement"]


class OffloadPolicy(NamedTuple):
    """Keep the shards on a storage device and compute on another (ZeRO-Offload / FSDP2).

    Attributes:
        storage_device: where shards, shard gradients and therefore optimizer state live.
        compute_device: where units are gathered and computed (None: ``"cuda"`` when
            available, else ``"cpu"``).
        pin_memory: pin CPU storage for asynchronous copies (None: when CUDA is available).

    Example:
        >>> model = shard_params(fmodel, mesh, offload=OffloadPolicy("cpu", "cuda"))
    """

    storage_device: str | torch.device = "cpu"
    compute_device: str | torch.device | None = None
    pin_memory: bool | None = None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Dtypes and devices of one sharded model (what ``precision=`` and ``offload=`` say).

    Attributes:
        param_dtype: floating leaves are cast to it before the all-gather (None: unchanged).
        reduce_dtype: floating gradients are reduced in it (None: ``param_dtype``, else
            the gradient's own dtype).
        offload: whether shards live on ``storage`` and are copied to ``compute``.
        storage, compute: the devices (both None without offload).
        pin: pin CPU storage.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offload: bool = False
    storage: torch.device | None = None
    compute: torch.device | None = None
    pin: bool = False

    @staticmethod
    def of(precision: Precision | None, offload: OffloadPolicy | bool | None) -> Placement:
        """The placement for ``shard_params(..., precision=, offload=)``; validates both."""
        if precision is not None and not isinstance(precision, Precision):
            raise TypeError(f"precision must be an sf.Precision, got {type(precision).__name__}")
        param_dtype = precision.param_dtype if precision is not None else None
        reduce_dtype = precision.reduce_dtype if precision is not None else None
        for what, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype)
                                          and dtype.is_floating_point):
                raise ValueError(f"precision.{what} must be a floating torch.dtype, got {dtype!r}")
        if offload is None or offload is False:
            return Placement(param_dtype, reduce_dtype or param_dtype)
        if offload is True:
            offload = OffloadPolicy()
        if not isinstance(offload, OffloadPolicy):
            raise TypeError(f"offload must be True or an OffloadPolicy, got {offload!r}")
        cuda = torch.cuda.is_available()
        storage = torch.device(offload.storage_device)
        compute = torch.device(offload.compute_device if offload.compute_device is not None
                               else "cuda" if cuda else "cpu")
        if "meta" in (storage.type, compute.type):
            raise ValueError(f"offload: the meta device holds no values (storage {storage}, "
                             f"compute {compute})")
        pin = offload.pin_memory if offload.pin_memory is not None else cuda
        return Placement(param_dtype, reduce_dtype or param_dtype, True, storage, compute,
                         bool(pin) and storage.type == "cpu")

    # ---- dtypes ---------------------------------------------------------------------------
    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a leaf of ``dtype`` is gathered and computed in."""
        return self.param_dtype if self.param_dtype is not None and dtype.is_floating_point \
            else dtype

    def comm_reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradient of a leaf of (master) ``dtype`` is reduced in."""
        if not dtype.is_floating_point:
            return dtype
        return self.reduce_dtype or self.compute_dtype(dtype)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in its compute dtype (differentiable; the identity when nothing changes)."""
        dtype = self.compute_dtype(t.dtype)
        return t if dtype == t.dtype else t.to(dtype)

    # ---- devices --------------------------------------------------------------------------
    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """A plain copy of ``t`` on the compute device (counted as ``"h2d"``); else ``t``.

        The copy is made even when both devices are equal, so the offload path (and its
        counters) can be exercised on a machine with one device.
        """
        t = t.detach()
        if not self.offload:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, device=self.compute)
        out.copy_(t, non_blocking=self.pin)
        stats.record("h2d", "h2d", t.numel() * t.element_size())
        return out

    def to_storage(self, t: torch.Tensor) -> torch.Tensor:
        """A plain copy of ``t`` on the storage device (counted as ``"d2h"``); else ``t``."""
        if not self.offload:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, device=self.storage, pin_memory=self.pin)
        out.copy_(t.detach())  # synchronous: the optimizer reads it next
        stats.record("d2h", "d2h", t.numel() * t.element_size())
        return out

    def store(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` placed on the storage device (pinned if asked), not counted; for init/shard."""
        if not self.offload:
            return t
        if t.device != self.storage:
            t = t.to(self.storage)
        return t.pin_memory() if self.pin and not t.is_pinned() else t
