"""ZB-H1: 1F1B with its backward split in two (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3).

Each backward becomes BI, the gradient with respect to the stage's input (what the previous stage
waits for), and W, the weight gradients (which nothing waits for). Rank ``s`` of ``p`` runs 1F1B's
``p - s - 1`` warm-up forwards, then forward + BI pairs; its W runs ``s`` pairs late, so stage s
keeps at most ``p`` micro-batches' activations (1F1B's peak, on its first stage) and the W's fill
the time 1F1B's later stages spent waiting. With T_F = T_B = T_W the bubble is
(p - 1)(T_F + T_B - T_W), a third of 1F1B's (p - 1)(T_F + T_B + T_W). The deferred W's that are
left when the backwards are done close the step.
"""

from __future__ import annotations

from collections import deque

from .actions import Op, PipelineSchedule
from .lowering import lower


def zb_h1(stages: int, microbatches: int) -> PipelineSchedule:
    compute = [_rank_order(rank, stages, microbatches) for rank in range(stages)]
    return lower("zb-h1", compute, tuple(range(stages)), microbatches)


def _rank_order(rank: int, stages: int, microbatches: int) -> list[tuple[Op, int, int]]:
    warmup = min(stages - rank - 1, microbatches)
    order = [(Op.FORWARD, rank, i) for i in range(warmup)]
    deferred: deque[int] = deque()  # micro-batches whose W waits
    for i in range(microbatches):
        if i + warmup < microbatches:  # steady state: a forward before each BI; then the cool-down
            order.append((Op.FORWARD, rank, i + warmup))
        order.append((Op.BACKWARD_INPUT, rank, i))
        deferred.append(i)
        if len(deferred) > rank:  # stage s holds s W's back: at most p micro-batches in flight, 1F1B's peak
            order.append((Op.BACKWARD_WEIGHT, rank, deferred.popleft()))
    return order + [(Op.BACKWARD_WEIGHT, rank, i) for i in deferred]
