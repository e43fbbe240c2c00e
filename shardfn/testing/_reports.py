"""How the local world describes durations, failures and dead ranks (private to ``local_world``)."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import signal
import textwrap
from typing import Any, NamedTuple

__all__ = ["RemoteFailure", "crash_stacks", "dead_report", "error_summary", "exit_text",
           "indent", "seconds"]

_SUMMARY_CHARS = 300  # a headline quotes at most this much of the error


class RemoteFailure(NamedTuple):
    """What a rank sends back when the function it ran raised."""

    traceback: str  # the formatted traceback, chained exceptions included
    summary: str  # "ValueError: <the last line of its message>", see error_summary


def error_summary(error: BaseException) -> str:
    """``"<exception type>: <last non-empty line of its message>"``, for a one-line headline.

    The type alone for an empty message; cut to 300 characters.

    Example:
        >>> error_summary(ValueError("leaf 'w'\nexpected 3 dims"))
        'ValueError: expected 3 dims'
    """
    try:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        lines = ["<the message could not be read>"]
    text = type(error).__qualname__ + (f": {lines[-1]}" if lines else "")
    return text if len(text) <= _SUMMARY_CHARS else text[: _SUMMARY_CHARS - 3] + "..."


def exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-exitcode).name}"
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def indent(text: str) -> str:
    return textwrap.indent(text.rstrip(), "    ")


def seconds(name: str, value: Any, *, none_ok: bool = False, zero_ok: bool = False) -> Any:
    """Validate a duration: a finite real number > 0 (>= 0 with ``zero_ok``), or None."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds"
                        f"{' or None' if none_ok else ''}, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return value


CRASH_NOISE = ("/multiprocessing/", "/threading.py", 'File "<string>"', "Extension modules:",
                os.sep + "_worker.py", os.sep + "_process.py")


def crash_stacks(text: str) -> str:
    """faulthandler's report without the watchdog thread and the spawn/loop frames."""
    blocks = [block for block in text.strip().split("\n\n") if " in _watchdog" not in block]
    return "\n".join(line for line in "\n\n".join(blocks).splitlines()
                     if not any(noise in line for noise in CRASH_NOISE))


def dead_report(rank: int, exitcode: int | None, stderr: str, crash: str) -> str:
    """How a dead rank is described: its exit, its stderr tail, faulthandler's stacks."""
    text = f"rank {rank} is dead ({exit_text(exitcode)})"
    if stderr:
        text += f"; last lines of its stderr:\n{indent(stderr)}"
    else:
        text += "; its stderr is empty"
    crash = crash_stacks(crash)
    if crash:
        text += f"\n  its Python stacks when it crashed (faulthandler):\n{indent(crash)}"
    return text
