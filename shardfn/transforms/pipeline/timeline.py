"""Pipeline timelines: record what each rank did when, export a Chrome trace and a PNG chart.

An event is one span on one rank: a compute action (``"F"``, ``"B"``, ``"W"`` for a
stage and micro-batch) or a wait (``"recv"``: blocked receiving that stage's input or
output gradient; ``"send"``: blocked waiting for sends to finish). Times are seconds
on one clock shared by every rank (``time.perf_counter()`` is: on Linux it reads
CLOCK_MONOTONIC, the same in every process of a host); the exports start at the
earliest event.

How the runtime records (one :class:`Timeline` per step, per rank, or shared by the
threads of one process)::

    timeline = Timeline()                       # enabled=False: every call returns at once
    t0 = time.perf_counter()
    x = receive(...)                            # blocking receive of F's input
    timeline.record(rank, "recv", stage, mb, t0, time.perf_counter(), peer=src)
    with timeline.span(rank, "F", stage, mb):   # or record(rank, "F", stage, mb, start, end)
        out = stage_fn(params, x)
    ...
    events = timeline.events                    # this rank's events, by start time
    all_events = gather_events(events)          # on every rank: all ranks' (collective)
    to_chrome_trace(all_events, "trace.json"); plot(all_events, "timeline.png")
    measured_bubble(all_events)                 # idle fraction, beside simulate()'s bubble

A runtime that already keeps its own per-action records with ``kind, stage,
microbatch, start, end, wait`` (the receive wait at the start of the action) converts
them with :func:`from_actions`. :func:`from_simulation` makes the events of a
:func:`~shardfn.transforms.pipeline.simulate.simulate` run, whose measured bubble is
the simulated one.

Example:
    >>> tl = Timeline()
    >>> tl.record(0, "F", 0, 0, 0.0, 1.0); tl.record(1, "F", 1, 0, 1.0, 2.0)
    >>> measured_bubble(tl.events)     # 2 busy seconds of 2 ranks x 2 seconds
    0.5
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from shardfn.transforms.pipeline.kinds import ActionKind, WaitKind
from shardfn.transforms.pipeline.schedules import Schedule
from shardfn.transforms.pipeline.simulate import SimResult

__all__ = ["COMPUTE", "WAITS", "Timeline", "TimelineEvent", "from_actions", "from_simulation",
           "gather_events", "measured_bubble", "plot", "to_chrome_trace"]

COMPUTE: tuple[ActionKind, ...] = tuple(ActionKind)
WAITS: tuple[WaitKind, ...] = tuple(WaitKind)
#: what an event is: a compute action or a wait
EventKind = ActionKind | WaitKind
_COLOURS = {ActionKind.F: "#4C72B0", ActionKind.B: "#55A868", ActionKind.W: "#C44E52",
            WaitKind.RECV: "#BBBBBB", WaitKind.SEND: "#DDDDDD"}
_NAMES = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.W: "weight grad",
          WaitKind.RECV: "recv wait", WaitKind.SEND: "send wait"}


class TimelineEvent(NamedTuple):
    """One span on one rank.

    Attributes:
        rank: the pp rank.
        kind: ``"F"``, ``"B"``, ``"W"`` (compute, :class:`~.kinds.ActionKind`) or
            ``"recv"``, ``"send"`` (waits, :class:`~.kinds.WaitKind`).
        stage: the stage (for a send wait covering several messages: any of them, or -1).
        microbatch: the micro-batch (-1 when not one).
        start: seconds, on the clock shared by all ranks.
        end: seconds (``>= start``).
        peer: the other rank of a wait (-1 when not known or not a wait).
    """

    rank: int
    kind: EventKind
    stage: int
    microbatch: int
    start: float
    end: float
    peer: int = -1


class Timeline:
    """A thread-safe event recorder; disabled, it records nothing and costs one branch.

    Args:
        enabled: record (True) or ignore every call (False).

    Example:
        >>> tl = Timeline()
        >>> with tl.span(0, "F", 0, 3):
        ...     pass
        >>> [(e.kind, e.microbatch) for e in tl.events]
        [('F', 3)]
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._events: list[TimelineEvent] = []

    def record(self, rank: int, kind: EventKind, stage: int, microbatch: int, start: float,
               end: float, peer: int = -1) -> None:
        """Add one event (see :class:`TimelineEvent`); a ValueError on a bad kind or span."""
        if not self.enabled:
            return
        if kind not in COMPUTE and kind not in WAITS:
            raise ValueError(f"Timeline.record: kind must be one of {COMPUTE + WAITS}, "
                             f"got {kind!r} (rank {rank}, stage {stage}, microbatch "
                             f"{microbatch})")
        if end < start:
            raise ValueError(f"Timeline.record: {kind} of stage {stage}, microbatch "
                             f"{microbatch} on rank {rank} ends ({end}) before it starts "
                             f"({start})")
        event = TimelineEvent(rank, kind, stage, microbatch, float(start), float(end), peer)
        with self._lock:
            self._events.append(event)

    @contextlib.contextmanager
    def span(self, rank: int, kind: EventKind, stage: int, microbatch: int,
             peer: int = -1) -> Iterator[None]:
        """Record the time the ``with`` body takes (recorded also when it raises)."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(rank, kind, stage, microbatch, start, time.perf_counter(), peer)

    @property
    def events(self) -> tuple[TimelineEvent, ...]:
        """Every event so far, by (start, rank)."""
        with self._lock:
            return tuple(sorted(self._events, key=lambda e: (e.start, e.rank)))

    def clear(self) -> None:
        """Forget every event (for the next step)."""
        with self._lock:
            self._events.clear()


def from_actions(rank: int, actions: Iterable[Any], offset: float = 0.0
                 ) -> list[TimelineEvent]:
    """Events from a runtime's per-action records (each with ``kind, stage, microbatch,
    start, end, wait``; ``wait``: the receive wait at the start of the action).

    Args:
        rank: the rank the records are from.
        actions: the records.
        offset: added to every time (e.g. the rank's step start on the shared clock, when
            the records count from it).

    Returns:
        Per action: a ``"recv"`` event for its wait (when > 0), then its compute event.
    """
    events = []
    for a in actions:
        start, end, wait = a.start + offset, a.end + offset, max(0.0, min(a.wait, a.end - a.start))
        if wait > 0:
            events.append(TimelineEvent(rank, WaitKind.RECV, a.stage, a.microbatch, start,
                                        start + wait))
        events.append(TimelineEvent(rank, a.kind, a.stage, a.microbatch, start + wait, end))
    return events


def from_simulation(schedule: Schedule, result: SimResult) -> list[TimelineEvent]:
    """The events of a :func:`~shardfn.transforms.pipeline.simulate.simulate` run."""
    return [TimelineEvent(rank, a[0], a[1], a[2], result.starts[rank][k], result.ends[rank][k])
            for rank, actions in enumerate(schedule.actions) for k, a in enumerate(actions)]


def gather_events(events: Sequence[TimelineEvent], group: Any = None) -> list[TimelineEvent]:
    """Every rank's events, on every rank (a collective over ``group``: all must call it).

    Args:
        events: this rank's events.
        group: a ``torch.distributed`` process group (default: the world); with no process
            group initialised, ``events`` is returned as is.

    Returns:
        All ranks' events, by start time.
    """
    if not dist.is_available() or not dist.is_initialized():
        return sorted(events, key=lambda e: (e.start, e.rank))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [tuple(e) for e in events], group=group)
    merged = [TimelineEvent(*e) for part in gathered for e in part]
    return sorted(merged, key=lambda e: (e.start, e.rank))


def _ranks(events: Sequence[TimelineEvent], n_ranks: int | None) -> list[int]:
    ranks = sorted({e.rank for e in events})
    return list(range(n_ranks)) if n_ranks is not None else ranks


def measured_bubble(events: Sequence[TimelineEvent], n_ranks: int | None = None) -> float:
    """The idle fraction of the step: ``1 - compute time / (ranks * span)``.

    The span runs from the first compute start to the last compute end over all ranks
    (the busiest stretch: waits before the first and after the last compute are not
    counted); waits and gaps are idle; overlapping compute spans on one rank count once.
    This is :func:`simulate`'s ``bubble`` for a simulated timeline.

    Args:
        events: every rank's events.
        n_ranks: ranks in the pipeline (default: the ranks that appear in ``events``;
            a rank that recorded nothing is all idle only when this is given).

    Returns:
        A fraction in ``[0, 1]``.

    Raises:
        ValueError: no compute event.
    """
    compute = [e for e in events if e.kind in COMPUTE]
    if not compute:
        raise ValueError("measured_bubble: no compute (F/B/W) event in the timeline")
    first, last = min(e.start for e in compute), max(e.end for e in compute)
    ranks = _ranks(compute, n_ranks)
    span = last - first
    if span <= 0:
        return 0.0
    busy = 0.0
    for rank in ranks:
        spans = sorted((e.start, e.end) for e in compute if e.rank == rank)
        covered_to = first
        for start, end in spans:  # the union of the rank's spans
            busy += max(0.0, end - max(start, covered_to))
            covered_to = max(covered_to, end)
    return max(0.0, 1.0 - busy / (len(ranks) * span))


def to_chrome_trace(events: Sequence[TimelineEvent], path: str | Path | None = None
                    ) -> dict[str, Any]:
    """A Chrome trace (chrome://tracing, https://ui.perfetto.dev): one process per rank.

    Compute events are on thread 0 ("compute") and waits on thread 1 ("waits"), as
    complete events (``"ph": "X"``) in microseconds from the earliest event.

    Args:
        events: every rank's events.
        path: where to write the JSON (None: only return it).

    Returns:
        The trace as a dict (``{"traceEvents": [...], "displayTimeUnit": "ms"}``).
    """
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank,
                      "args": {"name": f"pp rank {rank}"}})
        for tid, name in ((0, "compute"), (1, "waits")):
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                          "args": {"name": name}})
    for e in events:
        wait = e.kind in WAITS
        args = {"stage": e.stage, "microbatch": e.microbatch}
        if e.peer >= 0:
            args["peer"] = e.peer
        trace.append({"name": f"{e.kind}{e.microbatch}" if e.microbatch >= 0 else e.kind,
                      "cat": _NAMES[e.kind], "ph": "X", "pid": e.rank, "tid": int(wait),
                      "ts": (e.start - origin) * 1e6, "dur": (e.end - e.start) * 1e6,
                      "args": args})
    out = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(out))
    return out


def plot(events: Sequence[TimelineEvent], path: str | Path, title: str | None = None,
         n_ranks: int | None = None) -> Path:
    """A PNG chart: one row per rank, coloured F/B/W boxes labelled by micro-batch,
    receive/send waits as thin grey bars, idle gaps left white.

    Args:
        events: every rank's events.
        path: the PNG to write.
        title: the chart's title (default: the measured bubble).
        n_ranks: rows (default: the ranks in ``events``).

    Returns:
        ``path`` as a Path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = _ranks(events, n_ranks)
    origin = min((e.start for e in events), default=0.0)
    width = max((e.end for e in events), default=1.0) - origin or 1.0
    scale, unit = (1e3, "ms") if width < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(ranks) + 1.4))
    for e in events:
        row = ranks.index(e.rank) if e.rank in ranks else None
        if row is None:
            continue
        x, w = (e.start - origin) * scale, (e.end - e.start) * scale
        if e.kind in WAITS:
            ax.broken_barh([(x, w)], (row - 0.08, 0.16), facecolors=_COLOURS[e.kind])
            continue
        ax.broken_barh([(x, w)], (row - 0.35, 0.7), facecolors=_COLOURS[e.kind],
                       edgecolors="white", linewidth=0.5)
        if w > width * scale / 90:
            ax.text(x + w / 2, row, str(e.microbatch), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    kinds = [k for k in COMPUTE + WAITS if any(e.kind == k for e in events)]
    names = {**_NAMES, ActionKind.B: "input grad"} if ActionKind.W in kinds else _NAMES
    ax.legend(handles=[Patch(color=_COLOURS[k], label=names[k]) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.7 * len(ranks))),
              ncol=len(kinds), frameon=False, fontsize=8)
    if title is None and any(e.kind in COMPUTE for e in events):
        title = f"measured bubble {measured_bubble(events, n_ranks):.1%}"
    ax.set_title(title or "")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
