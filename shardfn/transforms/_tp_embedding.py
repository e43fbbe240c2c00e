"""The modules that run a split ``nn.Embedding`` for ``tensor_split``.

* :class:`VocabEmbedding` (``Vocab()``): the rows (vocabulary) are split; each rank
  looks up the ids in its range (zeros elsewhere) and ``psum_invariant`` sums the
  lookups (sequence parallel: ``psum_scatter`` along the sequence). An uneven
  vocabulary is padded (``ceil(V / tp)`` rows each); ids are checked against the true
  ``V``, so the padded rows are never looked up.
* :class:`ColwiseEmbedding` (``Colwise()`` on an embedding, torch's
  ``ColwiseParallel`` on ``nn.Embedding``): the embedding dim is split; each rank looks
  up every id in its columns, so the output is split on its last dim, with no
  communication in forward or backward (the ids have no gradient);
  ``gather_output=True`` all-gathers it (backward: this rank's slice). An uneven
  embedding dim is padded as ``sf.shard`` pads; the pad columns are zeros.

Example:
    >>> tp = sf.tensor_split(fm, mesh, "tp", {"tok": sf.Colwise(gather_output=True)})
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardfn.mesh import Mesh
from shardfn.primitives import axis_index, psum_invariant
from shardfn.transforms._tp_checks import check_ids
from shardfn.transforms._tp_linear import _Split, gather_features, valid_width

__all__ = ["ColwiseEmbedding", "VocabEmbedding"]


class _SplitEmbedding(_Split):
    def __init__(self, inner: nn.Embedding, mesh: Mesh, axis: str, path: str = "",
                 sequence_dim: int | None = None):
        nn.Module.__init__(self)
        self.weight = inner.weight
        self.mesh, self.axis, self.inner_type = mesh, axis, type(inner).__name__
        self.path, self.sequence_dim = path, sequence_dim
        self.num_embeddings, self.embedding_dim = inner.num_embeddings, inner.embedding_dim
        self.scale_grad_by_freq = inner.scale_grad_by_freq
        self.padding_idx = inner.padding_idx  # global id (non-negative, as nn.Embedding keeps it)


class VocabEmbedding(_SplitEmbedding):
    """Look up the ids in this rank's vocabulary range (zeros elsewhere), then psum_invariant
    (sequence parallel: psum_scatter along the sequence)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        check_ids(ids, self.num_embeddings, self.path, self.mesh, self.axis,
                  self.sequence_dim is not None)
        start = axis_index(self.axis, mesh=self.mesh) * rows
        mine = (ids >= start) & (ids < start + rows)
        local_ids = torch.where(mine, ids - start, torch.zeros_like(ids))
        padding = self.padding_idx  # its row gets no gradient: the owner's local row
        local_padding = padding - start if padding is not None and \
            start <= padding < start + rows else None
        looked_up = F.embedding(local_ids, self.weight, local_padding,
                                scale_grad_by_freq=self.scale_grad_by_freq)
        looked_up = looked_up * mine.unsqueeze(-1).to(looked_up.dtype)
        if self.sequence_dim is not None:
            return self._scatter_sequence(looked_up)
        return psum_invariant(looked_up, self.axis, mesh=self.mesh)


class ColwiseEmbedding(_SplitEmbedding):
    """Look up every id in this rank's columns: ``[..., embedding_dim / tp]``; optionally
    all-gathered on the last dim (replicated, backward this rank's slice)."""

    def __init__(self, inner: nn.Embedding, mesh: Mesh, axis: str, gather_output: bool,
                 path: str = ""):
        super().__init__(inner, mesh, axis, path)
        self.gather_output = gather_output

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        block = self.weight.shape[1]
        valid = valid_width(self.embedding_dim, block, axis_index(self.axis, mesh=self.mesh))
        weight = self.weight if valid == block else self.weight.narrow(1, 0, valid)
        y = F.embedding(ids, weight, self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq)
        if valid != block:  # uneven: the pad columns are zeros and get no gradient
            y = F.pad(y, (0, block - valid))
        if not self.gather_output:
            return y
        return gather_features(y, self.axis, self.mesh, self.embedding_dim)
