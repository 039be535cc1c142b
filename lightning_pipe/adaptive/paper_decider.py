"""adaptive=paper: AutoPipe-RL's learned method as the paper defines it (§4.2-4.3), on the running
job's own measurements. No Lightning; `lightning/adaptive.py` calls `observe` every measured
iteration and `decide` once per window on one rank, and broadcasts the verdict.

- inputs: the paper's per-layer rows (`paper_features`): Table 1's static metrics, the window's
  B_i / FP_{i,j} / BP_{i,j}, the layer-count arrays;
- the speed predictor: at each decision a copy of the shipped network (Reptile's initialisation,
  then offline training: `paper_offline`) takes `ONLINE_STEPS` gradient steps (`meta.adapt`) on the
  job's recent measured iterations, then scores every neighbour candidate; the best one is proposed
  when it is predicted faster than the running partition;
- the arbiter (Table 1's metrics and both partitions) says switch or stay, and learns online from
  the reward the paper defines, measured: a stay earns 0; a switch earns T_before / T_after - 1 -
  C / (T_before * HORIZON), T the median measured iteration of the window before the decision and of
  the first full window after the switch, C the switching cost;
- the switching cost: the paper's switch-cost meta-network, adapted (from its shipped weights, the
  same steps) on every switch the job measured; it gives C.

Limits (the shipped networks'): depths with shipped files (2 and 4), at most `L_MAX` blocks, one
chunk per worker (`paper_features.SINGLE_CHUNK` schedules).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from . import meta
from . import paper_features as P
from . import paper_predictor as N
from .candidates import neighbour_candidates
from .features import DEFAULT_BANDWIDTH, link_bandwidth, unit_time
from .learned import Verdict
from .monitor import IterationMetrics, StaticMetrics
from .paper_arbiter import PaperArbiter, features
from .paper_offline import ONLINE_STEPS, load, reward
from .predictor import WEIGHTS

ONLINE_LR = 1e-3  # the offline evaluation's adaptation (paper_offline.predictor_online)
RECENT = 64  # measured iterations the predictor adapts on: the recent ones (the load changes)
NAMES = ("predictor", "switch_cost", "arbiter")


@dataclass
class PaperNetworks:
    predictor: N.MetaNetwork
    switch_cost: N.MetaNetwork
    arbiter: PaperArbiter


def weight_files(folder: Optional[Path], depth: int) -> list[Path]:
    return [(folder or WEIGHTS) / f"paper_{name}_d{depth}.pt" for name in NAMES]


def load_paper(folder: Optional[Path], depth: int) -> PaperNetworks:
    """The three shipped networks for `depth`; a missing or mismatched file is an error naming it."""
    for path in weight_files(folder, depth):
        if not path.is_file():
            raise FileNotFoundError(
                f"adaptive weights {path}: no such file (train them: python -m lightning_pipe.adaptive.paper_offline --out {path.parent})"
            )
    return PaperNetworks(*(load(folder, name, depth) for name in NAMES))


def shipped_depths(folder: Optional[Path] = None) -> list[int]:
    """Depths with all three files in `folder` (the package's: 2 and 4)."""
    found = sorted(int(p.stem.rsplit("_d", 1)[1]) for p in (folder or WEIGHTS).glob("paper_predictor_d*.pt"))
    return [d for d in found if all(p.is_file() for p in weight_files(folder, d))]


class PaperEncoder:
    """The monitor's numbers as the paper's rows, for one job (its profile, M and depth)."""

    def __init__(self, static: StaticMetrics, microbatches: int, depth: int):
        self.static, self.m, self.depth = static, microbatches, depth
        self.t0 = unit_time(static.forward, static.backward, microbatches, depth)
        self.static_row = P.static_row(static.output_bytes, static.input_grad_bytes, static.param_bytes, depth)

    def dynamic(self, metrics: IterationMetrics) -> list[float]:
        links = link_bandwidth(metrics.link_bandwidth, self.depth, DEFAULT_BANDWIDTH)
        speed = metrics.slowdown(self.static)
        return P.dynamic_row(self.static.forward, self.static.backward, self.m, speed, P.worker_bandwidth(links, self.depth), self.t0)

    def window(self, window: Sequence[IterationMetrics]) -> list[list[float]]:
        return [self.dynamic(m) for m in window]

    def partition(self, bounds: Any) -> list[float]:
        return P.partition_row(bounds, self.depth)


def measured(window: Sequence[IterationMetrics]) -> float:
    """The window's iteration time: the median of each iteration's slowest rank."""
    return statistics.median(max(m.wall_s) for m in window)


class PaperDecider:
    def __init__(self, networks: PaperNetworks, static: StaticMetrics, microbatches: int, window: int, seed: int = 0):
        self.shipped = networks  # never changed: each online adaptation starts from it
        self.encoder = PaperEncoder(static, microbatches, networks.predictor.depth)
        self.window, self.seed = window, seed
        self.predictor = copy.deepcopy(networks.predictor)  # the adapted copy of the last decision
        self.switch_cost = copy.deepcopy(networks.switch_cost)  # adapted on the measured switches
        self.arbiter = copy.deepcopy(networks.arbiter)  # updated online by each measured reward
        self.recent: deque[tuple[list, list, float]] = deque(maxlen=RECENT)  # (window rows, rest, log(T / T0))
        self.switch_samples: list[tuple[list, list, float]] = []  # (window rows, rest, log10 seconds)
        self.proposal: Optional[dict[str, Any]] = None  # a switch decided, its reward not yet measured
        self.rewards: list[tuple[bool, float]] = []  # (switched, measured reward) of every arbiter decision
        self.online_steps = 0  # gradient steps of the predictor's adaptations

    # ---- measurements ------------------------------------------------------------------------------
    def observe(self, window: Sequence[IterationMetrics]) -> None:
        """Every measured iteration of the running partition (its full window): a sample for the
        predictor, and, a window after a switch, that switch's measured reward."""
        if len(window) < self.window:
            return
        latest, enc = window[-1], self.encoder
        self.recent.append((enc.window(window), enc.static_row + enc.partition(latest.bounds), math.log(max(latest.wall_s) / enc.t0)))
        p = self.proposal
        if p is not None and p["cost_s"] is not None and all(m.bounds == p["new"] for m in window):
            r = reward(p["before_s"], measured(window), p["cost_s"])
            self.arbiter.online_update(p["x"], True, r)
            self.rewards.append((True, r))
            self.proposal = None

    def switched(self, moved_bytes: float, bandwidth: float, blocks: int, seconds: float, old: Any = None, new: Any = None) -> None:
        """A switch was measured: the switch-cost network adapts to every switch so far (from its
        shipped weights), then prices the arbiter's switch (the reward's C)."""
        p = self.proposal
        if p is None or p["old"] != old or p["new"] != new:
            return  # requested by hand: not a decision of the arbiter's
        rest = self.encoder.static_row + self.encoder.partition(old) + self.encoder.partition(new)
        self.switch_samples.append((p["rows"], rest, math.log10(max(seconds, 1e-6))))
        self.switch_cost = self._adapted(self.shipped.switch_cost, self.switch_samples, len(self.switch_samples))
        p["cost_s"] = self._cost(p["rows"], rest)

    # ---- the decision --------------------------------------------------------------------------------
    def _adapted(self, network: N.MetaNetwork, samples: Sequence[tuple[list, list, float]], salt: int) -> N.MetaNetwork:
        """A copy of `network` after the paper's online adaptation on `samples` (meta.adapt: the few
        steps Reptile's initialisation was learned for)."""
        tuned = copy.deepcopy(network)
        if samples:
            task = (P.as_tensor([s[0] for s in samples]), P.as_tensor([s[1] for s in samples]), torch.tensor([s[2] for s in samples]))
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
            meta.adapt(tuned, N.mse, task, ONLINE_STEPS, ONLINE_LR, 32, generator)
        return tuned.eval()

    def _cost(self, rows: list, rest: list) -> float:
        with torch.no_grad():
            return 10 ** float(self.switch_cost(P.as_tensor([rows]), P.as_tensor([rest]))[0])

    def decide(self, window: Sequence[IterationMetrics], left: Optional[float], since: float, bandwidth: float) -> Optional[Verdict]:
        """Adapt the predictor, score the neighbour candidates, and ask the arbiter about the best one
        (`left`, `since`, `bandwidth`: the learned decider's signature; the paper's arbiter reads none)."""
        started = time.perf_counter()
        self.predictor = self._adapted(self.shipped.predictor, list(self.recent), len(self.rewards) + self.online_steps)
        if self.recent:
            self.online_steps += ONLINE_STEPS
        adapted = time.perf_counter() - started
        latest, enc = window[-1], self.encoder
        candidates = neighbour_candidates(latest.bounds, latest.chunk_rank)
        if not candidates:
            return None
        rows, now_row = enc.window(window), enc.partition(latest.bounds)
        partitions = [latest.bounds, *candidates]
        rests = [enc.static_row + enc.partition(b) for b in partitions]
        with torch.no_grad():
            predicted = [math.exp(float(y)) * enc.t0 for y in self.predictor(P.as_tensor([rows] * len(rests)), P.as_tensor(rests))]
        now, rest = predicted[0], predicted[1:]
        k = min(range(len(rest)), key=rest.__getitem__)
        best, scores = candidates[k], list(zip(partitions, predicted))
        cost = self._cost(rows, enc.static_row + now_row + enc.partition(best))
        if rest[k] >= now:  # nothing predicted faster: no new partition for the arbiter to judge
            return Verdict(False, best, now, rest[k], 0.0, cost, time.perf_counter() - started, adapted, scores)
        x = features(enc.static_row, rows[-1], now_row, enc.partition(best))
        switch, p = self.arbiter.switch(x)
        if switch:  # rewarded once a window on the new partition is measured (`observe`)
            self.proposal = {"x": x, "old": latest.bounds, "new": best, "before_s": measured(window), "rows": rows, "cost_s": None}
        else:  # staying earns the reward's zero (it is relative to staying)
            self.arbiter.online_update(x, False, 0.0)
            self.rewards.append((False, 0.0))
        return Verdict(switch, best, now, rest[k], p, cost, time.perf_counter() - started, adapted, scores)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the run learned: the measurements the networks adapt on, the arbiter as updated."""
        arbiter_optimizer = self.arbiter.optimizer.state_dict() if self.arbiter.optimizer is not None else None
        return {
            "recent": list(self.recent),
            "switch_samples": list(self.switch_samples),
            "arbiter": self.arbiter.state_dict(),
            "arbiter_baseline": self.arbiter.baseline,
            "arbiter_optimizer": arbiter_optimizer,
            "rewards": [list(r) for r in self.rewards],
            "online_steps": self.online_steps,
            "proposal": self.proposal,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(tuple(r) for r in state["recent"])
        self.switch_samples = [tuple(s) for s in state["switch_samples"]]
        self.switch_cost = self._adapted(self.shipped.switch_cost, self.switch_samples, len(self.switch_samples))
        self.arbiter.load_state_dict(state["arbiter"])
        self.arbiter.baseline = state["arbiter_baseline"]
        if state["arbiter_optimizer"] is not None:
            self.arbiter.optimizer = torch.optim.Adam(self.arbiter.parameters(), lr=self.arbiter.lr)
            self.arbiter.optimizer.load_state_dict(state["arbiter_optimizer"])
        self.rewards = [(bool(s), float(r)) for s, r in state["rewards"]]
        self.online_steps = state["online_steps"]
        self.proposal = state["proposal"]
