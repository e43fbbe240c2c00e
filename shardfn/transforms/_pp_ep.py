"""PP x EP: expert parallelism inside the stages of ``pipeline_stages``.

On a ``{"pp": p, "ep": e}`` mesh each pipeline replica (an index of ``"ep"``) pipelines its
own batch, as DeepSpeed-MoE and Megatron make the expert-parallel ranks a subset of the
data-parallel ones; the MoE layers of a stage send their tokens to the stage's ranks on the
other replicas (the all-to-alls of :class:`~shardfn.models.moe_dispatch.AllToAllExperts`,
inside each forward and backward action, every replica running the same schedule).

* :func:`expert_stage` is the ``stage_transform``: ``sf.expert_parallel`` of a stage
  holding MoE layers (its gradients come back as the mean over ``"ep"`` of every replica's
  loss: experts summed over the replicas' tokens, the rest psummed, each counting
  ``1/e``), the stage itself otherwise.
* ``pipeline_stages(..., dp_axis="ep")`` averages the loss over the replicas and the plain
  stages' gradients; :func:`reduced_axes` tells it not to average an expert-parallel
  stage's again (the experts of different replicas are different experts), and
  :func:`check_expert_stages` refuses an expert-parallel stage without ``dp_axis`` set to
  its axis (the plain stages' reduction would be missing), naming the stage.

The MoE auxiliary loss is a value like any other: a unit returns ``(hidden, aux)`` and the
next takes the tuple (the pipeline's tuple outputs), and the last stage's ``loss_fn`` adds
the running sum. Each micro-batch routes and balances its own tokens, so the step equals
one process applying the model to each replica's micro-batches (docs/moe.md, "Under a
pipeline").

Example:
    >>> pp = sf.pipeline_stages(units, sf.Mesh({"pp": 2, "ep": 2}), "pp", balance=[2, 3],
    ...                         schedule="1f1b", microbatches=4, loss_fn=loss_fn,
    ...                         dp_axis="ep", stage_transform=expert_stage)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.models.moe import MoE
from shardfn.transforms._experts_hf import is_hf_experts
from shardfn.transforms._fsdp_ep import FsdpEpModel
from shardfn.transforms.experts import ExpertParallelModel, expert_parallel

__all__ = ["check_expert_stages", "expert_stage", "expert_stage_of", "reduced_axes"]


def _holds_experts(stage: FunctionalModel) -> bool:
    """Whether the stage's module holds a ``MoE`` layer or a Hugging Face MoE block."""
    return any(isinstance(sub, MoE) or is_hf_experts(sub) for sub in stage.module.modules())


def expert_stage(stage: FunctionalModel, stage_mesh: Mesh, axis: str = "ep") -> Any:
    """``stage_transform`` of PP x EP: the stage's experts split over ``axis``.

    Args:
        stage: one stage of ``sf.pipeline_split`` (a ``FunctionalModel``).
        stage_mesh: this rank's slice of the mesh without the pp axis (``pipeline_stages``
            passes it); ``axis`` must be one of its axes.
        axis: the expert-parallel axis (also the pipeline's ``dp_axis``).

    Returns:
        ``sf.expert_parallel(stage, stage_mesh, axis)`` when the stage holds MoE layers,
        else ``stage`` itself (a plain stage, replicated over ``axis``).

    Example:
        >>> pp = sf.pipeline_stages(units, mesh, "pp", balance=[2, 3], microbatches=4,
        ...                         loss_fn=loss_fn, dp_axis="ep", stage_transform=expert_stage)
    """
    if not isinstance(stage, FunctionalModel):
        raise TypeError(f"expert_stage takes a stage of sf.pipeline_split (a FunctionalModel), "
                        f"got {type(stage).__name__}")
    if axis not in stage_mesh.axis_names:
        raise ValueError(f"expert_stage: axis {axis!r} is not an axis of the stage mesh "
                         f"{dict(zip(stage_mesh.axis_names, stage_mesh.shape, strict=True))}")
    return expert_parallel(stage, stage_mesh, axis) if _holds_experts(stage) else stage


def expert_stage_of(model: Any) -> ExpertParallelModel | FsdpEpModel | None:
    """The expert-parallel model of a stage model (under ``remat``/precision wrappers), or
    None."""
    for _ in range(8):
        if isinstance(model, (ExpertParallelModel, FsdpEpModel)):
            return model
        model = getattr(model, "inner", None)
        if model is None:
            return None
    return None


def reduced_axes(model: Any) -> tuple[str, ...]:
    """The mesh axes an expert-parallel stage model reduces its gradients over: its ep axis
    (``()`` for any other kind of stage model)."""
    found = expert_stage_of(model)
    return (found.axis,) if isinstance(found, ExpertParallelModel) else ()


def check_expert_stages(models: Mapping[int, Any], dp_axis: str | None) -> None:
    """Refuse expert-parallel stage models a pipeline cannot reduce right.

    Args:
        models: stage index -> stage model (the transformed stages, every rank's).
        dp_axis: the pipeline's ``dp_axis``.

    Raises:
        ValueError: an ``ExpertParallelModel`` stage over ``ep`` with ``dp_axis != ep`` (the
            replicas' losses and the plain stages' gradients would not be averaged); an
            ``FsdpEpModel`` stage (FSDP x EP per stage: not yet).
    """
    for index, model in sorted(models.items()):
        found = expert_stage_of(model)
        if isinstance(found, FsdpEpModel):
            raise ValueError(f"pipeline_stages: stage {index} is shard_params over an "
                             "expert_parallel model (FSDP x EP): not supported under a "
                             "pipeline yet; use expert_parallel stages (stage_transform="
                             "expert_stage) with dp_axis set to the ep axis")
        if found is not None and dp_axis != found.axis:
            raise ValueError(f"pipeline_stages: stage {index} is expert_parallel over "
                             f"{found.axis!r}, whose ranks are data ranks (each pipelines its "
                             f"own batch), but dp_axis={dp_axis!r}: pass dp_axis="
                             f"{found.axis!r} so the loss and the other stages' gradients "
                             f"are averaged over {found.axis!r} (the expert stages' are "
                             "already)")
