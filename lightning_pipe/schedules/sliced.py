"""AutoPipe's sliced 1F1B (paper §III-C): the schedule Algorithm 2's count runs, with the merged send.

1F1B over the m *whole* micro-batches; the first `sliced` run as their two halves back to back
(forward and backward), so a half is not one more warm-up micro-batch; and the paper's merge: on
stage ``s = p - 1 - q``, where sliced micro-batch q is the warm-up's last forward (where the paper's
example blocks: micro-batch 1 at stage 2 of 4), the first half's send is cancelled and issued
together with the second half's, after the second half's forward. Consecutive sends of a rank go
out as one p2p group in the runtime, so the two halves travel as one aggregated exchange. The halves
are micro-batches of their own in the action lists (index 2q and 2q + 1, then the whole ones), the
order `runtime.microbatch.split_microbatches(..., sliced=k)` cuts a batch in, so training is exact.
(The count, Algorithm 2 itself, lives in `planning/slicer_algorithm2.py`.)
"""

from __future__ import annotations

from .actions import Action, Op, PipelineSchedule
from .lowering import lower
from .validate import validate


def merge_stages(stages: int, sliced: int) -> dict[int, int]:
    """{stage: sliced micro-batch q} where the paper merges q's half messages: stage p - 1 - q, for
    q >= 1 (micro-batch 0's merge stage would be the last, which sends nothing)."""
    return {stages - 1 - q: q for q in range(1, sliced) if stages - 1 - q >= 0 and stages - 1 - q < stages - 1}


def paper_schedule(stages: int, microbatches: int, sliced: int, merge: bool = True) -> PipelineSchedule:
    """1F1B over the whole micro-batches, the first `sliced` run as two halves back to back, and
    (with `merge`) the first half's message merged into the second's where the paper merges it."""
    if not 0 <= sliced <= microbatches:
        raise ValueError(f"sliced={sliced}: must be between 0 and microbatches={microbatches}")

    def parts(q: int) -> list[int]:  # indices of micro-batch q in the sliced list
        return [2 * q, 2 * q + 1] if q < sliced else [q + sliced]

    compute = []
    for rank in range(stages):
        warmup = min(stages - rank - 1, microbatches)
        order = [(Op.FORWARD, q) for q in range(warmup)]
        for i in range(microbatches - warmup):
            order += [(Op.FORWARD, warmup + i), (Op.BACKWARD, i)]
        order += [(Op.BACKWARD, q) for q in range(microbatches - warmup, microbatches)]
        compute.append([(op, rank, part) for op, q in order for part in parts(q)])
    base = lower("1f1b-algorithm2", compute, tuple(range(stages)), microbatches + sliced)
    if not merge:
        return base
    lists = [list(actions) for actions in base.actions]
    for rank, q in merge_stages(stages, sliced).items():
        actions = lists[rank]
        first = Action(Op.SEND_ACT, rank, 2 * q, rank + 1)
        actions.remove(first)
        actions.insert(actions.index(Action(Op.SEND_ACT, rank, 2 * q + 1, rank + 1)), first)
    schedule = PipelineSchedule("1f1b-algorithm2", base.num_microbatches, base.chunk_rank, lists, base.backward)
    validate(schedule)
    return schedule
