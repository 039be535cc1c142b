"""Partitions for multi-chunk schedules (interleaved 1F1B, wave): several model chunks per rank.

AutoPipe's heuristic reasons about one stage per rank: rule (1) and "move the master stage
forward" shift the boundaries around *the* stage on the critical path. With v chunks per rank the
critical path runs through a rank, and that rank's load is spread over chunks far apart in the
model (c, c + p, ... for interleaved; c and 2p - 1 - c for a wave). The paper defines nothing for
this case; ours: the same steps (`autopipe`: Algorithm 1 and the heuristic; `autopipe+refine`:
then the local search of `refine`) run over all P·v (or 2PW) chunks in model order, every
candidate replayed on the real multi-chunk schedule, with the "master" the heaviest chunk of the
rank the critical path runs along.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .replay import Bounds, Evaluator


class ChunkedEvaluator:
    """An `Evaluator` whose master is a chunk (the heaviest on the master rank), as `refine` expects."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator, self.costs, self.replay = evaluator, evaluator.costs, evaluator.replay

    def time(self, bounds: Bounds) -> float:
        return self.evaluator.time(bounds)

    def times(self, candidates: Sequence[Bounds]) -> list[float]:
        return self.evaluator.times(candidates)

    def lower_bound(self, bounds: Bounds) -> float:
        return self.evaluator.lower_bound(bounds)

    def master(self, bounds: Bounds) -> Optional[int]:
        rank = self.evaluator.master(bounds)
        if rank is None:
            return None
        f, b = self.costs.forward, self.costs.backward
        mine = [c for c, r in enumerate(self.replay.chunk_rank) if r == rank]
        return max(mine, key=lambda c: sum(f[bounds[c][0] : bounds[c][1]]) + sum(b[bounds[c][0] : bounds[c][1]]))
