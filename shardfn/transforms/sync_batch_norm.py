"""`sync_batch_norm`: BatchNorm whose batch statistics span a mesh axis (SyncBatchNorm).

``sync_batch_norm(module, axis)`` returns a copy of ``module`` in which every
``BatchNorm1d/2d/3d`` is a :class:`SyncBatchNorm`: in training mode (and
whenever batch statistics are used) the mean and variance are those of the
batch concatenated over the ranks of ``axis``, computed with shardfn's
differentiable collectives, and the running statistics are updated with them
(the unbiased variance with the global count), exactly as one process would on
the concatenated batch. Ranks may hold different numbers of examples (zero
included): every example weighs the same.

Sums over the axis per call, all with :func:`shardfn.psum` (so gradients
follow its rule: the backward of a per-rank loss is that of the sum of every
rank's loss, as torch's SyncBatchNorm does): first the per-channel sums and
the element count (int64, exact: the global mean), then the per-channel sums
of squared deviations from that mean (the global variance, two-pass, no
cancellation). Communication: three all-reduces of ``C``, 1 and ``C`` values
per call in forward, two of ``C`` values in backward.
Eval mode with running statistics communicates nothing.

The model works through ``sf.functional(...)`` (BatchNorm's buffers are the
same leaves, so ``apply(..., mutable=True)`` returns the synced statistics),
under ``torch.func.grad``/``vjp`` and plain autograd, with the current mesh
(``with mesh:``) or the ``mesh`` given here.

Example:
    >>> net = sync_batch_norm(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), "dp")
    >>> model = sf.functional(net)
    >>> with sf.Mesh({"dp": 2}):
    ...     out, new_buffers = model.apply(params, x_local, mutable=True)
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from shardfn._torch_internals import BatchNormBase, TransformType, in_transform
from shardfn.mesh import AxisName, Mesh
from shardfn.primitives.collectives import psum

__all__ = ["SyncBatchNorm", "sync_batch_norm"]

_CONVERTED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class _MeshRef:
    """Holds an optional mesh; copies (the meta skeleton of ``functional``) share it."""

    def __init__(self, mesh: Mesh | None):
        self.mesh = mesh

    def __deepcopy__(self, memo: dict) -> _MeshRef:
        return self

    def __repr__(self) -> str:
        return "current mesh" if self.mesh is None else repr(self.mesh)


class SyncBatchNorm(BatchNormBase):
    """A BatchNorm over inputs ``(N, C, *)`` whose batch statistics span ``axis``.

    Same parameters, buffers and hyper-parameters as ``nn.BatchNorm*d``; made by
    :func:`sync_batch_norm` (or directly).

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype:
            as for ``nn.BatchNorm1d``.
        axis: the mesh axis (or tuple of axes) whose ranks share the batch.
        mesh: the mesh; default the current one (``with mesh:``) at each call.

    Example:
        >>> bn = SyncBatchNorm(8, axis="dp")
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device: Any = None,
                 dtype: Any = None, *, axis: AxisName, mesh: Mesh | None = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if not isinstance(axis, str | tuple | list) or not axis:
            raise TypeError(f"sync_batch_norm: axis must be a mesh axis name or a tuple of "
                            f"names, got {axis!r}")
        self.axis = tuple(axis) if isinstance(axis, list) else axis
        self._mesh_ref = _MeshRef(mesh)

    @property
    def mesh(self) -> Mesh | None:
        """The mesh given, or None for the current mesh at each call."""
        return self._mesh_ref.mesh

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of shape (N, C, *), got "
                             f"{input.dim()}-D input of shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: input has {input.shape[1]} channels (dim 1), "
                             f"expected num_features={self.num_features}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with the statistics of the whole axis' batch (or running ones)."""
        self._check_input_dim(input)
        batch_stats = self.training or self.running_mean is None
        if not batch_stats:  # eval with running statistics: purely local
            return nn.functional.batch_norm(input, self.running_mean, self.running_var,
                                            self.weight, self.bias, False, 0.0, self.eps)
        factor = self._update_factor() if self.training and self.track_running_stats else None
        return self._synced(input, factor)

    def _update_factor(self) -> float:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average, as torch does
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _synced(self, input: torch.Tensor, factor: float | None) -> torch.Tensor:
        compute = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
        x = input.to(compute)
        dims = [0, *range(2, x.dim())]
        local = x.shape[0] * _spatial(x)
        count = torch.tensor(local, dtype=torch.int64, device=x.device)
        sums, total_count = psum((x.sum(dims), count), self.axis, mesh=self.mesh)
        # (read the global count only when this rank's could leave it at 1: no sync otherwise)
        if (local <= 1 and self.training and not in_transform(TransformType.Vmap)
                and int(total_count) <= 1):
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over axis "
                             f"{self.axis!r} when training, got {int(total_count)} in all "
                             f"(input of shape {tuple(input.shape)} on this rank)")
        total_count = total_count.to(compute)
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = sums / total_count
        centred = x - mean.reshape(shape)
        squares = psum(centred.square().sum(dims), self.axis, mesh=self.mesh)
        var = squares / total_count
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            out = out * self.weight.reshape(shape).to(compute)
        if self.bias is not None:
            out = out + self.bias.reshape(shape).to(compute)
        if factor is not None:
            with torch.no_grad():
                unbiased = squares.detach() / (total_count.detach() - 1)
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype),
                                                       alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                      alpha=factor)
        return out.to(input.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, axis={self.axis!r}, mesh={self._mesh_ref!r}"


def _spatial(x: torch.Tensor) -> int:
    size = 1
    for d in x.shape[2:]:
        size *= d
    return size


def sync_batch_norm(module: nn.Module, axis: AxisName, *, mesh: Mesh | None = None) -> nn.Module:
    """A copy of ``module`` whose BatchNorm layers compute their statistics over ``axis``.

    Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, but ``module`` is not
    changed: every ``BatchNorm1d/2d/3d`` (and ``nn.SyncBatchNorm``) of the copy
    is a :class:`SyncBatchNorm` with the same parameters, buffers, hyper-parameters
    and training mode. Other modules are copied as they are.

    Args:
        module: any module (on any device, meta included).
        axis: the mesh axis (or tuple of axes) whose ranks hold parts of one batch.
        mesh: the mesh to resolve ``axis`` on; default the current mesh at each call.

    Returns:
        The converted copy (a :class:`SyncBatchNorm` if ``module`` is itself a BatchNorm).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``axis`` is not a name / tuple.

    Example:
        >>> net = sync_batch_norm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), "dp")
        >>> type(net[1]).__name__
        'SyncBatchNorm'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"sync_batch_norm expects an nn.Module, got {type(module).__name__}")
    return _convert(copy.deepcopy(module), axis, mesh)


def _convert(module: nn.Module, axis: AxisName, mesh: Mesh | None) -> nn.Module:
    if isinstance(module, _CONVERTED) and not isinstance(module, SyncBatchNorm):
        return _synced_copy(module, axis, mesh)
    for name, child in list(module.named_children()):
        converted = _convert(child, axis, mesh)
        if converted is not child:
            setattr(module, name, converted)
    return module


def _synced_copy(bn: BatchNormBase, axis: AxisName, mesh: Mesh | None) -> SyncBatchNorm:
    out = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                        device="meta", axis=axis, mesh=mesh)
    out._parameters = dict(bn._parameters)
    out._buffers = dict(bn._buffers)
    out._non_persistent_buffers_set = set(bn._non_persistent_buffers_set)
    out.train(bn.training)
    if hasattr(bn, "qconfig"):
        out.qconfig = bn.qconfig
    return out
