"""The arbiter (AutoPipe-RL §4.3): switch or stay, an MLP with hidden layers of 32 and 16.

Input (`arbiter_features`): the predicted iteration time of the current partition and of the best
candidate (log, in T0 units), the predicted gain, the predicted switching cost in iterations, the
iterations left and since the last switch, and how far the measured iteration is from the
prediction (the predictor's surprise). Output: the logit of switching.

It is a contextual bandit trained by policy gradient (REINFORCE with a mean baseline, `offline.py`):
each decision is one context, one action, one reward, since whether the job switches does not
change the load it will meet (the shared cluster's jobs come and go on their own) and the decision's
consequence over the iterations it affects is summed in its reward. The reward is the paper's:
the training speed after the decision minus the normalised switching cost, relative to staying:

    switch: T_now / T_new - 1 - C / (T_now * n)        stay: 0

(T: true iteration times, C: the switch's seconds, n: the iterations the decision covers).

`SwitchCost` is the second small network §4.3 describes: the switch's seconds from the bytes it
moves, the link's bandwidth and the blocks moved; trained offline on part 1's measured switches'
form (a fixed part plus bytes over bandwidth) and adapted online on every switch measured.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from . import features as F

ARBITER_INPUTS = 7


def arbiter_features(now: float, best: float, t0: float, cost: float, left: float, since: float, measured: float) -> list[float]:
    return [
        math.log(now / t0),
        math.log(best / t0),
        (now - best) / now,
        math.log10(cost / now + 1e-6),
        math.log10(1.0 + left),
        math.log10(1.0 + since),
        math.log(measured / now) if measured > 0 else 0.0,
    ]


class Arbiter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(ARBITER_INPUTS, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def switch(self, features: list[float]) -> tuple[bool, float]:
        """(switch?, probability)."""
        with torch.no_grad():
            p = float(torch.sigmoid(self(torch.tensor([features], dtype=torch.float32)))[0])
        return p > 0.5, p

    def meta(self) -> dict[str, Any]:
        return {"kind": "arbiter", "features": F.FEATURE_VERSION, "inputs": ARBITER_INPUTS}


def cost_features(moved_bytes: float, bandwidth: float, blocks: int) -> list[float]:
    return [math.log10(moved_bytes + 1.0) - 6.0, math.log10(max(bandwidth, 1.0)) - 8.0, blocks / 10.0]


class SwitchCost(nn.Module):
    """log10(seconds) of a switch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
        self.optimizer: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def seconds(self, moved_bytes: float, bandwidth: float, blocks: int) -> float:
        with torch.no_grad():
            return float(10 ** self(torch.tensor([cost_features(moved_bytes, bandwidth, blocks)], dtype=torch.float32))[0])

    def online_state(self) -> dict[str, Any]:
        """Its weights and optimizer as online adaptation left them (None: no switch measured yet)."""
        return {"net": self.state_dict(), "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_online_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["net"])
        if state["optimizer"] is not None:
            self._online_optimizer().load_state_dict(state["optimizer"])

    def _online_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:  # made at the first measured switch (or a resumed run's state)
            self.optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return self.optimizer

    def adapt(self, moved_bytes: float, bandwidth: float, blocks: int, seconds: float, steps: int = 20) -> None:
        """Online: fit the measured switch (a few steps, this sample only)."""
        optimizer = self._online_optimizer()
        x = torch.tensor([cost_features(moved_bytes, bandwidth, blocks)], dtype=torch.float32)
        y = torch.tensor([math.log10(max(seconds, 1e-6))])
        for _ in range(steps):
            loss = (self(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def meta(self) -> dict[str, Any]:
        return {"kind": "switch_cost", "features": F.FEATURE_VERSION}
