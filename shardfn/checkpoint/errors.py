"""The errors of :mod:`shardfn.checkpoint`: each names the checkpoint, file, leaf or rank.

Example:
    >>> try:
    ...     sf.checkpoint.load("ckpt/step_000100", like=state)
    ... except sf.checkpoint.IncompleteCheckpointError as err:
    ...     print(err)
"""

from __future__ import annotations

from shardfn.pytree import path_name

__all__ = ["CheckpointError", "CheckpointMismatchError", "CorruptCheckpointError",
           "IncompleteCheckpointError", "structure_difference"]


class CheckpointError(RuntimeError):
    """A save or load failed (on any rank: every rank raises it, naming the rank at fault)."""


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint has no commit marker: its save did not finish (or it is not one)."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is missing, truncated or does not match its checksum."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """``like`` does not fit the checkpoint: every missing, unexpected and mis-shaped leaf."""


def structure_difference(got, want, limit: int = 6) -> str:
    """The leaves one tree structure has and the other lacks, named (for error messages).

    Args:
        got, want: two ``PyTreeSpec`` s (``tree_structure`` of two trees).
        limit: how many names to list on each side.

    Returns:
        ``"missing: a.b, c; unexpected: d"`` (sides with no name left out), or a note that
        the leaves agree and the containers differ.

    Example:
        >>> structure_difference(sf.pytree.tree_structure({"a": 1}),
        ...                      sf.pytree.tree_structure({"a": 1, "b": 2}))
        'missing: b'
    """
    have, need = ({path_name(p) for p in spec.paths()} for spec in (got, want))
    parts = [f"{what}: {', '.join(sorted(names)[:limit])}"
             + (f" and {len(names) - limit} more" if len(names) > limit else "")
             for what, names in (("missing", need - have), ("unexpected", have - need)) if names]
    return "; ".join(parts) or "the same leaf names in other containers"
