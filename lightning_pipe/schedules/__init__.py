"""Schedules: pure functions ``(stages, microbatches) -> PipelineSchedule``, chosen by name."""

from __future__ import annotations

from typing import Callable

from .actions import Action, Op, PipelineSchedule
from .gpipe import forward_only, gpipe
from .one_f_one_b import one_f_one_b
from .validate import ScheduleError, validate

SCHEDULES: dict[str, Callable[[int, int], PipelineSchedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def get_schedule(name: str) -> Callable[[int, int], PipelineSchedule]:
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a known schedule; allowed values: {sorted(SCHEDULES)}")
    return SCHEDULES[key]


def build_schedule(name: str, stages: int, microbatches: int) -> PipelineSchedule:
    """Build and validate: an inconsistent schedule is an error here, never a hang at run time."""
    schedule = get_schedule(name)(stages, microbatches)
    validate(schedule)
    return schedule


__all__ = [
    "Action",
    "Op",
    "PipelineSchedule",
    "SCHEDULES",
    "ScheduleError",
    "build_schedule",
    "forward_only",
    "get_schedule",
    "gpipe",
    "one_f_one_b",
    "validate",
]
