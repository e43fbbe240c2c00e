"""Pipeline parallelism: ``pipeline_stages`` (see docs/pipeline.md).

:mod:`.split` (``pipeline_split``: the stage models), :mod:`.api`
(``pipeline_stages``), :mod:`.pipeline_model` (``PipelineModel``) over :mod:`.runtime` (one
rank running its schedule), :mod:`.stage` (units -> stages), :mod:`.schedules`
(the schedules as data), :mod:`.simulate` (their validation and simulated
bubble), :mod:`.balance` (units per stage), :mod:`.timeline` (Chrome trace and
PNG of a step) and :mod:`._p2p` (messages between pp ranks).
"""

from shardfn.transforms.pipeline.api import PipelineModel, pipeline_stages
from shardfn.transforms.pipeline.balance import balance_units, partition
from shardfn.transforms.pipeline.hf_units import HFPipelineModel, hf_units, pack_inputs, pack_labels
from shardfn.transforms.pipeline.runtime import Event, StepReport
from shardfn.transforms.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    make_schedule,
    stage_rank,
    v_placement,
)
from shardfn.transforms.pipeline.shapes import DYNAMIC, ShapeCache
from shardfn.transforms.pipeline.simulate import (
    SimResult,
    simulate,
    theoretical_bubble,
    validate,
)
from shardfn.transforms.pipeline.split import PipelineSplit, pipeline_split
from shardfn.transforms.pipeline.stage import ModelUnits, model_units
from shardfn.transforms.pipeline.tied_model import TiedPipelineModel
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
from shardfn.transforms.pipeline.written import (
    schedule_from_actions,
    schedule_from_csv,
    schedule_to_csv,
)

__all__ = [
    "Action",
    "balance_units",
    "DYNAMIC",
    "Event",
    "from_actions",
    "from_simulation",
    "gather_events",
    "hf_units",
    "HFPipelineModel",
    "make_schedule",
    "measured_bubble",
    "model_units",
    "ModelUnits",
    "pack_inputs",
    "pack_labels",
    "partition",
    "pipeline_split",
    "pipeline_stages",
    "PipelineModel",
    "PipelineSplit",
    "plot",
    "Schedule",
    "schedule_from_actions",
    "schedule_from_csv",
    "schedule_to_csv",
    "SCHEDULES",
    "ShapeCache",
    "SimResult",
    "simulate",
    "stage_rank",
    "StepReport",
    "theoretical_bubble",
    "TiedPipelineModel",
    "Timeline",
    "TimelineEvent",
    "to_chrome_trace",
    "v_placement",
    "validate",
]
