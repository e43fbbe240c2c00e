"""How the local world describes durations and dead ranks (private to ``local_world``)."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import signal
import textwrap
from typing import Any

__all__ = ["crash_stacks", "dead_report", "exit_text", "indent", "seconds"]


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
