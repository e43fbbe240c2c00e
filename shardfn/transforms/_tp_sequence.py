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
* :class:`SequenceParallel` on a user-written norm (a module without submodules or
  buffers whose parameters are vectors over the last dim, e.g. a hand-written
  RMSNorm or Hugging Face's ``LlamaRMSNorm``): runs it on the chunk with every
  parameter entered through ``sf.pvary`` (:class:`PvaryParams`), as for the torch norms.
* :class:`SplitRNG` on a module without parameters: runs it with this rank's
  RNG stream; for dropout on other split activations (attention probabilities
  of the local heads).

Shared inputs (:func:`shared_input`): inside one ``apply`` call, the colwise layers
that read the *same* tensor (q, k and v of an attention; gate and up of a SwiGLU MLP)
share one all-gather of it (sequence parallel) or one ``pvary`` (so one psum of its
gradient in backward), instead of one each.

Example:
    >>> plan = {"blocks.*.ln1": SequenceParallel(), "blocks.*.attn.core": SplitRNG()}
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardfn.mesh import Mesh
from shardfn.primitives import axis_index, pvary
from shardfn.transforms._tp_rng import rank_stream, refuse_compiled_draws

__all__ = ["PvaryParams", "SequenceParallel", "SplitRNG", "check_sequence", "shared_input",
           "shared_inputs", "wrap_sequence"]


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Run a LayerNorm / RMSNorm / user-written norm / position Embedding / parameter-free
    module on this rank's sequence chunk (see the module docstring).

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
        if torch.compiler.is_compiling():
            refuse_compiled_draws(self.inner, self.path)
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


class PvaryParams(nn.Module):
    """Runs a module (its own parameters, same names) with each parameter entered through
    ``sf.pvary``: the module sees split activations (this rank's chunk or heads), so each
    parameter's gradient is summed over the axis. ``Replicate(sum_grads=True)`` and
    ``SequenceParallel()`` on a user-written norm.

    With ``last_dim=True`` (a norm) every parameter must be a vector as long as the
    input's last dim, checked at the call (the module and both sizes named).
    """

    def __init__(self, inner: nn.Module, mesh: Mesh, axis: str, path: str, what: str,
                 last_dim: bool = False):
        super().__init__()
        if any(True for _ in inner.children()) or any(True for _ in inner.buffers()):
            raise ValueError(f"tensor_split: {what} on module {path!r} "
                             f"({type(inner).__name__}): only a module with parameters and no "
                             "submodules or buffers (a norm) is supported")
        for name, param in inner.named_parameters(recurse=False):
            setattr(self, name, param)
        self._inner = [inner]  # a list: not a submodule, so the leaf names stay the module's
        self.mesh, self.axis, self.path, self.last_dim = mesh, axis, path, last_dim

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._inner[0]
        inner.train(self.training)
        params = dict(self.named_parameters(recurse=False))
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if self.last_dim and x is not None:
            bad = {n: tuple(p.shape) for n, p in params.items()
                   if x.dim() == 0 or tuple(p.shape) != (x.shape[-1],)}
            if bad:
                raise ValueError(f"tensor_split: SequenceParallel on module {self.path!r} "
                                 f"({type(inner).__name__}) runs a norm whose parameters are "
                                 f"vectors over the input's last dim ({tuple(x.shape)}), but "
                                 f"its parameters have shapes {bad}")
        params = {name: pvary(p, self.axis, mesh=self.mesh) for name, p in params.items()}
        return torch.func.functional_call(inner, params, args, kwargs)


# ---------------------------------------------------------------- shared inputs

#: the inputs entered into split regions in this apply call: (tensor, key, result)
_SHARED: contextvars.ContextVar[list | None] = contextvars.ContextVar("tp_shared_inputs",
                                                                     default=None)


class _CompiledScope:
    """The cache of a compiled ``apply`` call: dynamo traces an attribute write, not
    ``ContextVar.set`` (a traced call runs on one thread, start to end)."""

    def __init__(self) -> None:
        self.cache: list | None = None  # an instance attribute from the start: no guard change


_COMPILED = _CompiledScope()


@contextlib.contextmanager
def shared_inputs() -> Iterator[None]:
    """Scope of one ``apply`` call: colwise layers reading the same tensor share its
    all-gather / pvary (:func:`shared_input`); nothing is kept after the call."""
    if torch.compiler.is_compiling():
        before, _COMPILED.cache = _COMPILED.cache, []
        try:
            yield
        finally:
            _COMPILED.cache = before
        return
    token = _SHARED.set([])
    try:
        yield
    finally:
        _SHARED.reset(token)


def shared_input(x: torch.Tensor, key: tuple, enter: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
    """``enter(x)``, or the result of an earlier ``enter`` of the same tensor object with the
    same ``key`` (collective, axis, dim, mesh) in this ``apply`` call.

    The tensor must be the same object, unmodified (its version counter), under the same
    grad mode; the gradients of the uses add up before the one backward collective
    (one reduce-scatter / psum instead of one per layer). Outside an ``apply`` call (a
    recomputation in backward) every call enters its own.
    """
    compiling = torch.compiler.is_compiling()
    cache = _COMPILED.cache if compiling else _SHARED.get()
    if cache is None:
        return enter(x)
    # a traced tensor under torch.func has no readable version counter: a compiled call
    # shares by object only (an in-place write to a layer input between two colwise
    # layers of one compiled call is not seen: docs/compile.md)
    stamp = (None if compiling else x._version, torch.is_grad_enabled(), *key)
    for seen, seen_stamp, result in cache:
        if seen is x and seen_stamp == stamp:
            return result
    result = enter(x)
    cache.append((x, stamp, result))
    return result


def _refuse(module: nn.Module, path: str, style: object, why: str) -> ValueError:
    return ValueError(f"tensor_split: style {style} on module {path!r} ({type(module).__name__}) "
                      f"{why}")


def wrap_sequence(module: nn.Module, style: SequenceParallel | SplitRNG, mesh: Mesh, axis: str,
                  path: str) -> nn.Module:
    """The module that runs ``module`` under ``style``, after checking that it fits.

    Raises:
        ValueError: naming the module, for a module the style cannot run (a module
            with submodules or non-vector parameters other than the torch norms or an
            embedding; buffers; an embedding with ``max_norm`` or ``sparse``).
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
    params = dict(module.named_parameters())
    children = [name for name, _ in module.named_children()]
    if not children and all(p.dim() == 1 for p in params.values()):
        return PvaryParams(module, mesh, axis, path, "SequenceParallel", last_dim=True)
    shapes = [(name, tuple(p.shape)) for name, p in params.items()][:4]
    raise _refuse(module, path, style, "cannot run on a sequence chunk: SequenceParallel takes "
                  "nn.LayerNorm, nn.RMSNorm, a norm of your own (no submodules, parameters "
                  f"vectors over the last dim; this one has submodules {children[:3]} and "
                  f"parameters {shapes}), nn.Embedding (positions) or a parameter-free module")
