"""1F1B with a flush: PipeDream-Flush (PipeDream-2BW paper, §3.2), also DAPPLE's schedule.

Rank ``s`` of ``p`` runs ``p - s - 1`` warm-up forwards, then alternates one forward with one
backward, then drains the remaining backwards. At most ``p - s`` activations are stashed at once
(GPipe stashes ``m``), and the weights are updated once per step after the flush, so the update
is plain SGD semantics: W(t+1) = W(t) - lr * grad f(W(t)).
"""

from __future__ import annotations

from .actions import Op, PipelineSchedule
from .lowering import lower


def one_f_one_b(stages: int, microbatches: int) -> PipelineSchedule:
    compute = []
    for rank in range(stages):
        warmup = min(stages - rank - 1, microbatches)
        order = [(Op.FORWARD, rank, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            order.append((Op.FORWARD, rank, warmup + i))
            order.append((Op.BACKWARD, rank, i))
        order += [(Op.BACKWARD, rank, i) for i in range(microbatches - warmup, microbatches)]
        compute.append(order)
    return lower("1f1b", compute, tuple(range(stages)), microbatches)
