"""Inference through the pipeline: the schedule's forward actions, no graph.

Each rank runs the ``F`` actions of its schedule in order, under ``no_grad``;
the last stage sends each micro-batch's output to every other pp rank, so the
output is on every rank. Errors settle as in a training step
(:func:`~.runtime.settle_and_raise`).

Example:
    >>> out = run_forward(step_plan, leaves, inputs)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from shardfn.transforms.pipeline._p2p import Messenger
from shardfn.transforms.pipeline.messages import message_lists
from shardfn.transforms.pipeline.runtime import (
    StepPlan,
    StepState,
    action_text,
    describe,
    settle_and_raise,
)
from shardfn.transforms.pipeline.schedules import Action, stage_rank

__all__ = ["run_forward"]


def run_forward(plan: StepPlan, prepare: Callable[[], Mapping[str, torch.Tensor]],
                inputs: torch.Tensor) -> torch.Tensor:
    """Inference: the forward actions of the schedule, no graph; the output on every pp rank.

    The last stage's outputs (one per micro-batch) are sent to every other pp
    rank and concatenated on dim 0. ``prepare`` checks the arguments and returns
    this rank's leaves (inside the error handling, as in ``run_step``).
    """
    forwards = [a for a in plan.schedule.actions[plan.rank] if a.kind == "F"]
    messenger = Messenger(plan.ax, plan.tag_of, plan.declared_of, plan.device)
    owed, expected = message_lists(plan.schedule, plan.rank, forwards)
    m, p, last = plan.schedule.n_microbatches, plan.schedule.n_ranks, plan.n_stages - 1
    holder = stage_rank(last, p)
    outs: dict[int, torch.Tensor] = {}
    keys = [("out", 0, i) for i in range(m)]
    if plan.rank == holder:
        owed += [(key, r) for key in keys for r in range(p) if r != holder]
    else:
        expected += [(key, holder) for key in keys]
    action: Action | None = None
    try:
        leaves = prepare()
        step = StepState(plan, leaves, inputs, None, messenger)
        with torch.no_grad():
            for action in forwards:
                s, i = action.stage, action.microbatch
                x = step.inputs[i] if s == 0 else step.take("act", s - 1, i)
                out = plan.forwards[s](leaves, x)
                if s < last:
                    step.check_output(s, i, out)
                    step.give("act", s, i, out)
                    continue
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"pipeline apply: the last stage returned {describe(out)} "
                                    f"for micro-batch {i}; apply needs one tensor")
                outs[i] = out
                for r in range(p):
                    if r != holder:
                        step.messenger.send(("out", 0, i), r, out)
            action = None
            if plan.rank != holder:
                outs = {i: step.messenger.recv(("out", 0, i), holder) for i in range(m)}
            step.messenger.finish()
    except BaseException as error:
        where = f"pipeline apply on pp rank {plan.rank}, during {action_text(action)}"
        settle_and_raise(messenger, owed, expected, error, where)
    return torch.cat([outs[i] for i in range(m)], dim=0)
