"""What a pipeline step reports: its events (for timelines) and its counts.

Example:
    >>> loss, grads, report = pp.value_and_grad(params, x, y, report=True)
    >>> report.peak_live, [e.kind for e in report.events][:2]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from shardfn.transforms.pipeline._p2p import DeclaredValue

__all__ = ["Event", "StepReport"]


class Event(NamedTuple):
    """One action as it ran: seconds since the step began, and how long it waited to receive."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    wait: float


class StepReport(NamedTuple):
    """What a step did on this rank.

    Attributes:
        events: every action in the order it ran (for timelines).
        peak_live: stage -> the most micro-batches whose graph (activations) it kept at once.
        peak_held: the most graphs this rank (all its stages) kept at once
            (``simulate(schedule).peak_held[rank]``).
        start: ``time.perf_counter()`` when the step began (events are relative to it;
            ``timeline.from_actions(rank, report.events, offset=report.start)``).
        header_first: messages this rank sent or received whose payload waited for a
            shape header (0 once the shapes are declared or inferred).
        shapes: message key -> the shapes of every activation (and the loss) this rank
            sent or received (what a later step with the same batch can declare).
        buffers: with ``mutable=True``, this rank's buffers after the step (each stage's
            forwards updated them micro-batch by micro-batch); else None.
    """

    events: tuple[Event, ...]
    peak_live: dict[int, int]
    peak_held: int
    start: float
    header_first: int = 0
    shapes: Mapping[tuple, DeclaredValue] | None = None
    buffers: dict[str, torch.Tensor] | None = None
