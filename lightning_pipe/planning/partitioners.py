"""The partitioners, by name: each maps (costs, stages, microbatches, schedule) to block ranges.

    uniform     equal transformer layers per stage (Megatron-LM); equal block counts without kinds
    parameters  balanced parameter bytes (DeepSpeed's 'parameters' method), min-max by DP
    dp          AutoPipe Algorithm 1: min-max of per-stage forward + backward time
    autopipe    AutoPipe's planner as the paper defines it: Algorithm 1, then its master-stage
                heuristic (rule (1), master-stage moves) on simulated iteration times
    autopipe+refine  ours: `autopipe`, then our local search over stage boundaries (refine.py)
    exhaustive  every split simulated (small models only): the ground truth

All take the same arguments so `plan` can call any of them; `kinds` only matters to `uniform`.
`stages` counts ranks; `options` (chunks=v for interleaved, waves=W for wave) make a multi-chunk
schedule, cut into P·v or 2PW pieces (see chunked.py for how `autopipe` and `autopipe+refine`
search those).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..schedules import chunk_count
from ..simulation import CostModel
from .chunked import ChunkedEvaluator
from .exhaustive import exhaustive_bounds
from .heuristic import autopipe_bounds
from .minmax import min_max_bounds
from .replay import Bounds, Evaluator, paused_gc
from .uniform import uniform_bounds

Partitioner = Callable[..., Bounds]


Options = Optional[dict]


def pieces(stages: int, schedule: str, options: Options) -> int:
    return chunk_count(schedule, stages, **(options or {}))


def uniform(
    costs: CostModel,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    kinds: Optional[Sequence[str]] = None,
    options: Options = None,
) -> Bounds:
    return uniform_bounds(costs.num_blocks, pieces(stages, schedule, options), kinds)


def parameters(
    costs: CostModel,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    kinds: Optional[Sequence[str]] = None,
    options: Options = None,
) -> Bounds:
    if not costs.param_bytes:
        raise ValueError("method='parameters' balances parameter bytes, but the cost model has no param_bytes")
    return min_max_bounds(costs.param_bytes, pieces(stages, schedule, options))


def dp(
    costs: CostModel,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    kinds: Optional[Sequence[str]] = None,
    options: Options = None,
) -> Bounds:
    return min_max_bounds([f + b for f, b in zip(costs.forward, costs.backward)], pieces(stages, schedule, options))


def _autopipe(costs: CostModel, stages: int, microbatches: int, schedule: str, options: Options, refined: bool) -> Bounds:
    evaluator = Evaluator(costs, schedule, stages, microbatches, options)
    n = pieces(stages, schedule, options)
    if n != stages:  # several chunks per rank: the same steps over the P·v / 2PW chunks (chunked.py)
        evaluator = ChunkedEvaluator(evaluator)
    with paused_gc():  # the search allocates many small tuples; a collection walking torch's objects is slow
        return autopipe_bounds(evaluator, n, refined=refined)


def autopipe(
    costs: CostModel,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    kinds: Optional[Sequence[str]] = None,
    options: Options = None,
) -> Bounds:
    """AutoPipe's planner as the paper defines it: Algorithm 1 + the master-stage heuristic."""
    return _autopipe(costs, stages, microbatches, schedule, options, refined=False)


def autopipe_refine(
    costs: CostModel,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    kinds: Optional[Sequence[str]] = None,
    options: Options = None,
) -> Bounds:
    """Ours: the paper's heuristic, then our local search over boundaries (refine.py)."""
    return _autopipe(costs, stages, microbatches, schedule, options, refined=True)


def exhaustive(
    costs: CostModel,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    *,
    kinds: Optional[Sequence[str]] = None,
    options: Options = None,
) -> Bounds:
    seed = dp(costs, stages, microbatches, schedule, options=options)  # a good first incumbent: the bound prunes more
    evaluator = Evaluator(costs, schedule, stages, microbatches, options)
    return exhaustive_bounds(evaluator, pieces(stages, schedule, options), seed)


PARTITIONERS: dict[str, Partitioner] = {
    "uniform": uniform,
    "parameters": parameters,
    "dp": dp,
    "autopipe": autopipe,
    "autopipe+refine": autopipe_refine,
    "exhaustive": exhaustive,
}
