"""Advance forward propagation (AvgPipe, Chen et al., PPoPP 2023, §4.2, Algorithm 1).

1F1B whose first stage runs ``advance_num`` forwards before its first backward instead of
``K - 1``: the extra forwards fill the first stage's bubble and reach the next stage before it
starves, so a message's transfer hides behind compute, as in all-forward-all-backward (AFAB), at
a fraction of AFAB's stashed activations. Algorithm 1 writes the first stage's order; downstream,
stage ``k`` keeps the same lead over 1F1B (``advance_num - k`` forwards in advance), so each stage
has its next forward's input before it asks for it — except the last stage, which keeps 1F1B's
order as in the paper's Fig. 7(c): it feeds no one, and holding its backwards back would only
delay every gradient upstream (measured: docs/results/benchmarks_advance.md). The ends:

- ``advance_num = K - 1`` is 1F1B, action for action;
- ``advance_num = M`` is AFAB (GPipe's order): every stage runs all its forwards first.

``advance_num = 0`` in the options means ``K - 1`` (1F1B): the count depends on the depth, which
the options do not know. How it is raised while training (Algorithm 1's lines 9-10) is
`lightning_pipe.modes.advance.engine.AdvanceRule`.
"""

from __future__ import annotations

from .actions import Op, PipelineSchedule
from .lowering import lower


def advance_bounds(stages: int, microbatches: int) -> tuple[int, int]:
    """The allowed ``advance_num``: K - 1 (1F1B) .. M (AFAB); only K - 1 when M <= K - 1 (the
    first stage's 1F1B warm-up already holds every micro-batch)."""
    return stages - 1, max(stages - 1, microbatches)


def warmups(stages: int, microbatches: int, advance_num: int) -> list[int]:
    """Forwards each stage runs before its first backward."""
    if advance_num >= microbatches and advance_num > stages - 1:  # AFAB
        return [microbatches] * stages
    leads = [min(microbatches, max(advance_num - k, 0)) for k in range(stages)]
    if stages > 1:
        leads[-1] = 0  # the last stage answers each forward at once (1F1B's order)
    return leads


def advance(stages: int, microbatches: int, advance_num: int = 0) -> PipelineSchedule:
    low, high = advance_bounds(stages, microbatches)
    a = advance_num or low
    if not low <= a <= high:
        raise ValueError(
            f"advance_num={advance_num} is outside [K - 1, M] = [{low}, {high}] for K={stages} stages and "
            f"M={microbatches} micro-batches ({low}: 1F1B, {high}: all forwards first)"
        )
    compute = []
    for rank, warmup in enumerate(warmups(stages, microbatches, a)):
        order = [(Op.FORWARD, rank, i) for i in range(warmup)]
        for i in range(microbatches - warmup):  # Algorithm 1's interleaved part: a forward, a backward
            order.append((Op.FORWARD, rank, warmup + i))
            order.append((Op.BACKWARD, rank, i))
        order += [(Op.BACKWARD, rank, i) for i in range(microbatches - warmup, microbatches)]
        compute.append(order)
    return lower("advance", compute, tuple(range(stages)), microbatches)


def peak_stash(stages: int, microbatches: int, advance_num: int) -> list[int]:
    """Micro-batches whose activations each stage holds at its peak (1F1B: K - k; AFAB: M; the last
    stage 1 below AFAB)."""
    return [w if w >= microbatches else w + 1 for w in warmups(stages, microbatches, advance_num or stages - 1)]
