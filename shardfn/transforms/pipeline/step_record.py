"""What one pipeline step knows: what it was given, what its forwards left, its progress.

A step (``runtime.run_step``, and ``inference.run_forward``) is made of:

* :class:`StepInputs` (frozen): what the step was given, fixed when it starts: the
  plan, this rank's leaves, the micro-batches of the inputs and targets, the shapes a
  first step inferred, and the messenger its messages go through;
* :class:`Kept` (frozen, one per stage and micro-batch whose graph is alive): what a
  forward left for its backward. The backward replaces it by the part ``W`` still
  needs, or drops it, so each graph is freed as soon as its last piece ran;
* :class:`Progress`: the one mutable part, what the actions change as they run (the
  messages handed over on this rank, the kept graphs, the loss so far, the buffers as
  the forwards update them, and the counts and events of the report).

The actions (:mod:`.actions`) are functions of ``(step, progress)``.

Example:
    >>> step, progress = start_step(plan, leaves, inputs, targets, messenger)
    >>> progress.kept[(s, i)] = Kept(x, out, None, None)            # F of stage s
    >>> kept = progress.kept.pop((s, i))                              # its B
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

import shardfn.transforms.pipeline._weight_grad as wg
from shardfn.transforms.pipeline._p2p import DeclaredValue, Messenger
from shardfn.transforms.pipeline.batch import batch_rows
from shardfn.transforms.pipeline.kinds import MessageKey
from shardfn.transforms.pipeline.report import Event
from shardfn.transforms.pipeline.step_plan import StepPlan, split_microbatches

__all__ = ["Kept", "Progress", "StepInputs", "start_step"]

Params = dict[str, torch.Tensor]


class StepInputs(NamedTuple):
    """What one step was given (fixed when it starts).

    Attributes:
        plan: the step plan (stages, schedule, axis, forwards, declared shapes).
        leaves: this rank's leaves (trainable ones leaves requiring grad).
        inputs: per micro-batch, its piece of the inputs (only stage 0 reads them).
        targets: per micro-batch, its piece of the targets (only the last stage reads them).
        batch: rows of the whole batch (the loss of micro-batch ``i`` is scaled by
            its rows over these): the inputs', else the targets' (a rank without stage 0).
        inferred: the activation shapes a first step found, or None (``run_step``).
        mutable: thread this rank's buffers through its stages' forwards.
        messenger: the step's messages to and from the other pp ranks (its own state of
            what is posted and received lives in :class:`~._p2p.Messenger`).
        t0: ``time.perf_counter()`` when the step started (events are relative to it).
    """

    plan: StepPlan
    leaves: Mapping[str, torch.Tensor]
    inputs: tuple[Any, ...]
    targets: tuple[Any, ...]
    batch: int
    inferred: Mapping[MessageKey, DeclaredValue] | None
    mutable: bool
    messenger: Messenger
    t0: float


class Kept(NamedTuple):
    """One micro-batch's graph of one stage, from F to its last backward piece.

    After F: ``x`` and ``out`` (``split`` and ``captured`` None). With split backward,
    ``B`` replaces it by ``(None, out, split, captured)``: the graph analysis of
    :mod:`._weight_grad` and the gradients recorded at its intermediates, which is
    all ``W`` needs; by ``(None, outs, None, output gradients)`` when there was no
    input gradient to compute (stage 0: ``W`` runs the whole backward, as torch's
    first stage does); or by ``(None, None, None, None)`` when ``B`` ran the full
    backward (``W`` then has nothing left to do). ``out`` is kept until ``W`` although
    ``W`` does not need the graph above the intermediates: a kept graph is then whole
    from F to its last piece, as the memory accounting (``peak_live`` times one
    micro-batch's graph) counts it. Dropping it at ``B`` would free that graph tail
    (on the last stage the loss's saved tensors and the last unit's output side).
    """

    x: Any  # the stage's input (a leaf requiring grad when it is floating and s > 0)
    out: Any  # the output(s), or the scaled loss on the last stage
    split: wg.Split | None  # set by B (split backward): the graph analysis
    captured: list | None  # set by B: gradients into split.intermediates


@dataclasses.dataclass(eq=False, slots=True)
class Progress:
    """The mutable part of one step: what its actions change as they run.

    Attributes:
        local: messages handed over on this rank (a stage to the next one held here):
            key -> (the value detached, which of its tensors need grad).
        kept: ``(stage, microbatch)`` -> its graph, from F until its last backward piece.
        loss: the scaled losses of the last stage's forwards so far, summed (then the
            whole batch's, received on the other ranks).
        buffers: with ``mutable``: this rank's buffers as the forwards so far left them
            (else None).
        next_forward: stage -> the micro-batch its next forward must be (``mutable``:
            buffers need the forwards in order).
        seen: the shapes of the activations (and the loss, outputs) this step sent or
            received (``StepReport.shapes``).
        peak_live: stage -> the most graphs it kept at once.
        peak_held: the most graphs this rank kept at once.
        events: every action so far, as it ran.
        wait: seconds the running action has waited to receive so far.
    """

    local: dict[MessageKey, tuple[Any, tuple[bool, ...] | None]]
    kept: dict[tuple[int, int], Kept]
    loss: torch.Tensor | None
    buffers: Params | None
    next_forward: dict[int, int]
    seen: dict[MessageKey, DeclaredValue]
    peak_live: dict[int, int]
    peak_held: int = 0
    events: list[Event] = dataclasses.field(default_factory=list)
    wait: float = 0.0


def start_step(plan: StepPlan, leaves: Mapping[str, torch.Tensor], inputs: Any, targets: Any,
               messenger: Messenger,
               inferred: Mapping[MessageKey, DeclaredValue] | None = None,
               mutable: bool = False) -> tuple[StepInputs, Progress]:
    """A step's :class:`StepInputs` and its starting :class:`Progress`.

    Args:
        plan: the step plan.
        leaves: this rank's leaves.
        inputs: the whole batch's inputs: a tensor or a :class:`~.batch.UnitInputs`
            (every tensor split on dim 0 into the micro-batches); None on a rank without
            stage 0.
        targets: the whole batch's targets, or None (inference, a rank without the last
            stage, or a loss_fn that takes none).
        messenger: the step's messenger.
        inferred: the shapes a first step found (``run_step``), or None.
        mutable: thread the buffers through the forwards.

    Returns:
        ``(step, progress)``.

    Example:
        >>> step, progress = start_step(plan, leaves, x, y, messenger)
        >>> len(step.inputs) == plan.schedule.n_microbatches
        True
    """
    m = plan.schedule.n_microbatches
    mine = plan.stages.on_rank(plan.rank)
    buffer_names = plan.stages.full.buffer_names
    buffers = None if not mutable else {
        n: leaves[n] for st in mine for n in st.names
        if n not in st.trainable and n in buffer_names}
    rows = batch_rows(inputs) if inputs is not None else batch_rows(targets)
    step = StepInputs(plan, leaves, tuple(split_microbatches(inputs, m)),
                      tuple(split_microbatches(targets, m)), rows, inferred, mutable, messenger,
                      time.perf_counter())
    progress = Progress(local={}, kept={}, loss=None, buffers=buffers,
                        next_forward={st.index: 0 for st in mine}, seen={},
                        peak_live={st.index: 0 for st in mine})
    return step, progress
