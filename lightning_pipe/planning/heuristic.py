"""AutoPipe's heuristic partition search (paper §III-B): start from Algorithm 1, move the master stage.

The master stage i is where the critical path runs in the 1F1B phase. Two findings drive the search:
the iteration time falls when the master stage moves forward (to a lower stage), and, for a given
master stage, stages after it should be light enough that the master never waits for them in the
cool-down phase, which is rule (1):

    for every s > i:  sum_{j=i+1..s} (f_j + b_j) <= (s - i) * b_i

1. Algorithm 1's split, simulated: iteration time and master stage i.
2. Re-balance the stages after i to satisfy rule (1) (keep whichever of the two is faster).
3. Unless i == 0, move the master stage forward: move the first block of stage i to stage i-1,
   or the last block of stage i to stage i+1, each as is and with Algorithm 1 re-applied to the
   stages before (before i in the first case, up to i in the second). Candidates whose master
   stage is at most i go back to 2: fastest first, each split once, at most MAX_EXPANSIONS.
4. Return the fastest split simulated. Algorithm 1's split is one of them, so the result is never
   slower than `dp`.

`autopipe_bounds` then runs `refine.refine`, a local search of ours, from that split (see there
for why); `refined=False` gives the paper's steps alone.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from .minmax import MinMaxTable
from .refine import EPS, refine
from .replay import Bounds, Evaluator

MAX_EXPANSIONS = 256  # bounds the search on deep pipelines; small ones run out of candidates first


def rule_one(bounds: Bounds, master: int, weights: Sequence[float], backward: Sequence[float]) -> Bounds:
    """Re-split the blocks after the master stage so that rule (1) holds where it can: each stage
    s > i takes as many blocks as keep the running load within (s - i) * b_i (front-loaded, so the
    last stages are the lightest), leaving one block for every stage after it."""
    p, n = len(bounds), bounds[-1][1]
    after = p - 1 - master
    if after == 0:
        return bounds
    a, b = bounds[master]
    b_master = sum(backward[a:b])
    out = list(bounds[: master + 1])
    x, load = b, 0.0
    for s in range(1, after):
        load += weights[x]
        y = x + 1
        while y < n - (after - s) and load + weights[y] <= s * b_master:
            load += weights[y]
            y += 1
        out.append((x, y))
        x = y
    out.append((x, n))
    return tuple(out)


def master_moves(bounds: Bounds, master: int, table: MinMaxTable) -> list[Bounds]:
    """Step 3's candidates: the master stage's first block to stage i-1, its last block to stage i+1,
    each without and with Algorithm 1 re-applied to the stages before."""
    p = len(bounds)
    a, b = bounds[master]
    out: list[Bounds] = []
    if b - a < 2:
        return out  # a stage keeps at least one block
    if master > 0:
        moved = bounds[: master - 1] + ((bounds[master - 1][0], a + 1), (a + 1, b)) + bounds[master + 1 :]
        out.append(moved)
        if master > 1:
            out.append(table.bounds(a + 1, master) + moved[master:])
    if master < p - 1:
        moved = bounds[:master] + ((a, b - 1), (b - 1, bounds[master + 1][1])) + bounds[master + 2 :]
        out.append(moved)
        if master > 0:
            out.append(table.bounds(b - 1, master + 1) + moved[master + 1 :])
    return out


def autopipe_search(evaluator: Evaluator, stages: int, max_expansions: int = MAX_EXPANSIONS) -> Bounds:
    """Steps 1-4: the paper's heuristic alone."""
    costs = evaluator.costs
    weights = [f + b for f, b in zip(costs.forward, costs.backward)]
    table = MinMaxTable(weights, stages)
    start = table.bounds(costs.num_blocks, stages)
    best, best_time = start, evaluator.time(start)
    # best-first over the candidates step 3 hands back to step 2, each split expanded once; an
    # entry carries the master stage it was moved from, checked only when it is taken (a critical
    # path costs more than a replay, and most candidates are never taken)
    frontier: list[tuple[float, Bounds, int]] = [(best_time, start, stages)]
    expanded: set[Bounds] = set()
    while frontier and len(expanded) < max_expansions:
        time, bounds, moved_from = heapq.heappop(frontier)
        if bounds in expanded:
            continue
        master = evaluator.master(bounds)
        if master is None or master > moved_from:
            continue
        expanded.add(bounds)
        # step 2: rule (1) behind the master stage, kept if it is no slower; if it moved the master
        # stage, step 3 moves the new one
        adjusted = rule_one(bounds, master, weights, costs.backward)
        if adjusted != bounds and evaluator.time(adjusted) <= time:
            bounds, time = adjusted, evaluator.time(adjusted)
            master = evaluator.master(bounds)
            expanded.add(bounds)
            if time < best_time * (1 - EPS):
                best, best_time = bounds, time
        if master == 0:
            continue  # nothing before the master stage to move it to
        # step 3: move the master stage forward; a candidate goes back to step 2 if its master stage
        # is at most i (as the paper says: even when it is slower for now, since the next move may
        # need it, as when the master stage moves two stages forward)
        for candidate in master_moves(bounds, master, table):
            t = evaluator.time(candidate)
            if t < best_time * (1 - EPS):
                best, best_time = candidate, t
            if candidate not in expanded:
                heapq.heappush(frontier, (t, candidate, master))
    return best


def autopipe_bounds(evaluator: Evaluator, stages: int, refined: bool = True) -> Bounds:
    """The paper's heuristic, then (unless `refined` is False) our local search over boundaries."""
    found = autopipe_search(evaluator, stages)
    return refine(evaluator, found) if refined else found
