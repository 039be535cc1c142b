"""adaptive=learned: the speed predictor, the arbiter and the switch-cost network, loaded and used
together (AutoPipe-RL §4.2-4.3). No Lightning; `lightning/adaptive.py` calls `decide` on pipeline
rank 0 and broadcasts the outcome, so every rank switches alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .arbiter import Arbiter, SwitchCost, arbiter_features
from .candidates import neighbour_candidates
from .monitor import IterationMetrics, StaticMetrics
from .predictor import WEIGHTS, LearnedScorer, SpeedPredictor, load_file, load_predictor
from .switch import plan_moves

HORIZON = 1000  # iterations assumed left when the run has no end (as part 1's rule)


@dataclass
class Learned:
    predictor: SpeedPredictor
    arbiter: Arbiter
    switch_cost: SwitchCost


def load_learned(folder: Optional[Path], depth: int) -> Learned:
    """The three networks for a pipeline of `depth` stages; a missing, unreadable or mismatched file is
    an error naming it."""
    folder = folder or WEIGHTS
    predictor = load_predictor(folder, depth)
    arbiter, cost = Arbiter(), SwitchCost()
    for module, name, kind in ((arbiter, "arbiter.pt", "arbiter"), (cost, "switch_cost.pt", "switch_cost")):
        path = folder / name
        _, state = load_file(path, kind)
        try:
            module.load_state_dict(state)
        except RuntimeError as error:
            raise ValueError(f"adaptive weights {path}: the tensors do not fit the {kind} network ({error})") from None
        module.eval()
    return Learned(predictor, arbiter, cost)


@dataclass
class Verdict:
    switch: bool
    best: Any
    now_s: float
    best_s: float
    probability: float
    cost_s: float
    seconds: float  # decision time: adaptation + scoring + arbiter
    adapt_seconds: float  # of which online adaptation
    scores: list[tuple[Any, float]] = field(default_factory=list)  # every candidate's prediction (evaluation)


class LearnedDecider:
    """`schedule`: the running schedule, a `ScheduleSpec` (its options reach the predictor: an
    advance / 2BW order's advance_num) or a name; any of `features.SCHEDULES`, each trained on."""

    def __init__(self, learned: Learned, static: StaticMetrics, schedule: Any, microbatches: int):
        self.learned = learned
        self.scorer = LearnedScorer(learned.predictor, static, schedule, microbatches)
        self.static = static

    def observe(self, window: Sequence[IterationMetrics]) -> None:
        """Every measured iteration of the running partition goes to the replay buffer."""
        latest = window[-1]
        self.scorer.observe(window, max(latest.wall_s))

    def decide(self, window: Sequence[IterationMetrics], left: Optional[float], since: float, bandwidth: float) -> Optional[Verdict]:
        started = time.perf_counter()
        self.scorer.adapt()
        adapted = time.perf_counter() - started
        latest = window[-1]
        candidates = neighbour_candidates(latest.bounds, latest.chunk_rank)
        if not candidates:
            return None
        predicted = self.scorer.score_many(window, [latest.bounds, *candidates], latest.chunk_rank)
        now, rest = predicted[0], predicted[1:]
        k = min(range(len(rest)), key=rest.__getitem__)
        best = candidates[k]
        moved = [b for m in plan_moves(latest.bounds, best, latest.chunk_rank) for b in m.blocks]
        cost = self.learned.switch_cost.seconds(sum(self.static.param_bytes[b] for b in moved), bandwidth, len(moved))
        feats = arbiter_features(
            now, rest[k], self.scorer._t0(), cost, left if left and left > 0 else HORIZON, min(since, 1000.0), max(latest.wall_s)
        )
        switch, p = self.learned.arbiter.switch(feats)
        scores = [(latest.bounds, now), *zip(candidates, rest)]
        return Verdict(switch and rest[k] < now, best, now, rest[k], p, cost, time.perf_counter() - started, adapted, scores)

    @property
    def online_steps(self) -> int:
        return self.scorer.adapted

    def state_dict(self) -> dict[str, Any]:
        """The online state (the adapted predictor and switch-cost network); the arbiter does not learn online."""
        return {"scorer": self.scorer.state_dict(), "switch_cost": self.learned.switch_cost.online_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scorer.load_state_dict(state["scorer"])
        self.learned.switch_cost.load_online_state(state["switch_cost"])

    def switched(self, moved_bytes: float, bandwidth: float, blocks: int, seconds: float, old: Any = None, new: Any = None) -> None:
        """A measured switch (`old`, `new`: its partitions, which this network does not read)."""
        if math.isfinite(bandwidth) and bandwidth > 0:
            self.learned.switch_cost.adapt(moved_bytes, bandwidth, blocks, seconds)
