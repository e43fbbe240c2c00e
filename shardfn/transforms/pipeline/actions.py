"""The actions of a pipeline step, as functions of ``(step, progress)``.

* ``F`` (stage ``s``, micro-batch ``i``, :func:`forward`): the input is micro-batch
  ``i`` of the inputs on stage 0, else the activation received from stage ``s - 1``'s
  rank (handed over locally when that is this rank). The stage runs with autograd,
  its graph is kept, and the output is sent on to stage ``s + 1``. The last stage
  computes ``loss_fn(out, targets_i) * n_i / batch`` (so the sum over micro-batches
  is the mean over the whole batch).
* ``B`` (:func:`backward`): the output gradient is received from stage ``s + 1`` (or
  the backward starts from the scaled loss); ``torch.autograd.backward`` gives the
  input gradient, sent to stage ``s - 1``, and sums the parameter gradients into the
  stage leaves' ``.grad`` (autograd's accumulation, in place after the first
  micro-batch). The graph is then freed. With ``split_backward`` ``B`` keeps the
  graph and computes only the input gradient; ``W`` (:func:`weight_grads`) computes
  the parameter gradients later (:mod:`._weight_grad`) and frees it.

``step`` is the step's :class:`~.step_record.StepInputs` (read only), ``progress`` its
:class:`~.step_record.Progress` (what the actions change). Messages between stages go
through :func:`give` and :func:`take`: to the messenger, or handed over in
``progress.local`` when both stages are on this rank.

Example:
    >>> step, progress = start_step(plan, leaves, inputs, targets, messenger)
    >>> for action in plan.schedule.actions[plan.rank]:
    ...     run_action(step, progress, action)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

import shardfn.memory as mem
import shardfn.transforms.pipeline._weight_grad as wg
from shardfn.transforms.pipeline._p2p import NONE, OK, declared_of_value
from shardfn.transforms.pipeline.batch import microbatch_rows
from shardfn.transforms.pipeline.kinds import ActionKind, MessageKind
from shardfn.transforms.pipeline.report import Event
from shardfn.transforms.pipeline.schedules import Action
from shardfn.transforms.pipeline.step_record import Kept, Progress, StepInputs
from shardfn.transforms.pipeline.values import (
    check_value,
    describe,
    detach,
    grad_flags,
    grad_leaves,
    grad_roots,
    input_grads,
    needing_grad,
)

__all__ = ["action_text", "backward", "check_output", "forward", "give", "run_action", "take",
           "weight_grads"]

Flags = tuple[bool, ...] | None  # per tensor of an activation: whether it needs grad


# -- messages -----------------------------------------------------------------------------
def give(step: StepInputs, progress: Progress, kind: MessageKind, stage: int, microbatch: int,
         value: Any) -> None:
    """Send stage ``stage``'s output (``ACT``) or input gradient (``GRAD``) of ``microbatch``
    to the stage it is for: its rank's messenger, or ``progress.local`` on this rank."""
    plan = step.plan
    dst = plan.schedule.rank_of(stage + 1 if kind == MessageKind.ACT else stage - 1)
    key = (kind, stage, microbatch)
    if dst == plan.rank:
        progress.local[key] = (detach(value), grad_flags(value))
    else:
        if kind == MessageKind.ACT:
            progress.seen[key] = declared_of_value(value)
        step.messenger.send(key, dst, value, OK if value is not None else NONE)


def take(step: StepInputs, progress: Progress, kind: MessageKind, stage: int,
         microbatch: int) -> tuple[Any, Flags]:
    """The value of message ``(kind, stage, microbatch)`` and, for an activation, which of
    its tensors need grad (None: not known, or not an activation). The time it waited
    to receive is added to ``progress.wait``."""
    plan = step.plan
    src = plan.schedule.rank_of(stage)
    key = (kind, stage, microbatch)
    if src == plan.rank:
        return progress.local.pop(key)
    start = time.perf_counter()
    try:
        value = step.messenger.recv(key, src)
    finally:
        progress.wait += time.perf_counter() - start
    for sent in plan.releases.get((key, src), ()):
        step.messenger.wait_sent(*sent)
    flags = None
    if kind == MessageKind.ACT and value is not None:
        progress.seen[key] = declared_of_value(value)
        flags = step.messenger.grad_flags.pop(key, None)
    return value, flags


def check_output(step: StepInputs, s: int, i: int, out: Any) -> None:
    """Refuse a stage output that cannot cross a boundary, or that breaks the declared
    (or inferred) shapes (:func:`~.values.check_value`)."""
    plan = step.plan
    if plan.declared is not None:
        declared = plan.declared[s]
    else:
        declared = None if step.inferred is None else \
            step.inferred.get((MessageKind.ACT, s, i))
    check_value(out, declared, f"pipeline stage {s} output for micro-batch {i}", plan.rank,
                inferred=plan.declared is None)


# -- actions ------------------------------------------------------------------------------
def forward(step: StepInputs, progress: Progress, s: int, i: int) -> None:
    """``F``: stage ``s`` on micro-batch ``i`` with autograd; the graph is kept, the output
    sent on (or, on the last stage, the scaled loss added to ``progress.loss``)."""
    with mem.category(f"pipeline.stage{s}"):  # what the kept graph holds, input included
        _forward(step, progress, s, i)


def _forward(step: StepInputs, progress: Progress, s: int, i: int) -> None:
    plan = step.plan
    x = step.inputs[i] if s == 0 else grad_leaves(*take(step, progress, MessageKind.ACT, s - 1, i))
    with torch.enable_grad():
        if step.mutable:
            out = _forward_mutable(step, progress, s, i, x)
        else:  # split backward analyses the graph in B
            out = plan.forwards[s](step.leaves, x)
        if s == plan.n_stages - 1:
            loss = plan.loss_fn(out, step.targets[i])
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"pipeline loss_fn must return a scalar tensor (the mean "
                                 f"over the micro-batch), got {describe(loss)} for "
                                 f"micro-batch {i}")
            rows = microbatch_rows(step.batch, plan.schedule.n_microbatches, i)
            out = loss * (rows / step.batch)
            progress.loss = out.detach() if progress.loss is None else \
                progress.loss + out.detach()
    if s < plan.n_stages - 1:
        check_output(step, s, i, out)
        give(step, progress, MessageKind.ACT, s, i, out)
    kept = progress.kept
    kept[(s, i)] = Kept(x, out, None, None)
    live = sum(1 for (stage, _) in kept if stage == s)
    progress.peak_live[s] = max(progress.peak_live[s], live)
    progress.peak_held = max(progress.peak_held, len(kept))


def _forward_mutable(step: StepInputs, progress: Progress, s: int, i: int, x: Any) -> Any:
    """The stage's forward with its current buffers, which it then updates: micro-batch
    ``i`` sees the buffers micro-batches ``0 .. i-1`` left, as one process running the
    micro-batches in order would."""
    if i != progress.next_forward[s]:
        raise RuntimeError(f"pipeline mutable step: schedule {step.plan.schedule.name!r} "
                           f"runs stage {s}'s forward of micro-batch {i} before micro-batch "
                           f"{progress.next_forward[s]}; buffers need them in order")
    progress.next_forward[s] = i + 1
    buffers = progress.buffers
    out, new = step.plan.mutable_forwards[s]({**step.leaves, **buffers}, x)
    buffers.update({n: t.detach() for n, t in new.items() if n in buffers})
    return out


def backward(step: StepInputs, progress: Progress, s: int, i: int, weights: bool) -> None:
    """``B``: the input gradient, sent on. With ``weights`` also the parameter gradients
    (the graph is then freed); else (split backward) only the input gradient, with the
    gradients at the intermediates recorded for ``W`` (:mod:`._weight_grad`). Without
    an input gradient to compute (stage 0) ``B`` only keeps the output gradients and
    ``W`` runs the whole backward. When the graph does not split (a remat or
    transformed stage, an output not depending on the input), ``B`` runs the full
    backward and ``W`` is empty: one backward is never slower than two halves."""
    plan = step.plan
    kept = progress.kept.pop((s, i))
    last = s == plan.n_stages - 1
    grad_out = None if last else take(step, progress, MessageKind.GRAD, s + 1, i)[0]
    if last or grad_out is not None:
        outs, grads_out = grad_roots(kept.out, grad_out)
        grads_out = [None] * len(outs) if grads_out is None else grads_out
    else:
        outs, grads_out = [], []
    xs = needing_grad(kept.x) if s > 0 else []
    params = [step.leaves[n] for n in plan.stages.stages[s].trainable]
    split = captured = None
    if not weights and outs and not xs:  # nothing waits for this B: W does it all
        progress.kept[(s, i)] = Kept(None, outs, None, grads_out)
        if s > 0:
            give(step, progress, MessageKind.GRAD, s, i, input_grads(kept.x, []))
        return
    if not weights and outs and plan.plain and plan.plain[s]:
        split = wg.plan_split(outs, xs, params)
    found: Sequence[torch.Tensor | None] = [None] * len(xs)
    with mem.category(f"pipeline.stage{s}.backward"):
        if split is not None:
            found, captured = wg.backward_input(split, outs, grads_out, xs)
        elif outs and (xs or params):  # parameter gradients summed into their .grad
            torch.autograd.backward(outs, grad_tensors=grads_out, inputs=xs + params)
            found = [_take_grad(x) for x in xs]
    if s > 0:
        give(step, progress, MessageKind.GRAD, s, i, input_grads(kept.x, found[:len(xs)]))
    if not weights:  # out stays referenced until W (see Kept)
        progress.kept[(s, i)] = Kept(None, kept.out if split else None, split, captured)


def weight_grads(step: StepInputs, progress: Progress, s: int, i: int) -> None:
    """``W``: the parameter gradients from the gradients ``B`` recorded at the
    intermediates; only the parameter branches of the graph run, and it is freed."""
    kept = progress.kept.pop((s, i))
    names = step.plan.stages.stages[s].trainable
    if kept.out is None or not names:
        return  # B ran the full backward (or there is nothing to differentiate)
    params = [step.leaves[n] for n in names]
    with mem.category(f"pipeline.stage{s}.backward"):
        if kept.split is None:  # B had no input gradient to compute: the whole backward
            torch.autograd.backward(kept.out, grad_tensors=kept.captured, inputs=params)
        else:
            wg.backward_weights(kept.split, kept.captured, params)


def run_action(step: StepInputs, progress: Progress, action: Action) -> None:
    """Run one action of the schedule and record its :class:`~.report.Event`.

    Raises:
        ValueError: an action kind that is not ``F``, ``B`` or ``W``.
    """
    start = time.perf_counter()
    progress.wait = 0.0
    kind, s, i = action
    if kind == ActionKind.F:
        forward(step, progress, s, i)
    elif kind == ActionKind.B:
        backward(step, progress, s, i, weights=not step.plan.schedule.split_backward)
    elif kind == ActionKind.W:
        weight_grads(step, progress, s, i)
    else:
        raise ValueError(f"pipeline schedule {step.plan.schedule.name!r}: unknown action "
                         f"kind {kind!r} in {action}")
    progress.events.append(Event(kind, s, i, start - step.t0, time.perf_counter() - step.t0,
                                 progress.wait))


def _take_grad(x: torch.Tensor) -> torch.Tensor | None:
    """The gradient autograd summed into stage input ``x``'s ``.grad``, taken off it."""
    grad, x.grad = x.grad, None
    return grad


def action_text(action: Action | None) -> str:
    """How an error names ``action`` ("forward of stage 1, micro-batch 0"; None: the start)."""
    if action is None:
        return "the start"
    names = {ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.W: "weight gradient"}
    return f"{names.get(action.kind, action.kind)} of stage {action.stage}, micro-batch " \
           f"{action.microbatch}"
