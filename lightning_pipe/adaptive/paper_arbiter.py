"""AutoPipe-RL's arbiter (§4.3) on the paper's inputs: switch to the new partition or stay.

Input: "the environment metrics described in Table 1, the current partition solution and the new
partition": the static row (L, N, O, G, P per layer), the latest iteration's dynamic row (B_i,
FP_{i,j}, BP_{i,j}) and both layer-count arrays (`paper_features`). No predicted times: unlike ours
(`arbiter.py`, which reads the predictor's outputs), the network sees only the metrics and the two
partitions. A fully connected network with hidden layers of 32 and 16; output: the logit of switching.

Reward (the paper's): the training speed of one iteration with the normalised switching cost, here
relative to staying: switch -> T_now / T_new - 1 - C / (T_now * n), stay -> 0 (C from the
switching-cost meta-network offline, measured online). Trained offline by policy gradient
(REINFORCE with a mean-reward baseline) and adapted online by the same update on every measured
reward (`online_update`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import paper_features as P


def inputs(depth: int) -> int:
    return P.static_width() + P.dynamic_width(depth) + 2 * depth


def features(static: list[float], dynamic: list[float], current: list[float], new: list[float]) -> list[float]:
    return [*static, *dynamic, *current, *new]


class PaperArbiter(nn.Module):
    def __init__(self, depth: int, lr: float = 1e-3):
        super().__init__()
        self.depth = depth
        self.net = nn.Sequential(nn.Linear(inputs(depth), 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr = lr
        self.baseline = 0.0  # running mean of the rewards (REINFORCE's baseline), kept online too
        self.optimizer: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def probability(self, x: list[float]) -> float:
        with torch.no_grad():
            return float(torch.sigmoid(self(torch.tensor([x], dtype=torch.float32)))[0])

    def switch(self, x: list[float]) -> tuple[bool, float]:
        p = self.probability(x)
        return p > 0.5, p

    def online_update(self, x: list[float], switched: bool, reward: float, steps: int = 1) -> None:
        """REINFORCE on one measured decision: raise the log-probability of the action taken in
        proportion to how much its measured reward beat the baseline; then update the baseline."""
        if self.optimizer is None:  # made at the first measured reward
            self.optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        xt = torch.tensor([x], dtype=torch.float32)
        for _ in range(steps):
            p = torch.sigmoid(self(xt))[0]
            logp = torch.log(p + 1e-8) if switched else torch.log(1 - p + 1e-8)
            loss = -(reward - self.baseline) * logp
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.baseline = 0.9 * self.baseline + 0.1 * reward

    def meta(self) -> dict[str, Any]:
        return {"kind": "paper_arbiter", "depth": self.depth, "l_max": P.L_MAX, "baseline": self.baseline}
