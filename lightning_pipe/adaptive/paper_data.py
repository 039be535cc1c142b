"""Simulated environments for the paper's networks, encoded with the paper's per-layer inputs.

An environment (`offline.Environment`: a model, its schedule and M at one depth; for the switch, the
cluster's switching costs too) is what meta-learning generalises across; its `STATES` loads (slowdowns,
bandwidth, a running partition, each labelled by the simulator with every neighbour candidate, as in
`offline.py`) are one environment's samples. Only one-chunk-per-worker schedules and models of at
most `L_MAX` layers: what the layer-count array and the padded per-layer rows can describe.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from . import offline
from . import paper_features as P
from .offline import Scenario

STATES = 4  # loads per environment: the job's life, its devices and links change, its model does not


@dataclass
class SwitchEnv:
    """A cluster's switching costs: a fixed part, the optimizer's state per weight byte, link efficiency."""

    fixed_s: float
    state_copies: int
    efficiency: float

    def seconds(self, moved_bytes: float, bandwidth: float) -> float:
        return self.fixed_s + self.state_copies * moved_bytes / (self.efficiency * bandwidth)


def environments(count: int, depth: int, seed: int) -> list[tuple[list[Scenario], SwitchEnv]]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        env = offline.draw_environment(rng, depth, rng.choice(P.SINGLE_CHUNK))
        if len(env.forward) > P.L_MAX:
            continue
        switching = SwitchEnv(rng.uniform(0.005, 0.03), rng.choice((1, 2, 3)), rng.uniform(0.3, 1.0))
        out.append(([offline.draw_state(rng, env) for _ in range(STATES)], switching))
    return out


def window(s: Scenario) -> list[list[float]]:
    """The monitor's window as the paper's dynamic rows (from the scenario's per-rank slowdowns and links)."""
    d, out = s.depth, []
    for row in s.rows:
        speed = [math.exp(v) for v in row[:d]]
        links = [10 ** (v + 8) for v in row[d:]]
        out.append(P.dynamic_row(s.forward, s.backward, s.microbatches, speed, P.worker_bandwidth(links, d), s.t0))
    return out


def static(s: Scenario) -> list[float]:
    return P.static_row(s.activation_bytes, [0.0, *s.activation_bytes[:-1]], s.param_bytes, s.depth)


def partitions(s: Scenario) -> list:
    return [s.base, *s.candidates]


@dataclass
class Encoded:
    """One row per (scenario, partition): the window, the rest of the inputs, the target; `group`
    numbers the scenario, `base` marks its running partition (what a job measures)."""

    sequence: torch.Tensor
    rest: torch.Tensor
    y: torch.Tensor
    group: torch.Tensor
    base: torch.Tensor

    def task(self, mask=None) -> tuple[torch.Tensor, ...]:
        keep = slice(None) if mask is None else mask
        return self.sequence[keep], self.rest[keep], self.y[keep]


def _encoded(seqs, rests, ys, groups, bases) -> Encoded:
    return Encoded(P.as_tensor(seqs), P.as_tensor(rests), torch.tensor(ys), torch.tensor(groups), torch.tensor(bases))


def speed_samples(states: Sequence[Scenario]) -> Encoded:
    """The speed predictor's: log(T / T0) of every partition of every state."""
    seqs, rests, ys, groups, bases = [], [], [], [], []
    for g, s in enumerate(states):
        seq, head = window(s), static(s)
        for k, (bounds, t) in enumerate(zip(partitions(s), s.times)):
            seqs.append(seq)
            rests.append(head + P.partition_row(bounds, s.depth))
            ys.append(math.log(t / s.t0))
            groups.append(g)
            bases.append(k == 0)
    return _encoded(seqs, rests, ys, groups, bases)


def moved_bytes(s: Scenario, new) -> float:
    return sum(s.param_bytes[b] for b in offline._moved(s.base, new))


def cost_samples(states: Sequence[Scenario], switching: SwitchEnv) -> Encoded:
    """The switching-cost network's: log10(seconds) of switching from the running partition to each candidate."""
    seqs, rests, ys, groups, bases = [], [], [], [], []
    for g, s in enumerate(states):
        seq, head, now = window(s), static(s), P.partition_row(s.base, s.depth)
        for bounds in s.candidates:
            seqs.append(seq)
            rests.append(head + now + P.partition_row(bounds, s.depth))
            ys.append(math.log10(switching.seconds(moved_bytes(s, bounds), s.bandwidth)))
            groups.append(g)
            bases.append(False)
    return _encoded(seqs, rests, ys, groups, bases)


def ours_cost_inputs(states: Sequence[Scenario]) -> list[tuple[float, float, int]]:
    """Ours (`arbiter.SwitchCost`) on the same switches: bytes moved, the measured bandwidth, blocks moved."""
    return [(moved_bytes(s, bounds), min(s.seen_bandwidth), len(offline._moved(s.base, bounds))) for s in states for bounds in s.candidates]
