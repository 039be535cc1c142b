"""Ground truth: simulate every split of n blocks into p contiguous non-empty stages.

There are C(n-1, p-1) of them, so this refuses beyond `limit`. The result is exact, but not every
split is simulated: a rank's computes run one after another, so the busiest rank's total compute
is a lower bound of the iteration time (`Replay.lower_bound` has a tighter one for one chunk per
rank), and a split whose bound already exceeds the best time found cannot win. Starting from
Algorithm 1's split makes that bound bite early. Ties keep the split found first.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

from .replay import Bounds, Evaluator

EXHAUSTIVE_LIMIT = 200_000
BATCH = 512  # splits replayed together; the incumbent tightens the bound between batches


def count_splits(num_blocks: int, stages: int) -> int:
    return math.comb(num_blocks - 1, stages - 1)


def exhaustive_bounds(evaluator: Evaluator, stages: int, seed: Optional[Bounds] = None, limit: int = EXHAUSTIVE_LIMIT) -> Bounds:
    costs, replay = evaluator.costs, evaluator.replay
    n = costs.num_blocks
    count = count_splits(n, stages)
    if count > limit:
        raise ValueError(
            f"method='exhaustive' would simulate C({n - 1}, {stages - 1}) = {count} splits of {n} blocks into "
            f"{stages} stages, more than the limit of {limit}: use fewer stages or blocks, or method='autopipe'"
        )
    best = seed if seed is not None else tuple((s, s + 1) for s in range(stages - 1)) + ((stages - 1, n),)
    best_time = evaluator.time(best)
    margin = 1 + 1e-9  # the bound is summed in another order than the replay: never prune a tie
    batch: list[Bounds] = []

    def flush() -> None:
        nonlocal best, best_time
        for t, bounds in zip(replay.iteration_times(costs, batch), batch):
            if t < best_time:
                best, best_time = bounds, t
        batch.clear()

    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        bounds = tuple(zip(edges, edges[1:]))
        if replay.lower_bound(costs, bounds) > best_time * margin:
            continue
        batch.append(bounds)
        if len(batch) == BATCH:
            flush()
    flush()
    return best
