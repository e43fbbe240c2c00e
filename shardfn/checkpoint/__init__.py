"""Sharded checkpoints on torch.distributed.checkpoint: save, load, reshard, crash-safe.

``save`` writes any state pytree (parameter shards, optimizer states of every
transform, step, loss-scaler and RNG states, data position) with every rank
writing only its own shards; ``load`` reads it into another mesh, world size
or sharding. The files are a plain DCP checkpoint plus a commit marker with
checksums. See docs/checkpoint.md.

Example:
    >>> import shardfn as sf
    >>> sf.checkpoint.save("ckpt", state, layouts={"params": model, "opt": opt}, step=100,
    ...                    keep_last=3)
    >>> state = sf.checkpoint.load(sf.checkpoint.latest("ckpt"), like,
    ...                            layouts={"params": model, "opt": opt})
"""

from shardfn.checkpoint._commit import latest
from shardfn.checkpoint._compress import registry as compression_registry
from shardfn.checkpoint._layout import OptLayout, PerRank, Skip
from shardfn.checkpoint._staging import release_staging
from shardfn.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from shardfn.checkpoint.export import (
    export_state_dict,
    import_state_dict,
    non_persistent_buffers,
    optimizer_from_torch,
    optimizer_to_torch,
)
from shardfn.checkpoint.hf import load_pretrained, save_pretrained
from shardfn.checkpoint.load import load
from shardfn.checkpoint.save import SaveHandle, save, wait_pending

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "OptLayout",
    "PerRank",
    "SaveHandle",
    "Skip",
    "compression_registry",
    "export_state_dict",
    "import_state_dict",
    "latest",
    "load",
    "load_pretrained",
    "non_persistent_buffers",
    "optimizer_from_torch",
    "optimizer_to_torch",
    "release_staging",
    "save",
    "save_pretrained",
    "wait_pending",
]
