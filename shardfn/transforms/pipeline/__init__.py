"""Pipeline parallelism: ``pipeline_stages`` (see docs/pipeline.md).

:mod:`.api` (``pipeline_stages``, ``PipelineModel``) over :mod:`.runtime` (one
rank running its schedule), :mod:`.stage` (units -> stages), :mod:`.schedules`
(the schedules as data), :mod:`.simulate` (their validation and simulated
bubble), :mod:`.balance` (units per stage), :mod:`.timeline` (Chrome trace and
PNG of a step) and :mod:`._p2p` (messages between pp ranks).
"""

from shardfn.transforms.pipeline.api import PipelineModel, pipeline_stages
from shardfn.transforms.pipeline.balance import balance_units, partition
from shardfn.transforms.pipeline.runtime import Event, StepReport
from shardfn.transforms.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    make_schedule,
    stage_rank,
)
from shardfn.transforms.pipeline.shapes import DYNAMIC, ShapeCache
from shardfn.transforms.pipeline.simulate import (
    SimResult,
    simulate,
    theoretical_bubble,
    validate,
)
from shardfn.transforms.pipeline.timeline import (
    Timeline,
    TimelineEvent,
    from_actions,
    from_simulation,
    gather_events,
    measured_bubble,
    plot,
    to_chrome_trace,
)

__all__ = ["DYNAMIC", "SCHEDULES", "Action", "Event", "PipelineModel", "Schedule", "ShapeCache",
           "SimResult", "StepReport", "Timeline", "TimelineEvent", "balance_units",
           "from_actions", "from_simulation", "gather_events", "make_schedule",
           "measured_bubble", "partition", "pipeline_stages", "plot", "simulate", "stage_rank",
           "theoretical_bubble", "to_chrome_trace", "validate"]
