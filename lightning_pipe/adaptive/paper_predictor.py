"""AutoPipe-RL's meta-networks (Fig. 7) on the paper's per-layer inputs (`paper_features`).

`MetaNetwork`: an LSTM over the dynamic metrics of the window (B_i, FP_{i,j}, BP_{i,j} per
iteration), then fully connected layers over its last state, the static metrics (L, N, O, G, P)
and partition arrays -> one number. Two of them, as §4.2-4.3 describe:

- the speed predictor: one partition's layer-count array -> log(T / T0) (T: the iteration's time;
  the training speed is its inverse);
- the switching cost ("a similar meta-network as the speed prediction model"): the current and the
  new layer-count arrays -> log10(seconds) of the switch.

Both are meta-learned across environments (`meta.reptile`), trained offline, and adapted online by
the same few steps (`meta.adapt`) on the running job's measurements (`paper_offline.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import paper_features as P


class MetaNetwork(nn.Module):
    def __init__(self, depth: int, partitions: int, kind: str, hidden: int = 32):
        super().__init__()
        self.depth, self.partitions, self.kind, self.hidden = depth, partitions, kind, hidden
        self.lstm = nn.LSTM(P.dynamic_width(depth), hidden, batch_first=True)
        width = hidden + P.static_width() + partitions * depth
        self.head = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, sequence: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """sequence (B, W, dynamic_width), rest (B, static_width + partitions * N) -> (B,)."""
        _, (h, _) = self.lstm(sequence)
        return self.head(torch.cat([h[-1], rest], dim=1)).squeeze(1)

    def meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "depth": self.depth, "hidden": self.hidden, "l_max": P.L_MAX, "partitions": self.partitions}


def speed_predictor(depth: int) -> MetaNetwork:
    return MetaNetwork(depth, 1, "paper_speed_predictor")


def switch_cost(depth: int) -> MetaNetwork:
    return MetaNetwork(depth, 2, "paper_switch_cost")


def mse(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The loss of both (the paper names none): squared error of the log target."""
    sequence, rest, target = batch
    return (model(sequence, rest) - target).pow(2).mean()
