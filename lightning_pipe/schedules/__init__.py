"""Schedules: pure functions ``(stages, microbatches) -> PipelineSchedule``, chosen by name.

`spec.REGISTRY` lists them with their options; `ScheduleSpec` is a checked (name, options).
The functions below are the same operations by name, for code that holds a name and options.
"""

from __future__ import annotations

from typing import Callable

from .actions import Action, Op, PipelineSchedule
from .gpipe import forward_only, gpipe
from .interleaved import interleaved_1f1b
from .one_f_one_b import one_f_one_b
from .spec import AUTO, REGISTRY, ScheduleKind, ScheduleSpec, schedule_kind
from .text import dump, load
from .validate import ScheduleError, validate
from .wave import wave, wave_placement

SCHEDULES: dict[str, Callable[..., PipelineSchedule]] = {name: kind.generator for name, kind in REGISTRY.items()}
OPTIONS: dict[str, tuple[str, ...]] = {name: tuple(kind.options) for name, kind in REGISTRY.items() if kind.options}


def get_schedule(name: str) -> Callable[..., PipelineSchedule]:
    return schedule_kind(name).generator


def chunk_count(name: str, stages: int, **options: int) -> int:
    """How many model chunks a schedule cuts the model into, without building it."""
    return ScheduleSpec.of(name, **options).chunk_count(stages)


def check_chunks(name: str, stages: int, num_blocks: int, **options: int) -> None:
    """Every model chunk needs a block: say which setting to lower when there are too few."""
    ScheduleSpec.of(name, **options).check(stages, num_blocks)


def build_schedule(name: str, stages: int, microbatches: int, **options: int) -> PipelineSchedule:
    """Build and validate. `options`: chunks=v for "interleaved", waves=W for "wave"."""
    return ScheduleSpec.of(name, **options).build(stages, microbatches)


__all__ = [
    "AUTO",
    "Action",
    "Op",
    "OPTIONS",
    "PipelineSchedule",
    "REGISTRY",
    "SCHEDULES",
    "ScheduleError",
    "ScheduleKind",
    "ScheduleSpec",
    "build_schedule",
    "check_chunks",
    "dump",
    "load",
    "chunk_count",
    "forward_only",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule_kind",
    "validate",
    "wave",
    "wave_placement",
]
