"""The errors of :mod:`shardfn.checkpoint`: each names the checkpoint, file, leaf or rank.

Example:
    >>> try:
    ...     sf.checkpoint.load("ckpt/step_000100", like=state)
    ... except sf.checkpoint.IncompleteCheckpointError as err:
    ...     print(err)
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError",
           "IncompleteCheckpointError"]


class CheckpointError(RuntimeError):
    """A save or load failed (on any rank: every rank raises it, naming the rank at fault)."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint has no commit marker: its save did not finish (or it is not one)."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is missing, truncated or does not match its checksum."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """``like`` does not fit the checkpoint: every missing, unexpected and mis-shaped leaf."""
