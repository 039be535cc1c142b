"""The zero-bubble paper's automatic scheduling (Qi et al., ICLR 2024, §3.1), on our costs: `schedule="zb-auto"`.

The paper's heuristic (`schedules/zero_bubble_auto.py`: the orders from each stage's F, BI and W
times, the message time and a memory limit) is run for every combination of its two binary
hyperparameters, as the paper does; here our simulator scores each candidate (`simulate` on the
same costs) and the fastest wins. The paper's further ILP refinement is not done. One chunk per
stage.

Ours, not the paper's: `handcrafted=True` adds ZB-H1 to the candidates when it fits the limit
(without ILP the heuristic alone is slower than ZB-H1 on some uneven profiles:
tests/test_zero_bubble_auto.py, docs/guide/schedules.md); and a run with no `memory_limit` holds the
heuristic to 1F1B's activation memory (`max_held` = p micro-batches per stage, ZB-H1's budget)
rather than letting it hold every micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Optional, Sequence

from ..schedules.actions import PipelineSchedule
from ..schedules.lowering import lower
from ..schedules.validate import validate
from ..schedules.zero_bubble import zb_h1
from ..schedules.zero_bubble_auto import heuristic_orders
from ..simulation import CostModel, Timeline, chunk_costs, simulate, split_costs


def stage_limit(costs: CostModel, bounds: Sequence[tuple[int, int]], memory_limit: Optional[float], weight_copies: float) -> int:
    """Micro-batches every stage may hold within `memory_limit` bytes (None: no limit; at least 1)."""
    if memory_limit is None:
        return 1 << 30
    held = math.inf
    for a, b in bounds:
        weights = weight_copies * sum(costs.param_bytes[a:b]) if costs.param_bytes else 0.0
        activation = sum(costs.activation_bytes[a:b]) if costs.activation_bytes else 0.0
        room = memory_limit - weights - costs.runtime_bytes  # the process's own memory first
        if room < activation or room < 0:
            raise ValueError(
                f"memory_limit={memory_limit:.4g} bytes does not hold stage {a}..{b - 1}'s weights and one micro-batch"
                + (f" besides the process's runtime ({costs.runtime_bytes:.4g} bytes)" if costs.runtime_bytes else "")
            )
        held = min(held, room // activation if activation else 1 << 30)
    return int(held)


def zero_bubble_auto(
    costs: CostModel,
    bounds: Sequence[tuple[int, int]],
    microbatches: int,
    memory_limit: Optional[float] = None,
    weight_copies: float = 4.0,
    handcrafted: bool = False,
    max_held: Optional[int] = None,
) -> tuple[PipelineSchedule, Timeline]:
    """The heuristic's schedule for this partition (one chunk per stage), the fastest of its
    hyperparameter combinations as our simulator predicts it, and that prediction. `memory_limit`
    in bytes per rank (weights x `weight_copies` + held activations, as `schedule="auto"` counts);
    `max_held`: at most this many micro-batches' activations per stage besides."""
    limit = min(stage_limit(costs, bounds, memory_limit, weight_copies), max_held or 1 << 30)
    f, _, comm = chunk_costs(costs, bounds)
    bi, w = split_costs(costs, bounds)
    message = max(comm[:-1], default=0.0)
    candidates = [
        lower("zb-auto", heuristic_orders(f, bi, w, message, microbatches, limit, fill, skip), tuple(range(len(bounds))), microbatches)
        for fill, skip in product((True, False), repeat=2)
    ]
    if handcrafted and min(len(bounds), microbatches) <= limit:  # ZB-H1 holds min(p, m) micro-batches per stage
        candidates.append(zb_h1(len(bounds), microbatches))
    best: Optional[tuple[PipelineSchedule, Timeline]] = None
    for schedule in candidates:
        validate(schedule)
        timeline = simulate(schedule, costs, bounds, critical_path=False)
        if best is None or timeline.iteration_time < best[1].iteration_time - 1e-12:
            best = schedule, timeline
    assert best is not None
    return best


@dataclass(frozen=True)
class CostedSchedule:
    """`schedule="zb-auto"` in a run: the heuristic's schedule for any micro-batch count (a short last
    batch builds its own) on the costs and partition the run was planned with. Every rank builds from
    the same (global rank 0's) costs, so every rank runs the same schedule."""

    costs: CostModel
    bounds: tuple[tuple[int, int], ...]
    memory_limit: Optional[float] = None
    weight_copies: float = 4.0

    def build(self, microbatches: int) -> tuple[PipelineSchedule, Timeline]:
        held = None if self.memory_limit is not None else len(self.bounds)  # no limit set: 1F1B's activations
        return zero_bubble_auto(self.costs, self.bounds, microbatches, self.memory_limit, self.weight_copies, max_held=held)

    def __call__(self, microbatches: int) -> PipelineSchedule:
        return self.build(microbatches)[0]
