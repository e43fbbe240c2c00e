"""Inference through the pipeline: the schedule's forward actions, no graph.

Each rank runs the ``F`` actions of its schedule in order, under ``no_grad``;
the last stage sends each micro-batch's output to every other pp rank, so the
output is on every rank: a tensor, or a tuple/list of tensors (each entry
concatenated over the micro-batches on dim 0; None entries stay None). Errors
settle as in a training step (:func:`~.guard.settle_and_raise`). The step's records are
those of a training step (:mod:`.step_record`); of the actions it runs only the
message functions (:func:`~.actions.give`, :func:`~.actions.take`).

Example:
    >>> out = run_forward(step_plan, leaves, inputs)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardfn.transforms.pipeline._p2p import DeclaredValue, Messenger, declared_of_value
from shardfn.transforms.pipeline.actions import action_text, check_output, give, take
from shardfn.transforms.pipeline.guard import settle_and_raise
from shardfn.transforms.pipeline.kinds import ActionKind, MessageKind
from shardfn.transforms.pipeline.messages import message_lists
from shardfn.transforms.pipeline.schedules import Action
from shardfn.transforms.pipeline.step_plan import StepPlan
from shardfn.transforms.pipeline.step_record import start_step
from shardfn.transforms.pipeline.values import check_value

__all__ = ["run_forward"]


def run_forward(plan: StepPlan, prepare: Callable[[], Mapping[str, torch.Tensor]],
                inputs: Any, inferred: Mapping[tuple, DeclaredValue] | None = None
                ) -> tuple[Any, dict[tuple, DeclaredValue]]:
    """Inference: the forward actions of the schedule, no graph; the output on every pp rank.

    The last stage's outputs (one per micro-batch) are sent to every other pp
    rank and concatenated on dim 0 (per entry for a tuple). ``prepare`` checks the
    arguments and returns this rank's leaves (inside the error handling, as in
    ``run_step``); ``inferred`` are shapes a first call found, as in ``run_step``.
    ``inputs`` is a tensor or a :class:`~.batch.UnitInputs` (stage 0's first unit gets
    each micro-batch's piece of its arguments spread).

    Returns:
        ``(output, shapes)``: the model's output, and the activation shapes this rank
        sent or received (``StepReport.shapes``).
    """
    forwards = [a for a in plan.schedule.actions[plan.rank] if a.kind == ActionKind.F]
    messenger = Messenger(plan.ax, plan.tag_of, lambda key: plan.declared_of(key, inferred),
                          plan.device)
    owed, expected = message_lists(plan.schedule, plan.rank, forwards)
    m, p, last = plan.schedule.n_microbatches, plan.schedule.n_ranks, plan.n_stages - 1
    holder = plan.schedule.rank_of(last)
    outs: dict[int, torch.Tensor] = {}
    keys = [(MessageKind.OUT, 0, i) for i in range(m)]
    if plan.rank == holder:
        owed += [(key, r) for key in keys for r in range(p) if r != holder]
    else:
        expected += [(key, holder) for key in keys]
    action: Action | None = None
    try:
        leaves = prepare()
        step, progress = start_step(plan, leaves, inputs, None, messenger, inferred)
        with torch.no_grad():
            for action in forwards:
                s, i = action.stage, action.microbatch
                x = step.inputs[i] if s == 0 else \
                    take(step, progress, MessageKind.ACT, s - 1, i)[0]
                out = plan.forwards[s](leaves, x)
                if s < last:
                    check_output(step, s, i, out)
                    give(step, progress, MessageKind.ACT, s, i, out)
                    continue
                check_value(out, None, f"pipeline apply: the last stage's output for "
                            f"micro-batch {i}", plan.rank)
                outs[i] = out
                for r in range(p):
                    if r != holder:
                        messenger.send(keys[i], r, out)
            action = None
            if plan.rank != holder:
                outs = {i: messenger.recv(keys[i], holder) for i in range(m)}
            progress.seen.update({keys[i]: declared_of_value(outs[i]) for i in range(m)})
            messenger.finish()
    except BaseException as error:
        where = f"pipeline apply on pp rank {plan.rank}, during {action_text(action)}"
        settle_and_raise(messenger, owed, expected, error, where)
    return _concat([outs[i] for i in range(m)]), progress.seen


def _concat(outs: list[Any]) -> Any:
    """The micro-batches' outputs as one: tensors concatenated on dim 0, per tuple entry."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=0)
    entries = []
    for j, first in enumerate(outs[0]):
        column = [out[j] for out in outs]
        if all(c is None for c in column):
            entries.append(None)
        elif any(c is None for c in column) or first.dim() == 0:
            raise ValueError(f"pipeline apply: entry {j} of the last stage's output is None "
                             "for some micro-batches or a 0-dim tensor, which cannot be "
                             "concatenated over micro-batches (give it a batch dim)")
        else:
            entries.append(torch.cat(column, dim=0))
    return type(outs[0])(entries)
