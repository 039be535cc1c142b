"""AutoPipe's heuristic partition search, as the paper states it (Liu et al., §III-B 2)).

The master stage i is the stage the critical path runs through in the 1F1B phase. Two findings
drive the search: the iteration time falls when the master stage moves forward (to a lower
stage), and, for a given master stage, the stages after it should be light enough that the master
never waits for them in the cool-down phase, which is rule (1):

    for every s > i:  sum_{j=i+1..s} f_j + sum_{j=i+1..s} b_j <= (s - i) * b_i

The paper's steps, and how each is implemented here:

1) Algorithm 1's split (`MinMaxTable`), simulated: iteration time and master stage i.
2) The stages after i are adjusted so that rule (1) holds for every s > i (`rule_one_steps`).
   "If the master stage changes after the adjustment, stop the adjustment and go to 3) with the
   adjusted partition scheme": the adjustment goes stage by stage, s = i+1, i+2, ..., and the
   split is simulated after each stage it changes; when the master stage is no longer i, the
   adjustment stops there. The adjusted split always replaces the one it came from (the paper
   keeps no "only if faster" test; every split simulated competes in 4)).
3) If i == 0, this split is done. Otherwise the master stage moves forward: the first block of
   stage i to stage i-1, or the last block of stage i to stage i+1, each as is and with
   Algorithm 1 re-applied to the stages before (`master_moves`). Each candidate is simulated;
   those whose master stage is <= i go back to 2).
4) The split with the smallest simulated iteration time is returned.

Where the paper is ambiguous, and what we chose:

- Algorithm 1's line 15 ("reconstruct the result partition array based on time") does not say
  which of the many optimal splits; `MinMaxTable.bounds` fills each stage up to the optimum from
  the front (see minmax.py for why).
- How rule (1) is made to hold is not said. We change as little as the rule needs: stage s's last
  blocks go to stage s+1 until the running sum is within (s - i) b_i (a stage keeps at least one
  block); a stage that already satisfies the rule is not touched. The last stage has nowhere to
  pass blocks to, and its inequality involves every block after stage i whatever the split, so
  rule (1) at s = p-1 holds or fails regardless of the adjustment.
- "The first i-1 stages" / "the first i stages" that Algorithm 1 is re-applied to are read
  1-based: all stages before the master (over the blocks before its new start) when its first
  block moved to stage i-1, and the stages up to and including the master (over the blocks up to
  its new end) when its last block moved to stage i+1. Read 0-based, Algorithm 1 would re-split
  blocks whose set did not change in either case.
- The paper gives no order for the candidates and no bound on the search, and the closure of its
  rule is far beyond a planning budget (`python -m benchmarks.bench_planner --closure` prints its size on
  GPT-2 1.3B / 16 stages). Ours: candidates are taken fastest first (a heap on simulated time),
  each split processed by 2) at most once, and at most `autopipe_expansions` x stages of them
  (PipelineConfig.autopipe_expansions, default `MAX_EXPANSIONS_PER_STAGE` = 32). The default is
  sized so that the paper's whole search runs wherever it finishes within that many splits (GPT-2
  345M and 1.3B on up to 8 stages, tests/test_autopipe_expansions.py) and the largest recipe stays
  inside the planning budget: GPT-2 1.3B on 16 stages stops at 32 x 16 splits in 0.4 s, 0.8% above
  the 4,740 ms the whole search finds in 32 s (docs/results/planner.md). When the bound stops a
  search that had splits left, the plan's table says so in one line (`last_stop`).
- A split that cannot finish (no master stage) is dropped.

`refine.py` is ours, not the paper's: `partition="autopipe+refine"` runs its local search from
this heuristic's result.
"""

from __future__ import annotations

import heapq
import logging
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional, Sequence

from .minmax import MinMaxTable
from .refine import EPS, refine
from .replay import Bounds, Evaluator

MAX_EXPANSIONS_PER_STAGE = 32  # splits processed by step 2), per stage: see the module notes
log = logging.getLogger(__name__)
# the run's setting, set around planning (a context variable: plan() and its callers need no new argument)
_per_stage: ContextVar[int] = ContextVar("autopipe_expansions", default=MAX_EXPANSIONS_PER_STAGE)
_last_stop: ContextVar[Optional[str]] = ContextVar("autopipe_last_stop", default=None)


def check_expansions(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"autopipe_expansions={value!r}: an integer >= 1, the splits AutoPipe's heuristic processes per stage "
            f"before it stops (default {MAX_EXPANSIONS_PER_STAGE}; the paper sets no bound)"
        )
    return value


@contextmanager
def expansion_bound(per_stage: int) -> Iterator[None]:
    """Inside, `autopipe_search` processes at most per_stage x stages splits (unless given its own bound)."""
    token = _per_stage.set(check_expansions(per_stage))
    try:
        yield
    finally:
        _per_stage.reset(token)


def rule_one_steps(bounds: Bounds, master: int, weights: Sequence[float], backward: Sequence[float]):
    """Step 2), one stage at a time: yields the split after each stage s > master that had to
    change so that sum_{j=master+1..s} (f_j + b_j) <= (s - master) * b_master holds (its last
    blocks handed to stage s+1, at least one block kept). Stages that satisfy the rule are left
    as they are, and the last stage has no later stage to hand blocks to."""
    p = len(bounds)
    a, b = bounds[master]
    b_master = sum(backward[a:b])
    edges = [x for x, _ in bounds] + [bounds[-1][1]]
    load = 0.0
    for s in range(master + 1, p - 1):
        limit = (s - master) * b_master * (1 + 1e-12)  # float rounding must not count as a violation
        start, end = edges[s], edges[s + 1]
        stage = sum(weights[start:end])
        if load + stage > limit and end - start > 1:
            while end - start > 1 and load + stage > limit:
                end -= 1
                stage -= weights[end]
            edges[s + 1] = end
            yield tuple(zip(edges, edges[1:]))
        load += stage


def rule_one(bounds: Bounds, master: int, weights: Sequence[float], backward: Sequence[float]) -> Bounds:
    """The whole adjustment of step 2), without the paper's stop when the master stage changes."""
    steps = list(rule_one_steps(bounds, master, weights, backward))
    return steps[-1] if steps else bounds


def master_moves(bounds: Bounds, master: int, table: MinMaxTable) -> list[Bounds]:
    """Step 3)'s candidates: the master stage's first block to stage i-1, its last block to stage
    i+1, each as is and with Algorithm 1 re-applied to the stages before (see the module notes)."""
    p = len(bounds)
    a, b = bounds[master]
    out: list[Bounds] = []
    if b - a < 2 or master == 0:
        return out  # a stage keeps at least one block; at i == 0 the paper stops
    moved = bounds[: master - 1] + ((bounds[master - 1][0], a + 1), (a + 1, b)) + bounds[master + 1 :]
    out.append(moved)
    if master > 1:  # a single stage before the master: Algorithm 1 over it changes nothing
        out.append(table.bounds(a + 1, master) + moved[master:])
    if master < p - 1:
        moved = bounds[:master] + ((a, b - 1), (b - 1, bounds[master + 1][1])) + bounds[master + 2 :]
        out.append(moved)
        out.append(table.bounds(b - 1, master + 1) + moved[master + 1 :])
    return list(dict.fromkeys(out))


def autopipe_search(evaluator: Evaluator, stages: int, max_expansions: int | None = None) -> Bounds:
    """Steps 1)-4): the paper's heuristic, nothing of ours added but the bound on its length."""
    if max_expansions is None:
        max_expansions = _per_stage.get() * stages
    _last_stop.set(None)
    costs = evaluator.costs
    weights = [f + b for f, b in zip(costs.forward, costs.backward)]
    table = MinMaxTable(weights, stages)
    start = table.bounds(costs.num_blocks, stages)
    best, best_time = start, evaluator.time(start)

    def consider(bounds: Bounds) -> None:
        nonlocal best, best_time
        t = evaluator.time(bounds)
        if t < best_time * (1 - EPS):  # ties keep the split found first (Algorithm 1's)
            best, best_time = bounds, t

    # splits for step 2), fastest first; an entry carries the master stage i of the split it came
    # from, and its own master stage is checked against i when it is taken (a critical path costs
    # ~50 replays, and on deep pipelines most candidates are never taken)
    frontier: list[tuple[float, int, Bounds, int]] = [(best_time, 0, start, stages)]
    processed: set[Bounds] = set()
    pushed = 0
    while frontier and len(processed) < max_expansions:
        _, _, bounds, came_from = heapq.heappop(frontier)
        if bounds in processed:
            continue
        master = evaluator.master(bounds)
        if master is None or master > came_from:
            continue
        processed.add(bounds)
        # step 2): rule (1) after the master stage, stage by stage, until the master stage changes
        for adjusted in rule_one_steps(bounds, master, weights, costs.backward):
            bounds = adjusted
            now = evaluator.master(bounds)  # replays it once, its time included
            consider(bounds)
            if now != master:
                master = now
                break
        if master is None or master == 0:
            continue  # step 3): at i == 0 this split is done
        candidates = master_moves(bounds, master, table)
        for candidate, t in zip(candidates, evaluator.times(candidates)):
            consider(candidate)
            if candidate not in processed:
                pushed += 1
                heapq.heappush(frontier, (t, pushed, candidate, master))
    if len(processed) >= max_expansions and _would_take(evaluator, frontier, processed):
        stop = (
            f"AutoPipe's heuristic hit its bound: {len(processed)} splits processed (at most {max_expansions}: "
            f"autopipe_expansions x {stages} stages) with splits still to process; best simulated iteration "
            f"{best_time * 1e3:.3f} ms. Raise autopipe_expansions (pipeline.autopipe_expansions=...) to search further"
        )
        _last_stop.set(stop)  # the plan's table prints it as one line
        log.debug(stop)
    return best


def clear_stop() -> None:
    _last_stop.set(None)


def last_stop() -> Optional[str]:
    """What the last search in this context said when its bound stopped it (None: it finished)."""
    return _last_stop.get()


def _would_take(evaluator: Evaluator, frontier: list, processed: set) -> bool:
    """Whether step 2) would still take a queued split (the loop skips the others): the bound stopped it."""
    for _, _, bounds, came_from in sorted(frontier):
        if bounds not in processed and (master := evaluator.master(bounds)) is not None and master <= came_from:
            return True
    return False


def autopipe_bounds(evaluator: Evaluator, stages: int, refined: bool = False) -> Bounds:
    """The paper's heuristic (`partition="autopipe"`), or with `refined` our local search from its
    result (`partition="autopipe+refine"`)."""
    found = autopipe_search(evaluator, stages)
    return refine(evaluator, found) if refined else found
