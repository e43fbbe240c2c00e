"""The modules that run a split ``nn.Linear`` (or GPT-2's ``Conv1D``) for ``tensor_split``.

Each split module is replaced, in a private copy of the model's skeleton, by a
wrapper that registers the *same* parameter names (``weight``, ``bias``), so leaf
names stay ``"blocks.0.mlp.fc1.weight"``; ``functional_call`` then hands the
wrapper this rank's local shards.

* :class:`ColwiseLinear`: ``y_local = pvary(x) @ W_local.T + b_local`` (Megatron's
  ``f``); sequence parallel: the input chunk is all-gathered along the sequence
  first. Colwise layers reading the same tensor share that pvary / all-gather
  (:func:`~._tp_sequence.shared_input`). ``gather_output``: all-gathered on the
  last dim, backward keeps this rank's slice (:func:`gather_features`).
* :class:`RowwiseLinear`: ``y = psum_invariant(x_local @ W_local.T) + b`` (``g``);
  sequence parallel: ``psum_scatter`` along the sequence and the bias through ``pvary``.

**Uneven splits** (10 output features over 4 ranks) are padded as ``sf.shard``
pads: each rank holds ``ceil(10 / 4) = 3`` rows, the last one 1 real row and 2
zero rows. The wrappers compute with the real rows only (:func:`valid_width`), so
the padding gets no gradient and stays zero; a colwise output is padded with zeros
to the block width (every rank's shape is equal, as a vocab-parallel loss expects),
and a rowwise layer takes that padded width (or the exact one) and ignores the pad.

Example:
    >>> valid_width(10, 3, 3)   # rank 3 of 4 holds 1 of the 10 features
    1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardfn.mesh import Mesh
from shardfn.primitives import all_gather, axis_index, psum_invariant, psum_scatter, pvary
from shardfn.transforms._tp_sequence import check_sequence, shared_input

__all__ = ["ColwiseLinear", "RowwiseLinear", "features", "gather_features", "gather_replicated",
           "is_conv1d", "valid_width"]


def is_conv1d(module: nn.Module) -> bool:
    """A GPT-2 style ``Conv1D`` (``transformers.pytorch_utils``): ``y = x @ W + b`` with ``W``
    of shape ``(in, out)``, the transpose of ``nn.Linear``'s (recognised without importing
    transformers)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and tuple(weight.shape) == (getattr(module, "nx", None),
                                                               getattr(module, "nf", None)))


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features


def valid_width(full: int, block: int, rank: int) -> int:
    """How many of the ``block`` rows rank ``rank`` holds are real (not padding) when ``full``
    rows are split in blocks of ``block = ceil(full / tp)``."""
    return max(0, min(block, full - rank * block))


def gather_replicated(y: torch.Tensor, axis: str, mesh: Mesh, dim: int,
                      full: int | None = None) -> torch.Tensor:
    """All-gather ``dim`` of a per-rank block into a replicated tensor (padding cut to
    ``full``).

    The backward keeps this rank's slice of the gradient (Megatron's split), not
    ``all_gather``'s transpose ``psum_scatter``: the result is replicated, every rank's
    downstream computes the same gradient, and summing them would count it ``tp`` times.
    The result is contiguous: a random op after it draws in memory order, and a gather
    along a dim other than 0 returns a permuted layout.
    """
    dim %= y.dim()
    gathered = all_gather(y.detach(), axis, dim=dim, mesh=mesh).contiguous()
    n_local, tp = y.shape[dim], mesh.size(axis)
    rank = axis_index(axis, mesh=mesh)
    pad = [0, 0] * (y.dim() - 1 - dim) + [rank * n_local, (tp - 1 - rank) * n_local]
    out = gathered + F.pad(y - y.detach(), pad)
    if full is None or out.shape[dim] == full:
        return out
    return out.narrow(dim, 0, full).contiguous()


def gather_features(y: torch.Tensor, axis: str, mesh: Mesh, full: int) -> torch.Tensor:
    """A colwise output all-gathered on its last dim, replicated (:func:`gather_replicated`)."""
    return gather_replicated(y, axis, mesh, y.dim() - 1, full)


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
        self.conv1d = is_conv1d(inner)  # weight (in, out): x @ W, as Conv1D computes it
        self.in_features, self.out_features = features(inner)  # global (unpadded) sizes

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + b`` (``nn.Linear``), or ``x @ W + b`` for a ``Conv1D`` weight."""
        if not self.conv1d:
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _rank(self) -> int:
        return axis_index(self.axis, mesh=self.mesh)

    def extra_repr(self) -> str:
        sp = "" if self.sequence_dim is None else f", sequence_dim={self.sequence_dim}"
        return f"{self.inner_type}, axis={self.axis!r}{sp}"

    def _refuse_input(self, x: torch.Tensor, widths: str, what: str) -> ValueError:
        return ValueError(f"tensor_split: module {self.path!r} ({type(self).__name__} over "
                          f"{self.axis!r}) takes inputs [..., {widths}] ({what}), got "
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
    sequence first (backward: reduce-scatter, which also does ``f``'s sum). Layers
    reading the same ``x`` in one call share its pvary / all-gather.
    """

    def __init__(self, inner: nn.Linear, mesh: Mesh, axis: str, gather_output: bool,
                 path: str = "", sequence_dim: int | None = None):
        super().__init__(inner, mesh, axis, path, sequence_dim)
        self.gather_output = gather_output

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        mesh, axis = self.mesh, self.axis
        if self.sequence_dim is None:
            return shared_input(x, ("pvary", axis, mesh),
                                lambda t: pvary(t, axis, mesh=mesh))
        # the chunk needs no divisibility check (1): any length gathers
        dim = check_sequence(x, self.sequence_dim, 1, self.path, axis)
        return shared_input(x, ("all_gather", axis, dim, mesh),
                            lambda t: all_gather(t, axis, dim=dim, mesh=mesh))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter(x)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise self._refuse_input(x, str(self.in_features),
                                     "all of its input features, replicated")
        out_dim = 1 if self.conv1d else 0
        block = self.weight.shape[out_dim]
        valid = valid_width(self.out_features, block, self._rank())
        if valid == block:
            y = self._matmul(x, self.weight, self.bias)
        else:  # uneven split: the real rows only (the padding gets no gradient), zero-padded
            bias = None if self.bias is None else self.bias.narrow(0, 0, valid)
            y = F.pad(self._matmul(x, self.weight.narrow(out_dim, 0, valid), bias),
                      (0, block - valid))
        if not self.gather_output:
            return y
        return gather_features(y, self.axis, self.mesh, self.out_features)


class RowwiseLinear(_Split):
    """``y = psum_invariant(x_local @ W_local.T) + b``: the bias is added once, after the sum.

    Sequence parallel: ``y = psum_scatter(x_local @ W_local.T, seq) + pvary(b)``.
    ``split_input``: ``x_local`` is this rank's slice of ``pvary(x)`` (``x`` replicated).
    Uneven: ``x_local`` may have the padded width (a colwise output) or the exact one.
    """

    def __init__(self, inner: nn.Module, mesh: Mesh, axis: str, path: str = "",
                 sequence_dim: int | None = None, split_input: bool = False):
        super().__init__(inner, mesh, axis, path, sequence_dim)
        self.split_input = split_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dim = 0 if self.conv1d else 1
        block = self.weight.shape[in_dim]
        rank = self._rank()
        valid = valid_width(self.in_features, block, rank)
        if self.split_input:  # replicated input: this rank's slice, its gradient summed
            if x.dim() == 0 or x.shape[-1] != self.in_features:
                raise self._refuse_input(x, str(self.in_features), "all of its input "
                                         "features, replicated: Rowwise(split_input=True)")
            x = pvary(x, self.axis, mesh=self.mesh).narrow(-1, rank * block, valid)
        elif x.dim() == 0 or x.shape[-1] not in (block, valid):
            widths = str(block) if valid == block else f"{block} (padded) or {valid}"
            raise self._refuse_input(x, widths, "this rank's slice of its input features, as "
                                     "a colwise layer without gather_output gives it")
        if x.shape[-1] != valid:
            x = x.narrow(-1, 0, valid)  # the padding of an uneven split: ignored
        weight = self.weight if valid == block else self.weight.narrow(in_dim, 0, valid)
        partial = self._matmul(x, weight, None)
        if self.sequence_dim is None:
            y = psum_invariant(partial, self.axis, mesh=self.mesh)
            return y if self.bias is None else y + self.bias
        y = self._scatter_sequence(partial)
        return y if self.bias is None else y + pvary(self.bias, self.axis, mesh=self.mesh)
