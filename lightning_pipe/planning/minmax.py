"""AutoPipe Algorithm 1: contiguous stages that minimise the heaviest stage, by dynamic programming.

``time[j][i]`` is the smallest possible heaviest stage when blocks ``[0, i)`` form ``j`` stages:
``min_k max(time[j-1][k], prefix[i] - prefix[k])``, O(n^2 p). One table answers every prefix
question ("blocks [0, x) over j stages"), which the AutoPipe heuristic asks again and again when
it re-balances the stages before the master stage.
"""

from __future__ import annotations

import math
from typing import Sequence

Bounds = tuple[tuple[int, int], ...]


class MinMaxTable:
    def __init__(self, weights: Sequence[float], stages: int):
        n = len(weights)
        if not 1 <= stages <= n:
            raise ValueError(f"cannot split {n} blocks into {stages} non-empty stages")
        prefix = [0.0]
        for w in weights:
            prefix.append(prefix[-1] + w)
        self.prefix, self.n, self.stages = prefix, n, stages
        inf = math.inf
        time = [[inf] * (n + 1) for _ in range(stages + 1)]
        time[0][0] = 0.0
        for j in range(1, stages + 1):
            prev, row = time[j - 1], time[j]
            # blocks [0, i) over j stages; the later stages need one block each, so i <= n - (stages - j)
            for i in range(j, n - (stages - j) + 1):
                total, best = prefix[i], inf
                for k in range(j - 1, i):
                    v = prev[k]
                    load = total - prefix[k]
                    if load > v:
                        v = load
                    if v < best:
                        best = v
                row[i] = best
        self.time = time

    def bounds(self, blocks: int, stages: int) -> Bounds:
        """An optimal split of blocks ``[0, blocks)`` into `stages` stages.

        Many splits reach the optimum V; this one fills each stage up to V from the front (leaving a
        block for every later stage), so load sits early and the last stages are the lightest: the
        shape AutoPipe's findings favour (master stage early, light stages after it). Filling
        greedily never needs more stages than an optimal split, so every stage stays within V
        (up to float rounding)."""
        if not 1 <= stages <= min(blocks, self.stages) or blocks - stages > self.n - self.stages:
            raise ValueError(f"the table has no split of {blocks} blocks into {stages} stages")
        # V came from other prefix differences: a stage of the same real load may differ in the last bits
        limit, prefix = self.time[stages][blocks] * (1 + 1e-9), self.prefix
        out, x = [], 0
        for s in range(stages - 1):
            y, last = x + 1, blocks - (stages - 1 - s)
            while y < last and prefix[y + 1] - prefix[x] <= limit:
                y += 1
            out.append((x, y))
            x = y
        out.append((x, blocks))
        return tuple(out)

    def objective(self, blocks: int, stages: int) -> float:
        return self.time[stages][blocks]


def min_max_bounds(weights: Sequence[float], stages: int) -> Bounds:
    return MinMaxTable(weights, stages).bounds(len(weights), stages)


def heaviest(weights: Sequence[float], bounds: Sequence[tuple[int, int]]) -> float:
    """The objective Algorithm 1 minimises: the largest per-stage sum."""
    return max(sum(weights[a:b]) for a, b in bounds)
