"""The tensor-parallel styles of :func:`shardfn.tensor_split` and the modules that run them.

A style says how one module is split over the ``tp`` axis and which collectives
go around it. Each split module is replaced, in a private copy of the model's
skeleton, by a wrapper that registers the *same* parameter names (``weight``,
``bias``), so leaf names stay ``"blocks.0.mlp.fc1.weight"``; ``functional_call``
then hands the wrapper this rank's local shards.

The rules are JAX's for a tensor-parallel region (Megatron's ``f``/``g`` pair):

* a replicated activation *enters* a split region through ``sf.pvary``
  (identity forward, psum backward: ``f``);
* a per-rank partial result *leaves* it through ``sf.psum_invariant``
  (psum forward, identity backward: ``g``), so the replicated computation after
  it (LayerNorm, residual, loss) is counted once, not once per rank.

With ``sequence_parallel=True`` (Megatron-SP, see :mod:`._tp_sequence`) the
activations between the regions are this rank's sequence chunk instead: a
colwise layer all-gathers its input along the sequence (``sf.all_gather``,
backward reduce-scatter: it replaces ``f``), a rowwise layer or vocab embedding
reduce-scatters its output along the sequence (``sf.psum_scatter``, backward
all-gather: it replaces ``g``), and the rowwise bias, added to a chunk, enters
through ``sf.pvary`` (its gradient is summed over the axis).

Example:
    >>> Colwise(gather_output=True)
    Colwise(gather_output=True, fused=1, n_heads=None, sequence_parallel=False, sequence_dim=-2)
"""

from __future__ import annotations

import dataclasses

import einops
import torch
import torch.nn.functional as F
from torch import nn

from shardfn.mesh import Mesh
from shardfn.primitives import all_gather, axis_index, psum_invariant, psum_scatter, pvary
from shardfn.spec import P
from shardfn.transforms._tp_checks import check_ids
from shardfn.transforms._tp_sequence import (
    SequenceParallel,
    SplitRNG,
    check_sequence,
    wrap_sequence,
)

__all__ = ["Colwise", "Replicate", "Rowwise", "SequenceParallel", "SplitRNG", "Style", "Vocab",
           "as_style"]


def check_fields(style: object) -> None:
    """Refuse a style whose fields have the wrong type or range, naming the field."""
    for field in dataclasses.fields(style):
        value = getattr(style, field.name)
        if field.name in ("gather_output", "sequence_parallel"):
            ok, want = isinstance(value, bool), "True or False"
        elif field.name == "sequence_dim":
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an int"
        elif field.name == "fused":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            want = "an int >= 1"
        else:  # n_heads
            ok = value is None or isinstance(value, int) and not isinstance(value, bool) \
                and value >= 1
            want = "None or an int >= 1"
        if not ok:
            raise ValueError(f"{type(style).__name__}: {field.name}={value!r} is not valid; "
                             f"give {want}")


@dataclasses.dataclass(frozen=True)
class Colwise:
    """Split an ``nn.Linear``'s output features (weight rows and bias) over the axis.

    Attributes:
        gather_output: all-gather the output's last dim, so it leaves replicated
            (its backward keeps this rank's slice of the gradient: no communication).
        fused: the output is ``fused`` equal parts side by side (``3`` for a fused
            ``[q|k|v]`` projection); each part is split separately, so rank ``r``
            holds ``q[r] | k[r] | v[r]``.
        n_heads: heads per part; checked to divide by the axis size (whole heads per rank).
        sequence_parallel: the input is this rank's sequence chunk; it is all-gathered
            along ``sequence_dim`` (backward: reduce-scatter) instead of entering via pvary.
        sequence_dim: the sequence dim of the activations (default ``-2``: ``[..., T, d]``).
    """

    gather_output: bool = False
    fused: int = 1
    n_heads: int | None = None
    sequence_parallel: bool = False
    sequence_dim: int = -2

    def __post_init__(self) -> None:
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class Rowwise:
    """Split an ``nn.Linear``'s input features (weight columns) over the axis.

    The input is this rank's feature slice (what a ``Colwise`` before it gives);
    the partial products are summed with ``psum_invariant`` and the (replicated)
    bias is added once, after the sum.

    Attributes:
        sequence_parallel: reduce-scatter the partial products along ``sequence_dim``
            (backward: all-gather) instead of psum; the bias enters through ``sf.pvary``.
        sequence_dim: the sequence dim of the activations (default ``-2``).
    """

    sequence_parallel: bool = False
    sequence_dim: int = -2

    def __post_init__(self) -> None:
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Split an ``nn.Embedding``'s rows (the vocabulary) over the axis.

    Each rank looks up only the ids in its range (the others give zeros), and
    ``psum_invariant`` sums the lookups: the output is replicated.

    Attributes:
        sequence_parallel: reduce-scatter the lookups along ``sequence_dim`` of the
            output (backward: all-gather): the output is this rank's sequence chunk.
        sequence_dim: the sequence dim of the output (default ``-2``: ``[..., T, d]``).
    """

    sequence_parallel: bool = False
    sequence_dim: int = -2

    def __post_init__(self) -> None:
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Leave the module whole on every rank (no communication)."""


Style = Colwise | Rowwise | Vocab | Replicate | SequenceParallel | SplitRNG
_BY_NAME = {"colwise": Colwise, "rowwise": Rowwise, "vocab": Vocab, "replicate": Replicate,
            "sequence_parallel": SequenceParallel, "split_rng": SplitRNG,
            "colwise_sp": lambda: Colwise(sequence_parallel=True),
            "rowwise_sp": lambda: Rowwise(sequence_parallel=True),
            "vocab_sp": lambda: Vocab(sequence_parallel=True)}


def as_style(style: object, pattern: str) -> Style:
    """A style object from a plan value (a name such as ``"colwise"`` or a style object).

    ``"colwise_sp"`` / ``"rowwise_sp"`` / ``"vocab_sp"`` name the sequence-parallel
    forms (``Colwise(sequence_parallel=True)``, ...), ``"sequence_parallel"`` is
    ``SequenceParallel()`` and ``"split_rng"`` is ``SplitRNG()``.
    """
    if isinstance(style, Colwise | Rowwise | Vocab | Replicate | SequenceParallel | SplitRNG):
        return style
    if isinstance(style, str) and style in _BY_NAME:
        return _BY_NAME[style]()
    raise ValueError(f"tensor_split: plan[{pattern!r}] = {style!r} is not a style; use one of "
                     f"{sorted(_BY_NAME)} or Colwise(...)/Rowwise()/Vocab()/Replicate()/"
                     "SequenceParallel()/SplitRNG()")


# ---------------------------------------------------------------- checks and specs


def _need(module: nn.Module, kind: type, path: str, style: Style) -> None:
    if type(module) is not kind:
        raise ValueError(f"tensor_split: style {style} on module {path!r} needs an "
                         f"nn.{kind.__name__}, but {path!r} is a {type(module).__name__}")


def _divides(path: str, what: str, size: int, parts: int, why: str) -> None:
    if size % parts:
        raise ValueError(f"tensor_split: module {path!r}: {what} = {size} is not divisible "
                         f"by {parts} ({why}); uneven splits are refused for now")


def leaf_specs(module: nn.Module, path: str, style: Style, axis: str, tp: int) -> dict[str, P]:
    """``{leaf name inside the module: spec}`` for a matched module, after checking it fits."""
    if isinstance(style, Replicate | SequenceParallel | SplitRNG):
        return {}
    if isinstance(style, Vocab):
        _need(module, nn.Embedding, path, style)
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ValueError(f"tensor_split: module {path!r}: Vocab does not support "
                             "padding_idx, max_norm or sparse yet")
        _divides(path, "num_embeddings", module.num_embeddings, tp, f"size of axis {axis!r}")
        return {"weight": P(axis, None)}
    _need(module, nn.Linear, path, style)
    if isinstance(style, Rowwise):
        _divides(path, "in_features", module.in_features, tp, f"size of axis {axis!r}")
        return {"weight": P(None, axis), "bias": P()}
    if style.fused < 1:
        raise ValueError(f"tensor_split: module {path!r}: Colwise(fused={style.fused}) "
                         "must be >= 1")
    if style.fused > 1 and style.gather_output:
        raise ValueError(f"tensor_split: module {path!r}: Colwise(fused=..., gather_output=True) "
                         "is not supported (the gathered parts would be interleaved)")
    _divides(path, "out_features", module.out_features, style.fused * tp,
             f"{style.fused} fused parts x size {tp} of axis {axis!r}")
    if style.n_heads is not None:
        if style.n_heads % tp:
            raise ValueError(f"tensor_split: module {path!r}: n_heads = {style.n_heads} is not "
                             f"divisible by the axis size {tp} (axis {axis!r}): each rank "
                             "needs whole heads")
        _divides(path, "out_features / fused", module.out_features // style.fused,
                 style.n_heads, "n_heads")
    return {"weight": P(axis, None), "bias": P(axis)}


def fused_local(full: torch.Tensor, parts: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a fused weight: block ``rank`` of each of the ``parts`` parts
    (what ``sf.FusedLayout.shard_leaf`` cuts)."""
    split = einops.rearrange(full, "(part tp rows) ... -> part tp rows ...", part=parts, tp=tp)
    return einops.rearrange(split[:, rank], "part rows ... -> (part rows) ...")


def fused_full(gathered: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """Inverse of :func:`fused_local` on the rank-order concatenation of all ranks' rows."""
    return einops.rearrange(gathered, "(tp part rows) ... -> (part tp rows) ...", part=parts, tp=tp)


# ---------------------------------------------------------------- the wrappers


class _Split(nn.Module):
    """Holds the wrapped module's own parameter objects under their own names."""

    def __init__(self, inner: nn.Module, mesh: Mesh, axis: str, path: str = "",
                 sequence_dim: int | None = None):
        super().__init__()
        self.weight = inner.weight
        if hasattr(inner, "bias"):
            self.bias = inner.bias
        self.mesh, self.axis, self.inner_type = mesh, axis, type(inner).__name__
        self.path, self.sequence_dim = path, sequence_dim  # sequence_dim None: not SP

    def extra_repr(self) -> str:
        sp = "" if self.sequence_dim is None else f", sequence_dim={self.sequence_dim}"
        return f"{self.inner_type}, axis={self.axis!r}{sp}"

    def _check_features(self, x: torch.Tensor, what: str) -> None:
        """Refuse an input whose last dim is not the ``in_features`` this rank's weight takes."""
        features = self.weight.shape[1]
        if x.dim() == 0 or x.shape[-1] != features:
            raise ValueError(f"tensor_split: module {self.path!r} ({type(self).__name__} over "
                             f"{self.axis!r}) takes inputs [..., {features}] ({what}), got "
                             f"shape {tuple(x.shape)}")

    def _scatter_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """Sum over the axis and keep this rank's sequence chunk (SP's replacement for g)."""
        dim = check_sequence(y, self.sequence_dim, self.mesh.size(self.axis), self.path,
                             self.axis)
        # contiguous: psum_scatter along a dim other than 0 returns a permuted layout, and a
        # dropout on it would draw its mask in memory order, not in index order (so the
        # masks would depend on whether torch.func wraps the tensor)
        return psum_scatter(y, self.axis, dim=dim, mesh=self.mesh).contiguous()


class ColwiseLinear(_Split):
    """``y_local = pvary(x) @ W_local.T + b_local``; optionally gathered along the last dim.

    Sequence parallel: ``x`` is this rank's sequence chunk, all-gathered along the
    sequence first (backward: reduce-scatter, which also does ``f``'s sum).
    """

    def __init__(self, inner: nn.Linear, mesh: Mesh, axis: str, gather_output: bool,
                 path: str = "", sequence_dim: int | None = None):
        super().__init__(inner, mesh, axis, path, sequence_dim)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_dim is None:
            x = pvary(x, self.axis, mesh=self.mesh)
        else:  # the chunk needs no divisibility check (1): any length gathers
            dim = check_sequence(x, self.sequence_dim, 1, self.path, self.axis)
            x = all_gather(x, self.axis, dim=dim, mesh=self.mesh)
        self._check_features(x, "all of its input features, replicated")
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        # The gathered output is replicated: the transpose keeps this rank's slice of the
        # gradient (Megatron's split), not all_gather's psum_scatter (which would count
        # each rank's identical downstream once more).
        # contiguous: a random op after it draws in memory order (see _scatter_sequence)
        gathered = all_gather(y.detach(), self.axis, dim=y.dim() - 1, mesh=self.mesh).contiguous()
        n_local, tp = y.shape[-1], self.mesh.size(self.axis)
        rank = axis_index(self.axis, mesh=self.mesh)
        own = F.pad(y - y.detach(), (rank * n_local, (tp - 1 - rank) * n_local))
        return gathered + own


class RowwiseLinear(_Split):
    """``y = psum_invariant(x_local @ W_local.T) + b``: the bias is added once, after the sum.

    Sequence parallel: ``y = psum_scatter(x_local @ W_local.T, seq) + pvary(b)``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_features(x, "this rank's slice of its input features, as a colwise layer "
                                "without gather_output gives it")
        partial = F.linear(x, self.weight)
        if self.sequence_dim is None:
            y = psum_invariant(partial, self.axis, mesh=self.mesh)
            return y if self.bias is None else y + self.bias
        y = self._scatter_sequence(partial)
        return y if self.bias is None else y + pvary(self.bias, self.axis, mesh=self.mesh)


class VocabEmbedding(_Split):
    """Look up the ids in this rank's vocabulary range (zeros elsewhere), then psum_invariant
    (sequence parallel: psum_scatter along the sequence)."""

    def __init__(self, inner: nn.Embedding, mesh: Mesh, axis: str, path: str = "",
                 sequence_dim: int | None = None):
        super().__init__(inner, mesh, axis, path, sequence_dim)
        self.scale_grad_by_freq = inner.scale_grad_by_freq

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        check_ids(ids, rows * self.mesh.size(self.axis), self.path, self.mesh, self.axis,
                  self.sequence_dim is not None)
        start = axis_index(self.axis, mesh=self.mesh) * rows
        mine = (ids >= start) & (ids < start + rows)
        local_ids = torch.where(mine, ids - start, torch.zeros_like(ids))
        looked_up = F.embedding(local_ids, self.weight, scale_grad_by_freq=self.scale_grad_by_freq)
        looked_up = looked_up * mine.unsqueeze(-1).to(looked_up.dtype)
        if self.sequence_dim is not None:
            return self._scatter_sequence(looked_up)
        return psum_invariant(looked_up, self.axis, mesh=self.mesh)


def wrap(module: nn.Module, style: Style, mesh: Mesh, axis: str, path: str = "") -> nn.Module:
    """The module that runs ``module`` under ``style`` (``module`` itself for Replicate)."""
    if isinstance(style, SequenceParallel | SplitRNG):
        return wrap_sequence(module, style, mesh, axis, path)
    if isinstance(style, Replicate):
        return module
    sequence_dim = style.sequence_dim if style.sequence_parallel else None
    if isinstance(style, Colwise):
        return ColwiseLinear(module, mesh, axis, style.gather_output, path, sequence_dim)
    if isinstance(style, Rowwise):
        return RowwiseLinear(module, mesh, axis, path, sequence_dim)
    return VocabEmbedding(module, mesh, axis, path, sequence_dim)
