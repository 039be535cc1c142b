"""Schedules: pure functions ``(stages, microbatches) -> PipelineSchedule``, chosen by name."""

from __future__ import annotations

from typing import Callable

from .actions import Action, Op, PipelineSchedule
from .gpipe import forward_only, gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .validate import ScheduleError, validate
from .wave import wave, wave_placement

SCHEDULES: dict[str, Callable[..., PipelineSchedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,  # option: chunks (v)
    "wave": wave,  # option: waves (W)
}
OPTIONS = {"interleaved": ("chunks",), "wave": ("waves",)}


def get_schedule(name: str) -> Callable[..., PipelineSchedule]:
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a known schedule; allowed values: {sorted(SCHEDULES)}")
    return SCHEDULES[key]


def build_schedule(name: str, stages: int, microbatches: int, **options: int) -> PipelineSchedule:
    """Build and validate: an inconsistent schedule is an error here, never a hang at run time.
    `options`: chunks=v for "interleaved", waves=W for "wave"."""
    allowed = OPTIONS.get(name.lower(), ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"schedule={name!r} takes no option {unknown}; its options: {list(allowed) or 'none'}")
    schedule = get_schedule(name)(stages, microbatches, **options)
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
    "interleaved_1f1b",
    "one_f_one_b",
    "validate",
    "wave",
    "wave_placement",
]
