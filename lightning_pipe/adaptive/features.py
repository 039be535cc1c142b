"""What the learned predictor and arbiter see (AutoPipe-RL §4.2, Fig. 7), as fixed-size tensors.

The paper's meta-network reads the dynamic metrics over time (an LSTM), the static metrics and the
partition. Its static inputs are per layer, which ties a trained network to one model's layer
count; ours summarises them per rank under the candidate partition instead (ours, so one network
per pipeline depth serves any model):

- sequence, one step per iteration of the window: each rank's log slowdown (measured / profiled
  compute) and each link's log bandwidth (r -> r + 1 and back, the slower);
- candidate: per rank its share of the profiled compute (the ranks' shares sum to the depth), that
  share times its median slowdown (the time it would take now), the activation bytes it sends per
  micro-batch over the link's median bandwidth (as a share of the same time unit), its share of the
  parameters; then log(M / depth) and the schedule.

Times are in units of T0 = M * sum of the blocks' profiled forward + backward / depth (a perfectly
balanced, bubble-free iteration), and the predictor's target is log(T / T0): scale-free, so a tiny
model and a large one share the network.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

import torch

SCHEDULES = ("gpipe", "1f1b")
DEFAULT_BANDWIDTH = 1e9  # bytes / s where a link had no measurable message
FEATURE_VERSION = 1


def sequence_width(depth: int) -> int:
    return 2 * depth - 1


def candidate_width(depth: int) -> int:
    return 4 * depth + 1 + len(SCHEDULES)


def link_bandwidth(link_bandwidth: dict, depth: int, fallback: float) -> list[float]:
    """Per neighbour pair r, r + 1: the slower direction's achieved bandwidth (fallback when unmeasured)."""
    out = []
    for r in range(depth - 1):
        known = [v for v in (link_bandwidth.get((r, r + 1)), link_bandwidth.get((r + 1, r))) if v is not None and math.isfinite(v)]
        out.append(min(known) if known else fallback)
    return out


def sequence_row(slowdown: Sequence[float], bandwidth: Sequence[float]) -> list[float]:
    return [math.log(max(s, 1e-3)) for s in slowdown] + [math.log10(max(b, 1.0) / 1e8) for b in bandwidth]


def unit_time(forward: Sequence[float], backward: Sequence[float], microbatches: int, depth: int) -> float:
    """T0: a perfectly balanced, bubble-free iteration of the profiled blocks."""
    return microbatches * (sum(forward) + sum(backward)) / depth


def candidate_row(
    forward: Sequence[float],
    backward: Sequence[float],
    activation_bytes: Sequence[float],
    param_bytes: Sequence[float],
    bounds: Sequence[tuple[int, int]],
    chunk_rank: Sequence[int],
    depth: int,
    microbatches: int,
    slowdown: Sequence[float],
    bandwidth: Sequence[float],
    schedule: str,
) -> list[float]:
    t0 = unit_time(forward, backward, microbatches, depth)
    total_params = sum(param_bytes) or 1.0
    compute, comm, params = [0.0] * depth, [0.0] * depth, [0.0] * depth
    for c, (lo, hi) in enumerate(bounds):
        r = chunk_rank[c]
        compute[r] += microbatches * sum(forward[b] + backward[b] for b in range(lo, hi)) / t0
        params[r] += sum(param_bytes[b] for b in range(lo, hi)) / total_params
        if c + 1 < len(bounds) and chunk_rank[c + 1] != r and activation_bytes:
            link = min(r, chunk_rank[c + 1])
            bw = bandwidth[link] if link < len(bandwidth) else DEFAULT_BANDWIDTH
            comm[r] += microbatches * activation_bytes[hi - 1] / bw / t0
    slowed = [compute[r] * slowdown[r] for r in range(depth)]
    onehot = [1.0 if schedule == s else 0.0 for s in SCHEDULES]
    return compute + slowed + comm + params + [math.log(microbatches / depth)] + onehot


def window_summary(slowdowns: Sequence[Sequence[float]], bandwidths: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Medians over the window, per rank and per link."""
    depth = len(slowdowns[0])
    slow = [statistics.median(s[r] for s in slowdowns) for r in range(depth)]
    bw = [statistics.median(b[i] for b in bandwidths) for i in range(depth - 1)]
    return slow, bw


def as_tensors(sequences: Sequence[Sequence[Sequence[float]]], candidates: Sequence[Sequence[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(sequences, dtype=torch.float32), torch.tensor(candidates, dtype=torch.float32)
