"""AutoPipe's Algorithm 2 as the paper writes it, and the schedule it slices (paper §III-C).

`algorithm2` follows the pseudo-code line by line (the line numbers in the comments are the
paper's). Inputs: per stage the forward time f_i and backward time b_i of one whole micro-batch,
and one communication cost `Comm` (a whole micro-batch's message; a half's costs Comm / 2).

- lines 5-15: ``startt[k]``, the times the pipeline's backward wave of micro-batch 0 reaches each
  stage once micro-batch 0 is sliced (the first half fills the pipeline: f_i / 2 + Comm / 2 per
  stage, then the backward b_i + Comm per stage from the last one back);
- lines 16-28: for the mb-th sliced micro-batch (mb = 1, 2, ...), the end times ``endt[i][j]`` of
  its halves j = 0, 1 on the stages i = 0 .. p - mb that run it in their warm-up, from the values
  of the previous sliced micro-batch (the arrays are reused): after the stage's previous half
  (line 19), after its input on the previous stage (line 21), plus the half message (line 24), and
  not before the next stage has finished its previous half, where a blocked send would wait
  (line 26);
- lines 29-36: the latest time stage 0 can start the first unsliced micro-batch, ``startt[mb - 1]``
  minus the forwards in front of it; once that is no later than the end of the last half on stage
  0, slicing one more would not help: return mb. Otherwise slice the next micro-batch (line 37).

Two readings are ours, where the published pseudo-code cannot be run literally:
- line 21 reads ``max(endt[i][j], endt[i-1][j] + f_{i-1}/2)`` in the paper; we run it as printed;
- the loop has no bound: mb cannot exceed the stages (``startt`` has p entries) nor the
  micro-batches, so it stops at ``min(p, m)``; with one stage there is nothing to slice (0).

`paper_schedule` (`schedules/sliced.py`) is the 1F1B schedule the paper slices: the halves back to
back where their micro-batch ran, and the blocked half's message merged into its twin's. It is what
``slicer=True`` runs on real processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..runtime.microbatch import sliced_sizes
from ..schedules.sliced import merge_stages, paper_schedule  # noqa: F401  (the schedule the count runs)
from ..simulation import CostModel, Timeline, chunk_costs, simulate


@dataclass(frozen=True)
class Algorithm2Run:
    """What Algorithm 2 computed: the count, and its arrays (for tests and the docs)."""

    sliced: int
    startt: tuple[float, ...]
    # per iteration mb = 1, 2, ...: (mb, endt after lines 17-28 (p + 1 rows of [half 0, half 1]), tempt of line 33)
    steps: tuple[tuple[int, tuple[tuple[float, float], ...], float], ...]


def algorithm2(forward: Sequence[float], backward: Sequence[float], comm: float, microbatches: int) -> Algorithm2Run:
    """The paper's Algorithm 2 on stage times `forward` / `backward` and one `comm` cost."""
    f, b = list(forward), list(backward)
    p = len(f)
    if p != len(b) or p == 0:
        raise ValueError(f"forward ({p}) and backward ({len(b)}) need one time per stage")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches}: must be >= 1")
    if p == 1:
        return Algorithm2Run(0, (), ())
    limit = min(p, microbatches)
    startt = [0.0] * p  # lines 3-4
    endt = [[0.0, 0.0] for _ in range(p + 1)]
    tempt, mb = 0.0, 1  # line 5
    for i in range(0, p - 1):  # lines 6-8
        tempt = tempt + f[i] / 2 + comm / 2
    tempt = tempt + f[p - 1] / 2  # line 9
    for i in range(p - 1, 0, -1):  # lines 10-13
        tempt = tempt + b[i] + comm
        startt[p - 1 - i] = tempt
    tempt = tempt + b[0]  # line 14
    startt[p - 1] = tempt  # line 15
    steps = []
    while True:  # line 16
        for i in range(0, p - mb + 1):  # line 17
            for j in (0, 1):  # line 18
                endt[i][j] = endt[i][(j + 1) % 2] + f[i] / 2  # line 19
                if i > 0:  # lines 20-22 (as printed: f_{i-1})
                    endt[i][j] = max(endt[i][j], endt[i - 1][j] + f[i - 1] / 2)
                if i != p - 1:  # lines 23-25
                    endt[i][j] = endt[i][j] + comm / 2
                endt[i][j] = max(endt[i][j], endt[i + 1][(j + 1) % 2])  # line 26
        tempt = startt[mb - 1]  # line 29
        for i in range(p - 1 - mb, 0, -1):  # lines 30-32
            tempt = tempt - f[i] - comm
        tempt = tempt - f[0]  # line 33
        steps.append((mb, tuple((x, y) for x, y in endt), tempt))
        if tempt <= endt[0][1]:  # lines 34-36
            break
        if mb >= limit:  # ours: the pseudo-code has no bound
            break
        mb = mb + 1  # line 37
    return Algorithm2Run(mb, tuple(startt), tuple(steps))


def stage_times(costs: CostModel, bounds: Sequence[tuple[int, int]]) -> tuple[list[float], list[float], float]:
    """Algorithm 2's inputs from a cost model: f_i, b_i per stage and one Comm (the costliest cut's
    message: the paper uses one figure for every boundary)."""
    f, b, comm = chunk_costs(costs, bounds)
    return f, b, max(comm[:-1], default=0.0)


def simulate_paper(
    costs: CostModel, bounds: Sequence[tuple[int, int]], microbatches: int, sliced: int, merge: bool = True, critical_path: bool = False
) -> Timeline:
    sizes = sliced_sizes([2] * microbatches, sliced)
    timeline = simulate(
        paper_schedule(len(bounds), microbatches, sliced, merge), costs, bounds, critical_path=critical_path, scale=[s / 2 for s in sizes]
    )
    if sliced:  # the pictures name the user's micro-batches: halves "0a", "0b", ..., then the whole ones
        timeline.microbatch_labels = [f"{i}{half}" for i in range(sliced) for half in "ab"] + [str(i) for i in range(sliced, microbatches)]
    return timeline
