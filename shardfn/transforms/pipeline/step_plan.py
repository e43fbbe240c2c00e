"""What a pipeline step needs besides the values: the :class:`StepPlan`, made once.

``pipeline_stages`` builds one plan per model (:func:`~.forwards.step_plan`); every
step and every inference call of that model runs over it. The plan also names each
message of a step with a tag (:meth:`StepPlan.tag_of`) and says what shapes it
declares (:meth:`StepPlan.declared_of`). How a batch is cut into micro-batches
(``split_microbatches``, kept importable from here) is :mod:`.batch`'s.

Example:
    >>> plan.tag_of((MessageKind.ACT, 0, 1))          # an int, the same on both ranks
    >>> split_microbatches(torch.arange(5), 2)
    [tensor([0, 1, 2]), tensor([3, 4])]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardfn.primitives._comm import Axis
from shardfn.transforms.pipeline._p2p import DeclaredValue
from shardfn.transforms.pipeline.batch import split_microbatches
from shardfn.transforms.pipeline.kinds import MessageKey, MessageKind
from shardfn.transforms.pipeline.messages import release_points
from shardfn.transforms.pipeline.schedules import Schedule
from shardfn.transforms.pipeline.stage import StagePlan
from shardfn.transforms.pipeline.values import grad_declared

__all__ = ["StepPlan", "split_microbatches"]

_KINDS = (MessageKind.ACT, MessageKind.GRAD, MessageKind.LOSS, MessageKind.OUT)  # tag order


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
            (exchanged in headers, or inferred: see ``inferred`` of ``run_step``).
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

    def tag_of(self, key: MessageKey) -> int:
        kind, stage, microbatch = key
        m = self.schedule.n_microbatches
        return (_KINDS.index(kind) * self.n_stages + stage) * m + microbatch

    #: ``(key, src)`` received -> this rank's sends that are surely complete by then. The
    #: peer sent ``key`` after receiving those (its schedule says so), so waiting for them
    #: then does not block: the send buffers are freed early, not at the step's end (on
    #: gloo a send is not done until waited). Derived from the schedule when the plan is
    #: made (a value of the plan, not a cache filled while it runs).
    releases: Mapping[tuple[MessageKey, int], tuple[tuple[MessageKey, int], ...]] = \
        dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "releases", release_points(self.schedule, self.ax.index))

    def declared_of(self, key: MessageKey,
                    inferred: Mapping[MessageKey, DeclaredValue] | None = None
                    ) -> DeclaredValue | None:
        """What message ``key`` declares: from ``shapes=``, else from ``inferred`` (the
        activations' shapes a first step found, by ``("act", stage, microbatch)``)."""
        kind, stage, microbatch = key
        if kind not in (MessageKind.ACT, MessageKind.GRAD):  # the loss, outputs: inferred only
            return (inferred or {}).get(key)
        boundary = stage if kind == MessageKind.ACT else stage - 1  # grad of stage s's input
        found = self.declared[boundary] if self.declared is not None else \
            (inferred or {}).get((MessageKind.ACT, boundary, microbatch))
        # the gradient of an integer activation (entry) has no payload
        return found if kind == MessageKind.ACT or found is None else grad_declared(found)
