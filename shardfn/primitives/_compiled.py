"""What shardfn leaves out of code that ``torch.compile`` traces, and how it says so.

Check mode (:mod:`~shardfn.primitives.consistency`: an exchange through the
key-value store under a lock, per call) and the communication counters
(:mod:`~shardfn.primitives.stats`: Python dicts, which would also force a
recompile on every step) are eager tools. While dynamo traces a step
(``torch.compiler.is_compiling()``) both are turned off for the code it
compiles, and a ``UserWarning`` says so once per process and feature, at trace
time (nothing is added to the compiled graph). Run the step eagerly to check
it (``torch.compiler.set_stance("force_eager")``) or to count its bytes.

Example:
    >>> if tracing():
    ...     skipped("comm_stats")   # warns once, when dynamo traces this line
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from shardfn._torch_internals import constant_result, unsafe_overlap_passes

__all__ = ["Feature", "MESSAGES", "refuse_unsafe_overlap", "skipped", "tracing"]

Feature = Literal["check_mode", "comm_stats"]

MESSAGES: dict[str, str] = {
    "check_mode": (
        "shardfn check mode is on, but code traced by torch.compile is not checked (its "
        "store exchanges cannot be traced): collectives and transform boundaries inside the "
        "compiled step run unchecked. Run the step eagerly once to check it "
        "(torch.compiler.set_stance('force_eager'), or call the uncompiled function)."),
    "comm_stats": (
        "sf.comm_stats() does not count the collectives of code traced by torch.compile "
        "(Python counters cannot live in a compiled graph): bytes and calls of compiled "
        "steps are missing from it. Count them on an eager run of the step."),
}

_WARNED: set[str] = set()


def tracing() -> bool:
    """Whether dynamo is tracing the code that calls this (``torch.compiler.is_compiling()``).

    Returns:
        True inside code ``torch.compile`` is tracing; False in eager code (a cheap call).
    """
    return torch.compiler.is_compiling()


@constant_result
def _warn_check_mode() -> bool:
    return _warn_once("check_mode")


@constant_result
def _warn_comm_stats() -> bool:
    return _warn_once("comm_stats")


def _warn_once(feature: str) -> bool:
    if feature not in _WARNED:
        _WARNED.add(feature)
        warnings.warn(MESSAGES[feature], UserWarning, stacklevel=3)
    return True


def skipped(feature: Feature) -> None:
    """Say once per process that ``feature`` is off in the code being compiled.

    Under dynamo the warning is issued while the step is traced (the function is
    ``torch.compiler.assume_constant_result``: it runs at trace time and leaves
    nothing in the graph); called eagerly it warns the same way.

    Args:
        feature: ``"check_mode"`` or ``"comm_stats"``.

    Example:
        >>> skipped("check_mode")
    """
    if feature == "check_mode":
        _warn_check_mode()
    else:
        _warn_comm_stats()


@constant_result
def _unsafe_overlap_message() -> str:
    names = unsafe_overlap_passes()
    if not names:
        return ""
    return (f"inductor's global config runs the overlap passes {names} with "
            "inductor's config_comms *_unsafe_collectives_reorder on: they may issue "
            "two collectives in another order on each rank (each rank compiles its own graph), "
            "which hangs or mixes the data. Pass options=sf.overlap_options() to "
            "torch.compile instead (the same passes, collectives kept in order), or set "
            "reorder_iterative_unsafe_collectives_reorder and "
            "sink_waits_iterative_unsafe_collectives_reorder to False")


def refuse_unsafe_overlap() -> None:
    """Raise in code being traced if inductor's global config may reorder its collectives.

    Called where shardfn issues a collective in traced code: at trace time it reads the
    global config once per trace (``assume_constant_result``: nothing in the graph).

    Raises:
        RuntimeError: naming the passes and the fix (``sf.overlap_options()``).
    """
    message = _unsafe_overlap_message()
    if message:
        raise RuntimeError(message)
