"""The partitioners, by name: each maps (costs, stages, microbatches, schedule) to block ranges.

    uniform     equal transformer layers per stage (Megatron-LM); equal block counts without kinds
    parameters  balanced parameter bytes (DeepSpeed's 'parameters' method), min-max by DP
    dp          AutoPipe Algorithm 1: min-max of per-stage forward + backward time
    autopipe    Algorithm 1, then the master-stage heuristic on simulated iteration times
    exhaustive  every split simulated (small models only): the ground truth

All take the same arguments so `plan` can call any of them; `kinds` only matters to `uniform`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..simulator import CostModel
from .exhaustive import exhaustive_bounds
from .heuristic import autopipe_bounds
from .minmax import min_max_bounds
from .replay import Bounds, Evaluator
from .uniform import uniform_bounds

Partitioner = Callable[..., Bounds]


def uniform(costs: CostModel, stages: int, microbatches: int, schedule: str = "1f1b", *, kinds: Optional[Sequence[str]] = None) -> Bounds:
    return uniform_bounds(costs.num_blocks, stages, kinds)


def parameters(costs: CostModel, stages: int, microbatches: int, schedule: str = "1f1b", *, kinds: Optional[Sequence[str]] = None) -> Bounds:
    if not costs.param_bytes:
        raise ValueError("method='parameters' balances parameter bytes, but the cost model has no param_bytes")
    return min_max_bounds(costs.param_bytes, stages)


def dp(costs: CostModel, stages: int, microbatches: int, schedule: str = "1f1b", *, kinds: Optional[Sequence[str]] = None) -> Bounds:
    return min_max_bounds([f + b for f, b in zip(costs.forward, costs.backward)], stages)


def autopipe(costs: CostModel, stages: int, microbatches: int, schedule: str = "1f1b", *, kinds: Optional[Sequence[str]] = None) -> Bounds:
    return autopipe_bounds(Evaluator(costs, schedule, stages, microbatches), stages)


def exhaustive(costs: CostModel, stages: int, microbatches: int, schedule: str = "1f1b", *, kinds: Optional[Sequence[str]] = None) -> Bounds:
    seed = dp(costs, stages, microbatches, schedule)  # a good first incumbent: the bound prunes more
    return exhaustive_bounds(Evaluator(costs, schedule, stages, microbatches), stages, seed)


PARTITIONERS: dict[str, Partitioner] = {
    "uniform": uniform,
    "parameters": parameters,
    "dp": dp,
    "autopipe": autopipe,
    "exhaustive": exhaustive,
}
