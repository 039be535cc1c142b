"""New partitions to consider (AutoPipe-RL §4.2) and how they are scored.

A candidate differs from the current partition in one boundary only: the one between two
neighbouring workers (chunks c and c + 1 on different ranks), moved anywhere that leaves both at
least one block: O(L) per neighbour pair, O(L^2) at most, and a switch between two workers only
(§4.4). The scorer predicts a candidate's iteration time; part 1 uses the simulator on the current
measured costs (`SimulatorScorer`); part 2 plugs in a learned predictor with the same call.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence

from ..simulation import CostModel, simulate
from .monitor import IterationMetrics, StaticMetrics

Bounds = tuple[tuple[int, int], ...]


def neighbour_candidates(bounds: Bounds, chunk_rank: Sequence[int]) -> list[Bounds]:
    out = []
    for c in range(len(bounds) - 1):
        if chunk_rank[c] == chunk_rank[c + 1]:  # a wave's turn: both chunks on one rank, nothing to move
            continue
        (lo, x), (_, hi) = bounds[c], bounds[c + 1]
        for y in range(lo + 1, hi):
            if y != x:
                out.append((*bounds[:c], (lo, y), (y, hi), *bounds[c + 2 :]))
    return out


class Scorer(Protocol):
    def __call__(self, window: Sequence[IterationMetrics], schedule: Any, bounds: Bounds) -> float:
        """Predicted seconds of one iteration of `schedule` on `bounds`, given the recent metrics."""
        ...


@dataclass
class SimulatorScorer:
    """The simulator on the profile's per-block costs, each rank slowed by its measured factor
    (median over the window) and links at the slowest link's measured bandwidth (median; `costs`'
    own when nothing was measured)."""

    static: StaticMetrics
    costs: CostModel  # the profile's, with the configured link model and cores

    def current(self, window: Sequence[IterationMetrics]) -> CostModel:
        slow = [m.slowdown(self.static) for m in window]
        slowdown = tuple(statistics.median(s[r] for s in slow) for r in range(len(slow[0]))) if slow else ()
        measured = [m.bandwidth() for m in window if math.isfinite(m.bandwidth())]
        bandwidth = statistics.median(measured) if measured else self.costs.bandwidth
        return replace(self.costs, slowdown=slowdown, bandwidth=bandwidth)

    def __call__(self, window: Sequence[IterationMetrics], schedule: Any, bounds: Bounds) -> float:
        return simulate(schedule, self.current(window), bounds, critical_path=False).iteration_time
