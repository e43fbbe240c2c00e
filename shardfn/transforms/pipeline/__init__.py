"""Pipeline parallelism: ``pipeline_stages`` (see docs/pipeline.md).

:mod:`.api` (``pipeline_stages``, ``PipelineModel``) over :mod:`.runtime` (one
rank running its schedule), :mod:`.stage` (units -> stages), :mod:`.schedules`
(the schedules as data) and :mod:`._p2p` (messages between pp ranks).
"""

from shardfn.transforms.pipeline.api import PipelineModel, pipeline_stages
from shardfn.transforms.pipeline.runtime import Event, StepReport
from shardfn.transforms.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    make_schedule,
    stage_rank,
)

__all__ = ["SCHEDULES", "Action", "Event", "PipelineModel", "Schedule", "StepReport",
           "make_schedule", "pipeline_stages", "stage_rank"]
