"""Sequence parallelism (Megatron-SP) and split-region RNG: the styles and their modules.

Between the tensor-parallel regions a sequence-parallel model keeps activations
split on the sequence dim: rank ``r`` of ``tp`` holds positions
``[r T/tp, (r+1) T/tp)``. The split layers change their collectives
(``Colwise(sequence_parallel=True)``: all-gather the input along the sequence,
backward reduce-scatter; ``Rowwise(sequence_parallel=True)`` and
``Vocab(sequence_parallel=True)``: reduce-scatter the output along the sequence
instead of psum, backward all-gather; in :mod:`._tp_styles`). The modules
*between* them are styled here:

* :class:`SequenceParallel` on an ``nn.LayerNorm`` / ``nn.RMSNorm``: normalises
  this rank's chunk with the replicated weight entered through ``sf.pvary``.
  Each rank's weight gradient covers only its chunk; ``pvary``'s backward (a
  psum over tp) sums them, so every rank holds the unsplit model's gradient
  (Megatron's all-reduce of sequence-parallel parameter gradients). The same
  holds for a rowwise layer's bias in sequence-parallel mode.
* :class:`SequenceParallel` on an ``nn.Embedding`` (position embeddings): looks
  up only this rank's chunk of the ids (along the ids' sequence dim), weight
  through ``sf.pvary``.
* :class:`SequenceParallel` on a module without parameters (``nn.Dropout``):
  runs it on the chunk with this rank's RNG stream (:mod:`._tp_rng`).
* :class:`SplitRNG` on a module without parameters: runs it with this rank's
  RNG stream; for dropout on other split activations (attention probabilities
  of the local heads).

Example:
    >>> plan = {"blocks.*.ln1": SequenceParallel(), "blocks.*.attn.core": SplitRNG()}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardfn.mesh import Mesh
from shardfn.primitives import axis_index, pvary
from shardfn.transforms._tp_rng import rank_stream

__all__ = ["SequenceParallel", "SplitRNG", "check_sequence", "wrap_sequence"]


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Run a LayerNorm / RMSNorm / position Embedding / parameter-free module on this rank's
    sequence chunk (see the module docstring).

    Attributes:
        sequence_dim: the sequence dim of the activations (``-2`` for ``[..., T, d]``);
            for an embedding's ids it is the same dim counted without the feature dim
            (``-1`` for ``[..., T]``).
    """

    sequence_dim: int = -2

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_dim, int) or isinstance(self.sequence_dim, bool):
            raise ValueError(f"SequenceParallel: sequence_dim={self.sequence_dim!r} is not "
                             "valid; give an int")


@dataclasses.dataclass(frozen=True)
class SplitRNG:
    """Run a parameter-free module (attention core, dropout) with this rank's RNG stream."""


def check_sequence(x: torch.Tensor, dim: int, tp: int, path: str, axis: str) -> int:
    """``dim`` normalised for ``x``, after checking that the sequence divides by ``tp``.

    Raises:
        ValueError: naming the module, the dim, its size and the axis size.
    """
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"tensor_split: module {path!r} (sequence parallel): sequence dim {dim} "
                         f"is out of range for an input of shape {tuple(x.shape)}")
    dim %= x.dim()
    if x.shape[dim] % tp:
        raise ValueError(f"tensor_split: module {path!r} (sequence parallel): the sequence "
                         f"(dim {dim} of shape {tuple(x.shape)}) has length {x.shape[dim]}, not "
                         f"divisible by {tp}, the size of axis {axis!r}")
    return dim


def _devices(args: tuple[Any, ...]) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


class RankRNGModule(nn.Module):
    """Runs a parameter-free module with this rank's RNG stream (in training mode)."""

    def __init__(self, inner: nn.Module, path: str):
        super().__init__()
        self.inner, self.path = inner, path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.training:
            return self.inner(*args, **kwargs)
        with rank_stream(_devices(args)):
            return self.inner(*args, **kwargs)


class SequenceParallelNorm(nn.Module):
    """LayerNorm / RMSNorm of this rank's chunk, its replicated weights through ``sf.pvary``."""

    def __init__(self, inner: nn.LayerNorm | nn.RMSNorm, mesh: Mesh, axis: str):
        super().__init__()
        self.weight = inner.weight
        if isinstance(inner, nn.LayerNorm):
            self.bias = inner.bias
        self.kind, self.eps = type(inner), inner.eps
        self.normalized_shape = tuple(inner.normalized_shape)
        self.mesh, self.axis = mesh, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else pvary(self.weight, self.axis, mesh=self.mesh)
        if self.kind is nn.RMSNorm:
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)
        bias = None if self.bias is None else pvary(self.bias, self.axis, mesh=self.mesh)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelEmbedding(nn.Module):
    """Look up this rank's chunk of the ids (their sequence dim); the weight through ``pvary``."""

    def __init__(self, inner: nn.Embedding, mesh: Mesh, axis: str, path: str, sequence_dim: int):
        super().__init__()
        self.weight = inner.weight
        self.mesh, self.axis, self.path = mesh, axis, path
        self.ids_dim = sequence_dim + 1 if sequence_dim < 0 else sequence_dim
        self.padding_idx, self.scale_grad_by_freq = inner.padding_idx, inner.scale_grad_by_freq

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = self.mesh.size(self.axis)
        dim = check_sequence(ids, self.ids_dim, tp, self.path, self.axis)
        block = ids.shape[dim] // tp
        mine = ids.narrow(dim, axis_index(self.axis, mesh=self.mesh) * block, block)
        weight = pvary(self.weight, self.axis, mesh=self.mesh)
        return F.embedding(mine, weight, self.padding_idx,
                           scale_grad_by_freq=self.scale_grad_by_freq)


def _refuse(module: nn.Module, path: str, style: object, why: str) -> ValueError:
    return ValueError(f"tensor_split: style {style} on module {path!r} ({type(module).__name__}) "
                      f"{why}")


def wrap_sequence(module: nn.Module, style: SequenceParallel | SplitRNG, mesh: Mesh, axis: str,
                  path: str) -> nn.Module:
    """The module that runs ``module`` under ``style``, after checking that it fits.

    Raises:
        ValueError: naming the module, for a module the style cannot run (a module
            with parameters other than a norm or an embedding; buffers; an
            embedding with ``max_norm`` or ``sparse``).
    """
    if any(True for _ in module.buffers()):
        raise _refuse(module, path, style, "has buffers, which a split region cannot keep "
                      "consistent; leave it replicated")
    has_params = any(True for _ in module.parameters())
    if isinstance(style, SplitRNG) or not has_params:
        if has_params:
            raise _refuse(module, path, style, "has parameters; SplitRNG runs only "
                          "parameter-free modules (attention core, dropout)")
        return RankRNGModule(module, path)
    if type(module) in (nn.LayerNorm, nn.RMSNorm):
        return SequenceParallelNorm(module, mesh, axis)
    if type(module) is nn.Embedding:
        if module.max_norm is not None or module.sparse:
            raise _refuse(module, path, style, "uses max_norm or sparse, not supported")
        return SequenceParallelEmbedding(module, mesh, axis, path, style.sequence_dim)
    raise _refuse(module, path, style, "cannot run on a sequence chunk: SequenceParallel takes "
                  "nn.LayerNorm, nn.RMSNorm, nn.Embedding (positions) or a parameter-free module")
