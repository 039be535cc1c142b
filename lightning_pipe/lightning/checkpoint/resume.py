"""Reading ahead what a resumed run's checkpoint holds, before Lightning loads it (after setup).

A run resumed at its checkpoint's depth cuts and schedules exactly as the checkpoint's run did
rather than by a new (noisy) plan; planner=2bw keeps its chosen shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from ...schedules import ScheduleSpec
from .keys import decode_run
from .sharded import is_sharded, read_meta


@dataclass(frozen=True)
class ResumedLayout:
    """How the checkpoint's run cut and scheduled the model."""

    bounds: Optional[tuple[tuple[int, int], ...]]  # None: the checkpoint holds none
    sliced: int
    schedule: Optional[ScheduleSpec]


def resumed_state(checkpoint_io: Any, path: Optional[str]) -> dict[str, Any]:
    """The run's state (keys.RUN, by short name) in the checkpoint at `path` ({} if none can be read ahead)."""
    if path is None:
        return {}
    if is_sharded(path):
        checkpoint = read_meta(path)
    elif os.path.isfile(path):
        checkpoint = checkpoint_io.load_checkpoint(path)
    else:
        return {}
    return decode_run((checkpoint.get("optimizer_states") or [{}])[0])


def resumed_layout(state: dict[str, Any], depth: int, listed_partition: bool) -> Optional[ResumedLayout]:
    """The layout of a resumed run's checkpoint (`state`: `resumed_state`'s), to cut and schedule as
    its run did. None when the run plans its own: another depth, or a listed partition (the
    optimizer states follow the parameters' names anywhere)."""
    if state.get("depth") != depth:
        return None
    if listed_partition and not state.get("switched"):
        return None  # a listed partition wins, unless the checkpoint's run had switched away from it
    bounds, chosen = state.get("bounds"), state.get("schedule")
    spec = ScheduleSpec.of(chosen[0], **dict(chosen[1])) if chosen is not None else None
    bounds = tuple(tuple(b) for b in bounds) if bounds is not None else None
    return ResumedLayout(bounds, int(state.get("sliced", 0)), spec)
