"""The pipeline runtime: one rank runs its schedule's actions in order (:func:`run_step`).

A step is a frozen :class:`~.step_record.StepInputs` (what it was given: the plan,
this rank's leaves, the micro-batches, the inferred shapes, the messenger), one
mutable :class:`~.step_record.Progress` (what its actions change: the graphs kept
between F and B/W, the messages handed over on this rank, the loss, the buffers, the
report's counts), and the actions ``F``, ``B``, ``W`` as functions of both
(:mod:`.actions`, which says what each computes). This module is the driver: it
posts the receives, runs the actions, shares the loss and settles on an error.

Sends are non-blocking (:mod:`._p2p`) and all waited before the step returns.
Every receive of the step whose shapes are declared or inferred is posted when
the step starts: each transfer happens as soon as its sender posts it, while
this rank computes, and the receive is done when the action needs it (on gloo
only: :meth:`~._p2p.Messenger.prepost`). Posting them all at once, not one ahead
of its action, keeps the posts out of the actions: a post made while this
rank's last send is still moving waits for the connection (2-7 ms on gloo). The
receive buffers of the whole step therefore exist from its start; with a
:class:`~._buffers.MessageBuffers` pool (the pipeline model's) they are the
buffers kept from step to step anyway.

On any error (a stage raising, a declared shape not met, a peer's error header)
the rank settles its messages (error headers for what it owes, drains what it
expects) and re-raises, so every rank stops with an error.

Example:
    >>> loss, grads, report = run_step(step_plan, prepare, inputs, targets)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardfn.transforms.pipeline._p2p import (
    DeclaredValue,
    MessageBuffers,
    Messenger,
    declared_of_value,
)
from shardfn.transforms.pipeline.actions import action_text, run_action
from shardfn.transforms.pipeline.guard import FailureFlag, settle_and_raise
from shardfn.transforms.pipeline.kinds import LOSS_KEY, ActionKind
from shardfn.transforms.pipeline.messages import message_lists
from shardfn.transforms.pipeline.report import Event, StepReport
from shardfn.transforms.pipeline.schedules import Action
from shardfn.transforms.pipeline.step_plan import StepPlan, split_microbatches
from shardfn.transforms.pipeline.step_record import start_step
from shardfn.transforms.pipeline.ties import sum_tied

__all__ = ["Event", "StepPlan", "StepReport", "action_text", "run_step", "settle_and_raise",
           "split_microbatches"]


def run_step(plan: StepPlan, prepare: Callable[[], Mapping[str, torch.Tensor]],
             inputs: torch.Tensor, targets: Any,
             inferred: Mapping[tuple, DeclaredValue] | None = None, mutable: bool = False,
             pool: MessageBuffers | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], StepReport]:
    """Run this rank's actions of ``plan.schedule`` on one batch.

    Args:
        plan: the step plan.
        prepare: checks the call's arguments and returns this rank's leaves (trainable
            ones leaves requiring grad); run inside the error handling, so a bad
            argument on one rank stops the others too.
        inputs: the whole batch's inputs (split on dim 0; only stage 0 reads them).
        targets: the whole batch's targets (split alike; only the last stage reads them).
        inferred: the activation shapes a first step found (its ``report.shapes``, the
            same on both sides of every message): they are declared, so no payload waits
            for its header; a stage output that breaks them raises.
        mutable: thread this rank's buffers through its stages' forwards, micro-batch by
            micro-batch (``report.buffers``: their values after the step).
        pool: keep the activation and gradient message buffers for the next step
            (the pipeline model's); None: fresh buffers.

    Returns:
        ``(loss, grads, report)``: the loss over the whole batch (on every pp rank),
        this rank's trainable gradients summed over micro-batches (zeros for unused
        leaves) and the :class:`StepReport`.
    """
    messenger = Messenger(plan.ax, plan.tag_of, lambda key: plan.declared_of(key, inferred),
                          plan.device, pool)
    owed, expected = message_lists(plan.schedule, plan.rank)
    action: Action | None = None
    flag = FailureFlag(plan.ax)  # a failing rank posts it: the others stop early
    try:
        leaves = prepare()
        step, progress = start_step(plan, leaves, inputs, targets, messenger, inferred, mutable)
        for key, src in expected:  # all ahead of their actions (module docstring); one whose
            messenger.prepost(key, src)  # shapes are not known is received by its action
        for action in plan.schedule.actions[plan.rank]:
            if not _receives(action, plan):  # nothing would tell this rank a peer failed
                flag.raise_if_set()
            run_action(step, progress, action)
        holder = plan.schedule.rank_of(plan.n_stages - 1)
        if plan.rank == holder:
            for r in range(plan.schedule.n_ranks):
                if r != plan.rank:
                    messenger.send(LOSS_KEY, r, progress.loss)
        else:
            progress.loss = messenger.recv(LOSS_KEY, holder)
        progress.seen[LOSS_KEY] = declared_of_value(progress.loss)
        messenger.finish()
    except BaseException as error:  # every rank settles its messages, then raises
        if pool is not None:
            pool.clear()
        where = (f"pipeline step on pp rank {plan.rank}, during {action_text(action)} of "
                 f"schedule {plan.schedule.name!r}")
        settle_and_raise(messenger, owed, expected, error, where, flag)
    grads = {n: torch.zeros_like(leaves[n]) if leaves[n].grad is None else leaves[n].grad
             for st in plan.stages.on_rank(plan.rank) for n in st.trainable}
    grads = sum_tied(grads, plan.stages, plan.ax, plan.device)  # tied across stages (.ties)
    buffers = progress.buffers
    if pool is not None:  # nothing returned may be overwritten by the next step
        grads = pool.unalias(grads)
        buffers = None if buffers is None else pool.unalias(buffers)
    return progress.loss, grads, StepReport(tuple(progress.events), progress.peak_live,
                                            progress.peak_held, step.t0, messenger.header_first,
                                            progress.seen, buffers)


def _receives(action: Action, plan: StepPlan) -> bool:
    """Whether ``action`` starts with a receive from another rank (that tells it of a
    peer's failure): a forward after stage 0, a backward before the last stage."""
    kind, s, _ = action
    if kind == ActionKind.F:
        return s > 0 and plan.schedule.rank_of(s - 1) != plan.rank
    return kind == ActionKind.B and s < plan.n_stages - 1 and \
        plan.schedule.rank_of(s + 1) != plan.rank
