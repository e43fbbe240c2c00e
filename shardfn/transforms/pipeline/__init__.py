"""Pipeline parallelism: ``pipeline_stages`` (being written)."""

from shardfn.transforms.pipeline.schedules import Action, Schedule, make_schedule, stage_rank

__all__ = ["Action", "Schedule", "make_schedule", "stage_rank"]
