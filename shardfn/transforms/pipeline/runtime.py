"""The pipeline runtime: one rank runs its schedule's actions in order.

* ``F`` (stage ``s``, micro-batch ``i``): the input is micro-batch ``i`` of the
  inputs on stage 0, else the activation received from stage ``s - 1``'s rank
  (handed over locally when that is this rank). The stage runs with autograd,
  its graph is kept, and the output is sent on to stage ``s + 1``. The last
  stage computes ``loss_fn(out, targets_i) * n_i / batch`` (so the sum over
  micro-batches is the mean over the whole batch).
* ``B``: the output gradient is received from stage ``s + 1`` (or the backward
  starts from the scaled loss); ``torch.autograd.backward`` gives the input
  gradient, sent to stage ``s - 1``, and sums the parameter gradients into the
  stage leaves' ``.grad`` (autograd's accumulation, in place after the first
  micro-batch). The graph is then freed. With ``split_backward`` ``B`` keeps the
  graph and computes only the input gradient; ``W`` computes the parameter
  gradients later (:mod:`._weight_grad`) and frees it.

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
    >>> loss, grads, report = run_step(step_plan, leaves, inputs, targets)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

import shardfn.memory as mem
import shardfn.transforms.pipeline._weight_grad as wg
from shardfn.primitives._comm import Axis
from shardfn.transforms.pipeline._p2p import (
    NONE,
    OK,
    DeclaredValue,
    MessageBuffers,
    Messenger,
    declared_of_value,
)
from shardfn.transforms.pipeline.guard import FailureFlag, settle_and_raise
from shardfn.transforms.pipeline.messages import message_lists, release_points
from shardfn.transforms.pipeline.report import Event, StepReport
from shardfn.transforms.pipeline.schedules import Action, Schedule, stage_rank
from shardfn.transforms.pipeline.stage import StagePlan
from shardfn.transforms.pipeline.values import (
    check_value,
    describe,
    detach,
    grad_declared,
    grad_flags,
    grad_leaves,
    grad_roots,
    input_grads,
    needing_grad,
)

__all__ = ["Event", "StepPlan", "StepReport", "StepState", "action_text", "describe", "run_step",
           "settle_and_raise", "split_microbatches"]

_KINDS = ("act", "grad", "loss", "out")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything a step needs besides the values: made once by ``pipeline_stages``.

    Attributes:
        stages: the :class:`~.stage.StagePlan`.
        schedule: the schedule (``n_microbatches`` is the step's micro-batch count).
        ax: the resolved pp axis.
        loss_fn: ``loss_fn(out, targets) -> scalar mean``.
        forwards: per stage, ``fn(params, x)`` (the stage, possibly under remat).
        declared: per stage boundary ``s`` (output of stage ``s``), its declared
            per-micro-batch shape and dtype (a tuple of them for a tuple output), or None
            (exchanged in headers, or inferred: see ``inferred`` of :func:`run_step`).
        plain: per stage, whether ``forwards[s]`` is the plain unit chain (no remat, no
            ``stage_transform``), whose autograd graph split backward can analyse.
        device: where messages are allocated (the mesh's device).
        mutable_forwards: per stage, ``fn(params, x) -> (out, new_buffers)`` (for
            ``mutable=True`` steps; empty: not supported).
    """

    stages: StagePlan
    schedule: Schedule
    ax: Axis
    loss_fn: Callable[[Any, Any], torch.Tensor]
    forwards: tuple[Callable[[Mapping[str, torch.Tensor], Any], Any], ...]
    declared: tuple[DeclaredValue, ...] | None
    plain: tuple[bool, ...] = ()
    device: torch.device = torch.device("cpu")
    mutable_forwards: tuple[Callable[[Mapping[str, torch.Tensor], Any], Any], ...] = ()

    @property
    def rank(self) -> int:
        return self.ax.index

    @property
    def n_stages(self) -> int:
        return len(self.stages.stages)

    def tag_of(self, key: tuple) -> int:
        kind, stage, microbatch = key
        m = self.schedule.n_microbatches
        return (_KINDS.index(kind) * self.n_stages + stage) * m + microbatch

    @functools.cached_property
    def releases(self) -> dict[tuple, tuple[tuple, ...]]:
        """``(key, src)`` received -> this rank's sends that are surely complete by then.

        The peer sent ``key`` after receiving those (its schedule says so), so
        waiting for them then does not block: the send buffers are freed early,
        not at the step's end (on gloo a send is not done until waited).
        """
        return release_points(self.schedule, self.rank)

    def declared_of(self, key: tuple, inferred: Mapping[tuple, DeclaredValue] | None = None
                    ) -> DeclaredValue | None:
        """What message ``key`` declares: from ``shapes=``, else from ``inferred`` (the
        activations' shapes a first step found, by ``("act", stage, microbatch)``)."""
        kind, stage, microbatch = key
        if kind not in ("act", "grad"):  # the loss, apply's outputs: inferred only
            return (inferred or {}).get(key)
        boundary = stage if kind == "act" else stage - 1  # grad of stage s's input
        found = self.declared[boundary] if self.declared is not None else \
            (inferred or {}).get(("act", boundary, microbatch))
        # the gradient of an integer activation (entry) has no payload
        return found if kind == "act" or found is None else grad_declared(found)


def split_microbatches(x: Any, m: int) -> list[Any]:
    """``m`` pieces of ``x`` on dim 0 (``torch.tensor_split``: sizes differ by at most one)."""
    if x is None:
        return [None] * m
    return list(torch.tensor_split(x, m, dim=0))


class _Kept(NamedTuple):
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


class StepState:
    """One rank's state during one step (:func:`run_step`, and ``inference.run_forward``)."""

    def __init__(self, plan: StepPlan, leaves: Mapping[str, torch.Tensor], inputs, targets,
                 messenger: Messenger, inferred: Mapping[tuple, DeclaredValue] | None = None,
                 mutable: bool = False):
        self.plan = plan
        #: with ``mutable``: this rank's buffers as the forwards so far left them
        self.buffers = None if not mutable else {
            n: leaves[n] for st in plan.stages.on_rank(plan.rank) for n in st.names
            if n not in st.trainable and n in plan.stages.full.buffer_names}
        self.next_forward = {st.index: 0 for st in plan.stages.on_rank(plan.rank)}
        self.inferred = inferred  # the shapes a first step found (see run_step)
        self.seen: dict[tuple, DeclaredValue] = {}  # the activations this step sent / received
        self.leaves = leaves
        m = plan.schedule.n_microbatches
        self.inputs = split_microbatches(inputs, m)
        self.targets = split_microbatches(targets, m)
        self.batch = inputs.shape[0]
        self.messenger = messenger
        self.local: dict[tuple, Any] = {}
        self.flags: dict[tuple, tuple[bool, ...]] = {}  # per activation: which need grad
        self.kept: dict[tuple[int, int], _Kept] = {}
        self.loss: torch.Tensor | None = None
        self.peak_live: dict[int, int] = {st.index: 0 for st in plan.stages.on_rank(plan.rank)}
        self.peak_held = 0
        self.events: list[Event] = []
        self.wait = 0.0
        self.t0 = time.perf_counter()

    # -- messages -------------------------------------------------------------------------
    def give(self, kind: str, stage: int, microbatch: int, tensor: torch.Tensor | None) -> None:
        dst = stage_rank(stage + 1 if kind == "act" else stage - 1, self.plan.schedule.n_ranks)
        key = (kind, stage, microbatch)
        if dst == self.plan.rank:
            self.local[key] = detach(tensor)
            self.flags[key] = grad_flags(tensor)
        else:
            if kind == "act":
                self.seen[key] = declared_of_value(tensor)
            self.messenger.send(key, dst, tensor, OK if tensor is not None else NONE)

    def take(self, kind: str, stage: int, microbatch: int) -> torch.Tensor | None:
        src = stage_rank(stage, self.plan.schedule.n_ranks)
        key = (kind, stage, microbatch)
        if src == self.plan.rank:
            return self.local.pop(key)
        start = time.perf_counter()
        try:
            value = self.messenger.recv(key, src)
        finally:
            self.wait += time.perf_counter() - start
        for sent in self.plan.releases.get((key, src), ()):
            self.messenger.wait_sent(*sent)
        if kind == "act" and value is not None:
            self.seen[key] = declared_of_value(value)
            self.flags[key] = self.messenger.grad_flags.pop(key, None)
        return value

    # -- actions --------------------------------------------------------------------------
    def forward(self, s: int, i: int) -> None:
        with mem.category(f"pipeline.stage{s}"):  # what the kept graph holds, input included
            self._forward(s, i)

    def _forward(self, s: int, i: int) -> None:
        plan = self.plan
        x = self.inputs[i] if s == 0 else grad_leaves(self.take("act", s - 1, i),
                                                      self.flags.pop(("act", s - 1, i), None))
        with torch.enable_grad():
            if self.buffers is not None:
                out = self._forward_mutable(s, i, x)
            else:  # split backward analyses the graph in B
                out = plan.forwards[s](self.leaves, x)
            if s == plan.n_stages - 1:
                loss = plan.loss_fn(out, self.targets[i])
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(f"pipeline loss_fn must return a scalar tensor (the mean "
                                     f"over the micro-batch), got {describe(loss)} for "
                                     f"micro-batch {i}")
                out = loss * (self.inputs[i].shape[0] / self.batch)
                self.loss = out.detach() if self.loss is None else self.loss + out.detach()
        if s < plan.n_stages - 1:
            self.check_output(s, i, out)
            self.give("act", s, i, out)
        self.kept[(s, i)] = _Kept(x, out, None, None)
        live = sum(1 for (stage, _) in self.kept if stage == s)
        self.peak_live[s] = max(self.peak_live[s], live)
        self.peak_held = max(self.peak_held, len(self.kept))

    def _forward_mutable(self, s: int, i: int, x: Any) -> Any:
        """The stage's forward with its current buffers, which it then updates: micro-batch
        ``i`` sees the buffers micro-batches ``0 .. i-1`` left, as one process running the
        micro-batches in order would."""
        if i != self.next_forward[s]:
            raise RuntimeError(f"pipeline mutable step: schedule {self.plan.schedule.name!r} "
                               f"runs stage {s}'s forward of micro-batch {i} before micro-batch "
                               f"{self.next_forward[s]}; buffers need them in order")
        self.next_forward[s] = i + 1
        out, new = self.plan.mutable_forwards[s]({**self.leaves, **self.buffers}, x)
        self.buffers.update({n: t.detach() for n, t in new.items() if n in self.buffers})
        return out

    def check_output(self, s: int, i: int, out: Any) -> None:
        """Refuse a stage output that cannot cross a boundary, or that breaks the declared
        (or inferred) shapes (:func:`~.values.check_value`)."""
        if self.plan.declared is not None:
            declared = self.plan.declared[s]
        else:
            declared = None if self.inferred is None else self.inferred.get(("act", s, i))
        check_value(out, declared, f"pipeline stage {s} output for micro-batch {i}",
                    self.plan.rank, inferred=self.plan.declared is None)

    def backward(self, s: int, i: int, weights: bool) -> None:
        """``B``: the input gradient, sent on. With ``weights`` also the parameter gradients
        (the graph is then freed); else (split backward) only the input gradient, with the
        gradients at the intermediates recorded for ``W`` (:mod:`._weight_grad`). Without
        an input gradient to compute (stage 0) ``B`` only keeps the output gradients and
        ``W`` runs the whole backward. When the graph does not split (a remat or
        transformed stage, an output not depending on the input), ``B`` runs the full
        backward and ``W`` is empty: one backward is never slower than two halves."""
        kept = self.kept.pop((s, i))
        last = s == self.plan.n_stages - 1
        grad_out = None if last else self.take("grad", s + 1, i)
        if last or grad_out is not None:
            outs, grads_out = grad_roots(kept.out, grad_out)
            grads_out = [None] * len(outs) if grads_out is None else grads_out
        else:
            outs, grads_out = [], []
        xs = needing_grad(kept.x) if s > 0 else []
        names = self.plan.stages.stages[s].trainable
        params = [self.leaves[n] for n in names]
        split = captured = None
        if not weights and outs and not xs:  # nothing waits for this B: W does it all
            self.kept[(s, i)] = _Kept(None, outs, None, grads_out)
            if s > 0:
                self.give("grad", s, i, input_grads(kept.x, []))
            return
        if not weights and outs and self.plan.plain and self.plan.plain[s]:
            split = wg.plan_split(outs, xs, params)
        found: Sequence[torch.Tensor | None] = [None] * len(xs)
        with mem.category(f"pipeline.stage{s}.backward"):
            if split is not None:
                found, captured = wg.backward_input(split, outs, grads_out, xs)
            elif outs and (xs or params):  # parameter gradients summed into their .grad
                torch.autograd.backward(outs, grad_tensors=grads_out, inputs=xs + params)
                found = [_take_grad(x) for x in xs]
        if s > 0:
            self.give("grad", s, i, input_grads(kept.x, found[:len(xs)]))
        if not weights:  # out stays referenced until W (see _Kept)
            self.kept[(s, i)] = _Kept(None, kept.out if split else None, split, captured)

    def weight_grads(self, s: int, i: int) -> None:
        """``W``: the parameter gradients from the gradients ``B`` recorded at the
        intermediates; only the parameter branches of the graph run, and it is freed."""
        kept = self.kept.pop((s, i))
        names = self.plan.stages.stages[s].trainable
        if kept.out is None or not names:
            return  # B ran the full backward (or there is nothing to differentiate)
        params = [self.leaves[n] for n in names]
        with mem.category(f"pipeline.stage{s}.backward"):
            if kept.split is None:  # B had no input gradient to compute: the whole backward
                torch.autograd.backward(kept.out, grad_tensors=kept.captured, inputs=params)
            else:
                wg.backward_weights(kept.split, kept.captured, params)

    def run(self, action: Action) -> None:
        start, self.wait = time.perf_counter(), 0.0
        kind, s, i = action
        if kind == "F":
            self.forward(s, i)
        elif kind == "B":
            self.backward(s, i, weights=not self.plan.schedule.split_backward)
        elif kind == "W":
            self.weight_grads(s, i)
        else:
            raise ValueError(f"pipeline schedule {self.plan.schedule.name!r}: unknown action "
                             f"kind {kind!r} in {action}")
        self.events.append(Event(kind, s, i, start - self.t0, time.perf_counter() - self.t0,
                                 self.wait))


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
        step = StepState(plan, leaves, inputs, targets, messenger, inferred, mutable)
        for key, src in expected:  # all ahead of their actions (module docstring); one whose
            messenger.prepost(key, src)  # shapes are not known is received by its action
        for action in plan.schedule.actions[plan.rank]:
            if not _receives(action, plan):  # nothing would tell this rank a peer failed
                flag.raise_if_set()
            step.run(action)
        holder = stage_rank(plan.n_stages - 1, plan.schedule.n_ranks)
        if plan.rank == holder:
            for r in range(plan.schedule.n_ranks):
                if r != plan.rank:
                    step.messenger.send(("loss", 0, 0), r, step.loss)
        else:
            step.loss = step.messenger.recv(("loss", 0, 0), holder)
        step.seen[("loss", 0, 0)] = declared_of_value(step.loss)
        step.messenger.finish()
    except BaseException as error:  # every rank settles its messages, then raises
        if pool is not None:
            pool.clear()
        where = (f"pipeline step on pp rank {plan.rank}, during {action_text(action)} of "
                 f"schedule {plan.schedule.name!r}")
        settle_and_raise(messenger, owed, expected, error, where, flag)
    grads = {n: torch.zeros_like(leaves[n]) if leaves[n].grad is None else leaves[n].grad
             for st in plan.stages.on_rank(plan.rank) for n in st.trainable}
    buffers = step.buffers
    if pool is not None:  # nothing returned may be overwritten by the next step
        grads = pool.unalias(grads)
        buffers = None if buffers is None else pool.unalias(buffers)
    return step.loss, grads, StepReport(tuple(step.events), step.peak_live, step.peak_held,
                                        step.t0, messenger.header_first, step.seen, buffers)


def _receives(action: Action, plan: StepPlan) -> bool:
    """Whether ``action`` starts with a receive from another rank (that tells it of a
    peer's failure): a forward after stage 0, a backward before the last stage."""
    kind, s, _ = action
    if kind == "F":
        return s > 0 and stage_rank(s - 1, plan.schedule.n_ranks) != plan.rank
    return kind == "B" and s < plan.n_stages - 1 and \
        stage_rank(s + 1, plan.schedule.n_ranks) != plan.rank


def _take_grad(x: torch.Tensor) -> torch.Tensor | None:
    """The gradient autograd summed into stage input ``x``'s ``.grad``, taken off it."""
    grad, x.grad = x.grad, None
    return grad


def action_text(action: Action | None) -> str:
    if action is None:
        return "the start"
    names = {"F": "forward", "B": "backward", "W": "weight gradient"}
    return f"{names.get(action.kind, action.kind)} of stage {action.stage}, micro-batch " \
           f"{action.microbatch}"
