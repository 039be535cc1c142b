"""Local search over stage boundaries, after AutoPipe's heuristic (our addition, not the paper's):
`partition="autopipe+refine"`.

The paper's moves hand one block from the master stage to a neighbour. Measured against
exhaustive search they stop short (docs/results/planner.md, random small profiles): the best splits often
differ by a block handed along a chain of stages (every boundary between stage s and stage t
shifted by one), or by a boundary away from the master. So, until nothing improves, try in turn

    1. chains through the master stage: one block of load from the master to any stage t, the
       stages between passing it along (the paper's step 3 is t = i - 1 and t = i + 1);
    2. single boundary shifts, anywhere;
    3. chains between any two stages;
    4. one cut removed and put anywhere else (when the messages' sizes differ from block to
       block, the cheap cuts can be far apart, and with few micro-batches they decide);

and take the best improvement of the first tier that has one. Candidates are replayed in batches
(not pruned by the replay's lower bound first: computing the bound costs about as much as a
batched replay column).
"""

from __future__ import annotations

from typing import Iterator, Optional

from .replay import Bounds, Evaluator

EPS = 1e-9  # relative improvement that counts: float noise must not walk the search in circles
MAX_ROUNDS = 500  # every round improves by EPS at least; this only guards against pathological costs


def shifted(bounds: Bounds, first: int, last: int, step: int) -> Optional[Bounds]:
    """`bounds` with stage boundaries first..last (1 = between stage 0 and 1) moved by `step`
    blocks, or None if a stage would be left without blocks."""
    edges = [a for a, _ in bounds] + [bounds[-1][1]]
    for k in range(first, last + 1):
        edges[k] += step
    for k in range(max(0, first - 1), min(len(bounds), last + 1)):
        if edges[k] >= edges[k + 1]:
            return None
    return tuple(zip(edges, edges[1:]))


def through_master(bounds: Bounds, master: int) -> Iterator[Optional[Bounds]]:
    p = len(bounds)
    for distance in range(1, p):
        if master - distance >= 0:  # its first block to the stage before, and so on down to stage t
            yield shifted(bounds, master - distance + 1, master, +1)
        if master + distance < p:  # its last block to the stage after, and so on up to stage t
            yield shifted(bounds, master + 1, master + distance, -1)


def single(bounds: Bounds, master: int) -> Iterator[Optional[Bounds]]:
    for k in range(1, len(bounds)):
        yield shifted(bounds, k, k, -1)
        yield shifted(bounds, k, k, +1)


def relocations(bounds: Bounds, master: int) -> Iterator[Optional[Bounds]]:
    n = bounds[-1][1]
    cuts = [a for a, _ in bounds[1:]]
    taken = set(cuts)
    free = [x for x in range(1, n) if x not in taken]
    for k in range(len(cuts)):
        rest = cuts[:k] + cuts[k + 1 :]
        for x in free:
            edges = [0, *sorted(rest + [x]), n]
            yield tuple(zip(edges, edges[1:]))


def chains(bounds: Bounds, master: int) -> Iterator[Optional[Bounds]]:
    for first in range(1, len(bounds)):
        for last in range(first + 1, len(bounds)):
            yield shifted(bounds, first, last, -1)
            yield shifted(bounds, first, last, +1)


# chains (about p^2 candidates) before relocations (about p n): the same results on the docs'
# models and 600 random profiles, fewer replays on deep pipelines
TIERS = (through_master, single, chains, relocations)


def refine(evaluator: Evaluator, bounds: Bounds, max_rounds: int = MAX_ROUNDS) -> Bounds:
    best, best_time = bounds, evaluator.time(bounds)
    for _ in range(max_rounds):
        master = evaluator.master(best)
        if master is None:
            break
        target = best_time * (1 - EPS)
        for tier in TIERS:
            # no lower-bound pruning here: the bound costs about as much as a batched replay column
            candidates = [c for c in dict.fromkeys(tier(best, master)) if c is not None]
            times = evaluator.times(candidates)
            if times and min(times) < target:
                best_time, best = min(zip(times, candidates))
                break
        else:
            break  # no tier improves: a local optimum
    return best
