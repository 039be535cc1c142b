"""The speed predictor (AutoPipe-RL §4.2, Fig. 7): an LSTM over the window of dynamic metrics, then
fully connected layers with the candidate's static metrics and partition -> log(T / T0).

`SpeedPredictor` is the network; `LearnedScorer` is part 1's `Scorer` interface over it (so the
rule or the arbiter can use it), with the online adaptation the paper describes (transfer
learning): the running job's measured iterations go into a replay buffer and a few gradient steps
fine-tune the network's output layer between steps (ours: only that layer, since the job only ever
measures the partitions it runs). Weight files carry their depth and feature version; a file
that cannot be read or does not match is refused naming it.
"""

from __future__ import annotations

import math
import random
from collections import deque
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from . import features as F
from .monitor import IterationMetrics, StaticMetrics

WEIGHTS = Path(__file__).with_name("weights")


class SpeedPredictor(nn.Module):
    def __init__(self, depth: int, hidden: int = 32):
        super().__init__()
        self.depth, self.hidden = depth, hidden
        self.lstm = nn.LSTM(F.sequence_width(depth), hidden, batch_first=True)
        self.head = nn.Sequential(
            nn.Linear(hidden + F.candidate_width(depth), 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1)
        )
        # training starts from the prior itself (a correction of 0), which already orders most candidates
        nn.init.zeros_(self.head[-1].weight)
        nn.init.zeros_(self.head[-1].bias)

    def forward(self, sequence: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """sequence (B, W, 2d - 1), candidate (B, `F.candidate_width(d)`) -> predicted log(T / T0), (B,)."""
        _, (h, _) = self.lstm(sequence)
        # ours: the network learns the correction to a closed-form estimate (`features.estimate`), so a
        # partition unlike the training set's is still predicted at the right scale
        return self.head(torch.cat([h[-1], candidate], dim=1)).squeeze(1) + candidate[:, F.PRIOR]

    def meta(self) -> dict[str, Any]:
        return {"kind": "speed_predictor", "depth": self.depth, "hidden": self.hidden, "features": F.FEATURE_VERSION}


def save(module: nn.Module, path: Path, **extra: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"meta": {**module.meta(), **extra}, "state": module.state_dict()}, path)


def load_file(path: Path, kind: str, **expected: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, state) of a weights file, refused with its name when unreadable or not what is expected."""
    if not path.is_file():
        raise FileNotFoundError(
            f"adaptive weights {path}: no such file (train them: python -m lightning_pipe.adaptive.offline --out {path.parent})"
        )
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        meta, state = blob["meta"], blob["state"]
    except Exception as error:  # truncated, not a torch file, another layout
        raise ValueError(
            f"adaptive weights {path}: cannot be read as a lightning-pipe weights file ({type(error).__name__}: {error})"
        ) from None
    wanted = {"kind": kind, "features": F.FEATURE_VERSION, **expected}
    wrong = {k: (meta.get(k), v) for k, v in wanted.items() if meta.get(k) != v}
    if wrong:
        said = ", ".join(f"{k} is {got!r}, needed {want!r}" for k, (got, want) in wrong.items())
        raise ValueError(f"adaptive weights {path}: {said}")
    return meta, state


def load_predictor(folder: Optional[Path], depth: int) -> SpeedPredictor:
    path = (folder or WEIGHTS) / f"predictor_d{depth}.pt"
    meta, state = load_file(path, "speed_predictor", depth=depth)
    model = SpeedPredictor(depth, meta["hidden"])
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise ValueError(f"adaptive weights {path}: the tensors do not fit the predictor ({error})") from None
    return model.eval()


class LearnedScorer:
    """`Scorer` over the predictor, adapted online to the running job."""

    def __init__(
        self,
        predictor: SpeedPredictor,
        static: StaticMetrics,
        schedule: Any,
        microbatches: int,
        steps: int = 2,
        buffer: int = 256,
        lr: float = 1e-3,
        seed: int = 0,
    ):
        self.predictor, self.static, self.m = predictor, static, microbatches
        self.depth = predictor.depth
        # the running schedule's name and order (a name, or a ScheduleSpec with its options): inputs
        # of every prediction, since one network per depth predicts all the schedules
        self.schedule, self.advance = F.schedule_of(schedule, self.depth, microbatches)
        self.steps = steps
        self.replay: deque[tuple[list, list, float]] = deque(maxlen=buffer)
        # transfer learning: the job's own iterations fine-tune the output layer only; the features the
        # offline network learned (how slowdowns, compute and links make an iteration) stay as trained
        self.optimizer = torch.optim.Adam(predictor.head[-1].parameters(), lr=lr)
        self.random = random.Random(seed)
        self.adapted = 0  # gradient steps taken online

    # ---- features from the monitor -----------------------------------------------------------
    def _window(self, window: Sequence[IterationMetrics]) -> tuple[list[list[float]], list[float], list[float]]:
        slows = [list(m.slowdown(self.static)) for m in window]
        bws = [F.link_bandwidth(m.link_bandwidth, self.depth, F.DEFAULT_BANDWIDTH) for m in window]
        rows = [F.sequence_row(s, b) for s, b in zip(slows, bws)]
        slow, bw = F.window_summary(slows, bws)
        return rows, slow, bw

    def _candidate(self, bounds: Any, chunk_rank: Sequence[int], slow: list[float], bw: list[float]) -> list[float]:
        s = self.static
        return F.candidate_row(
            s.forward,
            s.backward,
            s.output_bytes,
            s.param_bytes,
            bounds,
            chunk_rank,
            self.depth,
            self.m,
            slow,
            bw,
            self.schedule,
            self.advance,
        )

    def _t0(self) -> float:
        return F.unit_time(self.static.forward, self.static.backward, self.m, self.depth)

    # ---- Scorer ----------------------------------------------------------------------------------
    def __call__(self, window: Sequence[IterationMetrics], schedule: Any, bounds: Any) -> float:
        return self.score_many(window, [bounds], window[-1].chunk_rank)[0]

    def score_many(self, window: Sequence[IterationMetrics], candidates: Sequence[Any], chunk_rank: Sequence[int]) -> list[float]:
        """Predicted seconds per iteration of every candidate, in one batch."""
        rows, slow, bw = self._window(window)
        cands = [self._candidate(c, chunk_rank, slow, bw) for c in candidates]
        seq, cand = F.as_tensors([rows] * len(cands), cands)
        with torch.no_grad():
            out = self.predictor(seq, cand)
        return [math.exp(float(y)) * self._t0() for y in out]

    # ---- online adaptation -------------------------------------------------------------------------
    def observe(self, window: Sequence[IterationMetrics], measured_s: float) -> None:
        """Keep an iteration the job ran: the window up to it, its partition, its measured time."""
        rows, slow, bw = self._window(window)
        latest = window[-1]
        self.replay.append((rows, self._candidate(latest.bounds, latest.chunk_rank, slow, bw), math.log(measured_s / self._t0())))

    def state_dict(self) -> dict[str, Any]:
        """What online adaptation has changed since the shipped weights: the predictor, its optimizer,
        the replay buffer and the sampler's state, so a resumed run adapts on as the first would have."""
        return {
            "predictor": self.predictor.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "replay": list(self.replay),
            "random": self.random.getstate(),
            "adapted": self.adapted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.predictor.load_state_dict(state["predictor"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.replay.clear()
        self.replay.extend(state["replay"])
        self.random.setstate(state["random"])
        self.adapted = state["adapted"]

    def adapt(self, batch: int = 16) -> None:
        """A few gradient steps on the replay buffer (transfer learning from the offline weights)."""
        if len(self.replay) < 2:
            return
        self.predictor.train()
        lengths = {len(r[0]) for r in self.replay}
        for _ in range(self.steps):
            size = max(lengths)  # one window length per batch (the LSTM takes equal lengths)
            pool = [r for r in self.replay if len(r[0]) == size]
            sample = [self.random.choice(pool) for _ in range(min(batch, len(pool)))]
            seq, cand = F.as_tensors([s[0] for s in sample], [s[1] for s in sample])
            target = torch.tensor([s[2] for s in sample])
            loss = torch.nn.functional.mse_loss(self.predictor(seq, cand), target)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.adapted += 1
        self.predictor.eval()
