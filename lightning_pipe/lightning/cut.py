"""What cutting the module made: this rank's stage and the run's layout, the data `RankContext.cut` holds.

Data only, below `cutting` (which makes it) and `context` (which carries it to the helpers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn

from ..runtime.tied import TiedParameter, TieGroup
from ..schedules import ScheduleSpec
from .stage import PipelineStage

Bounds = tuple[tuple[int, int], ...]


@dataclass
class Cut:
    path: str  # where the pipeline sits in the module
    pipeline: Optional[nn.Sequential]  # the full pipeline, kept on global rank 0 to hand the trained model back
    stage: PipelineStage
    spec: ScheduleSpec  # the schedule it was cut for (schedule="auto": the one chosen)
    bounds: Bounds  # block range of every model chunk
    placement: tuple[int, ...]  # the rank holding each chunk
    sliced: int = 0  # warm-up micro-batches the slicer cuts in halves
    plan: Optional[Any] = None  # the Plan (planner partitions)
    choice: Optional[Any] = None  # schedule="auto": every candidate and the chosen one
    tied: list[TiedParameter] = field(default_factory=list)
    # for live switches (adaptive): meta-device copies of the blocks this rank does not hold, and
    # which blocks share a weight, by name
    skeletons: dict[int, nn.Module] = field(default_factory=dict)
    ties: list[TieGroup] = field(default_factory=list)
    switched: bool = False  # the partition changed while training (checkpoints keep it on resume)
    built_empty: bool = False  # the model was created on the meta device: no rank holds all of it
    costed: Optional[Callable[[int], Any]] = None  # zb-auto: micro-batches -> its schedule, built from the run's costs

    @property
    def chunk_blocks(self) -> dict[int, list[int]]:
        """This rank's chunks -> their block indices."""
        return {c: list(range(*self.bounds[c])) for c in self.stage.chunk_bounds}

    @property
    def loss_stage(self) -> int:
        """The rank holding the last chunk computes the loss (the last stage, or rank 0 in a wave)."""
        return self.placement[-1]
