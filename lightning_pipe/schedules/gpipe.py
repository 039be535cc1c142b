"""GPipe: all forwards, then all backwards, then a flush (Huang et al., 2019)."""

from __future__ import annotations

from .actions import Op, PipelineSchedule
from .lowering import lower


def gpipe(stages: int, microbatches: int) -> PipelineSchedule:
    compute = []
    for rank in range(stages):
        order = [(Op.FORWARD, rank, i) for i in range(microbatches)]
        order += [(Op.BACKWARD, rank, i) for i in range(microbatches)]
        compute.append(order)
    return lower("gpipe", compute, tuple(range(stages)), microbatches)


def forward_only(stages: int, microbatches: int) -> PipelineSchedule:
    """Evaluation (validate / test / predict): forwards only, nothing stashed for backward."""
    compute = [[(Op.FORWARD, rank, i) for i in range(microbatches)] for rank in range(stages)]
    return lower("forward", compute, tuple(range(stages)), microbatches, backward=False)
