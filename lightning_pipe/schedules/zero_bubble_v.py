"""ZB-V: two model chunks per rank in a V, with split backwards (Qi et al., ICLR 2024, §6).

Chunk c of 2p lives on rank c going down and on rank 2p - 1 - c coming back, so rank r holds
chunks r and 2p - 1 - r, and rank 0 holds the first and the last: the loss's backward starts where
the forward ended, with no message. The order is the paper's (its Figure 7), per rank r:

1. warm-up: 2(p - r) - 1 forwards of the down chunk; r pairs (forward of the up chunk, of the
   down chunk); p - r triples of the up chunk (forward, BI, W);
2. steady state: (F, BI, W) of the down chunk, then of the up chunk, until every forward is done;
3. cool-down: r pairs of BI (down, up); p - r pairs (BI down, W down); then the W's left.

It keeps about 1F1B's peak activation memory (2p chunk-halves) and, with T_F = T_B = T_W, has no
bubble once m >= 2p - 1. The order is written for at least 2p - 1 micro-batches; with fewer, the
actions of the missing ones are left out (the order stays valid: tests check every m).
"""

from __future__ import annotations

from .actions import Op, PipelineSchedule
from .lowering import lower


def zb_v(stages: int, microbatches: int) -> PipelineSchedule:
    compute = [[(op, c, i) for op, c, i in _rank_order(rank, stages, microbatches) if i < microbatches] for rank in range(stages)]
    return lower("zb-v", compute, v_placement(stages), microbatches)


def _rank_order(rank: int, p: int, m: int) -> list[tuple[Op, int, int]]:
    """Rank `rank`'s order for max(m, 2p - 1) micro-batches (the caller drops those beyond m)."""
    n = max(m, 2 * p - 1)
    down, up = rank, 2 * p - 1 - rank
    count = {(op, c): 0 for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) for c in (down, up)}
    order: list[tuple[Op, int, int]] = []

    def run(*steps: tuple[Op, int]) -> None:
        for op, chunk in steps:
            order.append((op, chunk, count[(op, chunk)]))
            count[(op, chunk)] += 1

    f, bi, w = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    run(*[(f, down)] * (2 * (p - rank) - 1))
    run(*[(f, up), (f, down)] * rank)
    run(*[(f, up), (bi, up), (w, up)] * (p - rank))
    while count[(f, down)] < n or count[(f, up)] < count[(f, down)]:
        if count[(f, down)] < n:
            run((f, down))
        run((bi, down), (w, down), (f, up), (bi, up), (w, up))
    run(*[(bi, down), (bi, up)] * rank)
    run(*[(bi, down), (w, down)] * (p - rank))
    for chunk in (up, down):  # the W's left: first the up chunk's, then the down chunk's
        run(*[(w, chunk)] * (count[(bi, chunk)] - count[(w, chunk)]))
    return order


def v_placement(stages: int) -> tuple[int, ...]:
    """Rank of each of the 2p chunks: down the ranks, then back up."""
    return tuple(range(stages)) + tuple(reversed(range(stages)))


def zb_v_chunks(stages: int) -> int:
    return 2 * stages


def zb_v_misfit(stages: int, num_blocks: int) -> str:
    return (
        f"schedule='zb-v' on {stages} ranks cuts the model into {2 * stages} chunks (two per rank), more than its"
        f" {num_blocks} blocks: use at most {num_blocks // 2} ranks or split the model into more blocks"
    )
