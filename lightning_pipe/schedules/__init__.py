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


def chunk_count(name: str, stages: int, **options: int) -> int:
    """How many model chunks a schedule cuts the model into, without building it (for checks that
    must run before any process starts): p, v·p (interleaved) or 2·p·W (wave)."""
    key = name.lower()
    if key == "interleaved":
        return stages * options.get("chunks", 2)
    if key == "wave":
        return 2 * stages * options.get("waves", 1)
    return stages


def check_chunks(name: str, stages: int, num_blocks: int, **options: int) -> None:
    """Every model chunk needs a block: say which setting to lower when there are too few."""
    pieces = chunk_count(name, stages, **options)
    if pieces <= num_blocks:
        return
    key = name.lower()
    if key == "wave":
        most = num_blocks // (2 * stages)
        hint = f"waves <= {most}" if most else f"at most {num_blocks // 2} ranks or another schedule"
        raise ValueError(f"schedule='wave' with waves={options.get('waves', 1)} on {stages} ranks cuts the model into 2 x {stages} x "
                         f"{options.get('waves', 1)} = {pieces} chunks, more than its {num_blocks} blocks: use {hint}")
    if key == "interleaved":
        most = num_blocks // stages
        hint = f"chunks <= {most}" if most else "fewer ranks"
        raise ValueError(f"schedule='interleaved' with chunks={options.get('chunks', 2)} on {stages} ranks cuts the model into "
                         f"{pieces} chunks, more than its {num_blocks} blocks: use {hint}")
    raise ValueError(f"{stages} pipeline stages for a pipeline of {num_blocks} blocks: every stage needs at least one block, "
                     f"so use at most {num_blocks} stages (processes / width)")


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
    "check_chunks",
    "chunk_count",
    "forward_only",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "validate",
    "wave",
    "wave_placement",
]
