"""Helpers of `shard_params`: dtypes and devices of a unit's tensors, replay, accumulation.

* :class:`OffloadPolicy` and :class:`Placement` say where shards live (storage
  device), where units compute (compute device) and in which dtypes parameters
  are gathered and gradients reduced (a :class:`~shardfn.transforms.precision.Precision`).
  Every host<->device copy of the offload path is counted in
  ``sf.comm_stats()`` under the axis keys ``"h2d"`` and ``"d2h"``.
* :class:`UnitRecorder` / :class:`UnitReplayer`: the dispatch modes of
  :mod:`shardfn.transforms.remat`, adapted to units: values computed from the
  gathered parameters alone are never saved (so a policy never keeps a unit's
  parameters alive), and the modes can be paused while a nested unit runs.
* :class:`Accumulator`: full (unsharded) gradients summed over micro-batches,
  reduced once at the end (``ShardedModel.accumulate_grads(mode="reduce_once")``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten as _torch_flatten
from torch.utils.weak import WeakIdKeyDictionary

from shardfn.primitives import stats
from shardfn.transforms.precision import Precision
from shardfn.transforms.remat import Policy, _base, _Recorder, _Replayer, _storage_ptr

__all__ = ["Accumulator", "OffloadPolicy", "Placement", "UnitRecorder", "UnitReplayer"]


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

    def gather_input(self, shard: torch.Tensor) -> torch.Tensor:
        """What a shard contributes to its unit's all-gather: on the compute device, cast."""
        return self.cast(self.to_compute(shard))


# ================================================================ remat inside units


def _storages(tensors) -> set[int]:
    return {_storage_ptr(_base(t)) for t in tensors if isinstance(t, torch.Tensor)}


class _Pausable:
    """A dispatch mode that a nested unit can switch off for the length of a block."""

    paused = False

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Let the ops of this block (a nested unit's) through untouched and uncounted."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class UnitRecorder(_Pausable, _Recorder):
    """Forward of a unit (or the root): keeps the outputs ``policy`` saves.

    Outputs of ops whose tensor inputs are all parameters or values computed from
    parameters alone (or that have no tensor inputs) are never saved: they are
    recomputed from the parameters gathered again in backward, so no policy keeps a
    unit's full parameters (or a copy of them) alive between forward and backward.
    """

    def __init__(self, policy: Policy, params: Mapping[str, torch.Tensor]):
        self.user_policy = policy
        self.param_only = False
        super().__init__(lambda op, name: not self.param_only and self.user_policy(op, name), [])
        self.param_storages = _storages(params.values())  # alive throughout the call
        self.derived = WeakIdKeyDictionary()  # outputs computed from parameters alone

    def _check_closure(self, func, args, kwargs) -> None:
        pass  # parameters and inputs reach a unit through functional_call, not its arguments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        tensors = [t for t in _torch_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.param_only = all(t in self.derived or _storage_ptr(t) in self.param_storages
                              for t in tensors)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            param_only, self.param_only = self.param_only, False
        if param_only:  # derived from parameters alone (w.t().contiguous(), w * 2): the same
            for t in _torch_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.derived[t] = True
        return out


class UnitReplayer(_Pausable, _Replayer):
    """Backward recompute of a unit (or the root): saved ops return their saved outputs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


# ================================================================ gradient accumulation

_ACCUMULATORS: list[Accumulator] = []  # innermost last


class Accumulator:
    """Full gradients of each unit summed locally over micro-batches (``reduce_once``).

    While active (``with acc:``), the backward of every ``apply`` of the model with
    ``token`` adds its units' full gradients here (in the master dtype) instead of
    reduce-scattering them; the owner reduces the sums once at the end.
    """

    def __init__(self, token: object):
        self.token = token
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # unit index (-1 root) -> full
        self.masters: Mapping[str, torch.dtype] | None = None  # the leaves' dtypes, as run

    def add(self, index: int, grads: Mapping[str, torch.Tensor],
            masters: Mapping[str, torch.dtype]) -> None:
        """Add one backward's full gradients of unit ``index`` (``name -> tensor``)."""
        self.masters = masters
        sums = self.grads.setdefault(index, {})
        for name, grad in grads.items():
            grad = grad.detach()
            if name in sums:  # out of place: an in-place add under torch.func.grad fails
                sums[name] = sums[name] + grad.to(sums[name].dtype)
            else:
                sums[name] = grad.to(masters[name], copy=True)

    def __enter__(self) -> Accumulator:
        _ACCUMULATORS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACCUMULATORS.remove(self)

    @staticmethod
    def current(token: object) -> Accumulator | None:
        """The innermost active accumulator of the model with ``token``, or None."""
        return next((a for a in reversed(_ACCUMULATORS) if a.token is token), None)


class NoReduce:
    """Stands in for a unit's reduction while accumulating: it has nothing to return."""

    def wait(self) -> dict[str, Any]:
        return {}
