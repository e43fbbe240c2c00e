"""Data for sharded training: batches laid out by the mesh, exact resume, token files.

* :func:`loader`: a ``torch.utils.data.DataLoader`` that gives each rank its block of
  every global batch (tp/sp/pp peers the same block), in a global order drawn from one
  seed whatever the world size, and keeps its position as a :class:`DataState` that
  ``sf.checkpoint`` saves; ``loader(..., state=saved)`` continues the exact order,
  also on another number of data ranks.
* :class:`MeshSampler`: the batch sampler under it, for a ``DataLoader`` of your own.
* :func:`stage_reads` / ``loader(..., reads=)``: under a pipeline, each pp rank loads only
  what its stages read (inputs on the first, targets on the last) as a :class:`StageBatch`.
* :class:`TokenFile` / :func:`write_tokens`: a memory-mapped token file (nanoGPT's
  raw uint16/uint32) read as fixed-length ``(inputs, targets)`` windows.

See docs/data.md.

Example:
    >>> mesh = sf.Mesh({"dp": 2, "tp": 2})
    >>> data = sf.data.loader(sf.data.TokenFile("train.bin", 256), mesh, global_batch=64)
    >>> for inputs, targets in data: ...
    >>> sf.checkpoint.save(ckpt, {"params": params, "data": data.state}, mesh, step=step)
"""

from shardfn.data.fields import Fields, StageBatch, StageReads, pick_fields, stage_reads
from shardfn.data.layout import BatchLayout, batch_layout, split_global_batch
from shardfn.data.loader import MeshLoader, Padded, loader
from shardfn.data.order import DataState, LastBatch, epoch_order
from shardfn.data.sampler import MeshSampler
from shardfn.data.token_file import TokenDtype, TokenFile, write_tokens

__all__ = [
    "BatchLayout",
    "DataState",
    "Fields",
    "LastBatch",
    "MeshLoader",
    "MeshSampler",
    "Padded",
    "StageBatch",
    "StageReads",
    "TokenDtype",
    "TokenFile",
    "batch_layout",
    "epoch_order",
    "loader",
    "pick_fields",
    "split_global_batch",
    "stage_reads",
    "write_tokens",
]
