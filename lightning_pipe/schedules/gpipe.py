"""GPipe: all forwards, then all backwards, then a flush (Huang et al., 2019)."""

from __future__ import annotations

from typing import Optional

from .actions import Op, PipelineSchedule
from .lowering import lower


def gpipe(stages: int, microbatches: int) -> PipelineSchedule:
    compute = []
    for rank in range(stages):
        order = [(Op.FORWARD, rank, i) for i in range(microbatches)]
        order += [(Op.BACKWARD, rank, i) for i in range(microbatches)]
        compute.append(order)
    return lower("gpipe", compute, tuple(range(stages)), microbatches)


def forward_only(stages: int, microbatches: int, chunk_rank: Optional[tuple[int, ...]] = None) -> PipelineSchedule:
    """Evaluation (validate / test / predict): forwards only, nothing stashed for backward. With a
    multi-chunk placement each rank runs its chunks in pipeline order (always deadlock-free)."""
    placement = tuple(range(stages)) if chunk_rank is None else tuple(chunk_rank)
    compute = [
        [(Op.FORWARD, c, i) for c in range(len(placement)) if placement[c] == rank for i in range(microbatches)] for rank in range(stages)
    ]
    return lower("forward", compute, placement, microbatches, backward=False)
