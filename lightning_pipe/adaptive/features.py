"""What the learned predictor and arbiter see (AutoPipe-RL §4.2, Fig. 7), as fixed-size tensors.

The paper's meta-network reads the dynamic metrics over time (an LSTM), the static metrics and the
partition. Its static inputs are per layer, which ties a trained network to one model's layer
count; ours summarises them per rank under the candidate partition instead (ours, so one network
per pipeline depth serves any model):

- sequence, one step per iteration of the window: each rank's log slowdown (measured / profiled
  compute) and each link's log bandwidth (r -> r + 1 and back, the slower);
- candidate: per rank its share of the profiled compute (the ranks' shares sum to the depth), that
  share times its median slowdown (the time it would take now), the activation bytes it sends per
  micro-batch over the link's median bandwidth (as a share of the same time unit, log1p: a slow link
  makes it range over orders of magnitude), its share of the parameters; then log(M / depth), the
  schedule (one-hot over every schedule the runtime runs, so one network per depth serves them all:
  ours), how far an advance / 2BW order runs ahead of 1F1B's, the log of the chunks' largest slowed
  share, of the busiest rank's slowed compute plus its messages, and last the log of a closed-form
  iteration time (`estimate`), which the network's output is added to (ours: it learns the
  correction). With several chunks per rank (interleaved, wave) a rank's numbers sum over its chunks.

Times are in units of T0 = M * sum of the blocks' profiled forward + backward / depth (a perfectly
balanced, bubble-free iteration), and the predictor's target is log(T / T0): scale-free, so a tiny
model and a large one share the network.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import torch

from ..schedules.spec import canonical

# every schedule the runtime runs (schedules.spec.REGISTRY), in a fixed order: the one-hot's columns
SCHEDULES = ("gpipe", "1f1b", "interleaved", "wave", "hanayo", "advance", "2bw")
DEFAULT_BANDWIDTH = 1e9  # bytes / s where a link had no measurable message
FEATURE_VERSION = 2
PRIOR = -1  # candidate column of `estimate`, which the predictor's output is added to


def sequence_width(depth: int) -> int:
    return 2 * depth - 1


def candidate_width(depth: int) -> int:
    return 4 * depth + 2 + len(SCHEDULES) + 3  # per rank x 4; M, ahead; one-hot; two bounds and the estimate


def schedule_of(schedule: Any, depth: int, microbatches: int) -> tuple[str, float]:
    """(name, `ahead`) of a schedule given by name or as a `ScheduleSpec` (its options: advance_num)."""
    if isinstance(schedule, str):
        return canonical(schedule), 0.0
    return schedule.name, ahead(schedule.name, depth, microbatches, schedule.kwargs.get("advance_num", 0))


def ahead(schedule: str, depth: int, microbatches: int, advance_num: int) -> float:
    """advance / 2BW: forwards kept ahead on the first stage beyond 1F1B's K - 1, as a share of what
    the micro-batches allow (0: 1F1B's order, 1: all forwards first); 0 for the other schedules."""
    if schedule not in ("advance", "2bw") or not advance_num:
        return 0.0
    return (advance_num - (depth - 1)) / max(1, microbatches - (depth - 1))


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
    advance: float = 0.0,
) -> list[float]:
    """`advance`: `ahead(...)` of the running order."""
    t0 = unit_time(forward, backward, microbatches, depth)
    total_params = sum(param_bytes) or 1.0
    compute, comm, params = [0.0] * depth, [0.0] * depth, [0.0] * depth
    largest = 0.0  # the chunks' largest slowed share: what a multi-chunk order's bubble scales with
    slowest_link = min(bandwidth) if len(bandwidth) else DEFAULT_BANDWIDTH
    for c, (lo, hi) in enumerate(bounds):
        r = chunk_rank[c]
        share = microbatches * sum(forward[b] + backward[b] for b in range(lo, hi)) / t0
        compute[r] += share
        largest = max(largest, share * slowdown[r])
        params[r] += sum(param_bytes[b] for b in range(lo, hi)) / total_params
        if c + 1 < len(bounds) and chunk_rank[c + 1] != r and activation_bytes:
            nxt = chunk_rank[c + 1]
            # neighbours use their link's bandwidth; an interleaved order's wrap (last rank -> rank 0)
            # crosses no measured neighbour link: the slowest is assumed
            bw = bandwidth[min(r, nxt)] if abs(r - nxt) == 1 and min(r, nxt) < len(bandwidth) else slowest_link
            comm[r] += microbatches * activation_bytes[hi - 1] / bw / t0
    slowed = [compute[r] * slowdown[r] for r in range(depth)]
    bound = max(s + m for s, m in zip(slowed, comm))
    onehot = [1.0 if schedule == s else 0.0 for s in SCHEDULES]
    logged = [math.log1p(m) for m in comm]
    tail = [math.log(microbatches / depth), advance, *onehot, math.log(largest), math.log(bound)]
    return compute + slowed + logged + params + tail + [math.log(estimate(slowed, comm, microbatches, len(bounds) // depth, schedule))]


def estimate(slowed: Sequence[float], comm: Sequence[float], microbatches: int, per_rank: int, schedule: str) -> float:
    """A closed-form iteration time in T0 units, the prior the network corrects (ours): the busiest
    rank's slowed compute, plus the flush's bubble, the other ranks' compute over M micro-batches and
    v chunks per rank (1F1B's (p - 1) / M, interleaved's (p - 1) / (v M)), plus the first
    micro-batch's messages there and back. A steady 2BW step has no flush: the busiest rank alone."""
    busiest = max(slowed)
    if schedule == "2bw":
        return busiest
    return busiest + (sum(slowed) - busiest) / (microbatches * per_rank) + 2 * sum(comm) / microbatches


def window_summary(slowdowns: Sequence[Sequence[float]], bandwidths: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Medians over the window, per rank and per link."""
    depth = len(slowdowns[0])
    slow = [statistics.median(s[r] for s in slowdowns) for r in range(depth)]
    bw = [statistics.median(b[i] for b in bandwidths) for i in range(depth - 1)]
    return slow, bw


def as_tensors(sequences: Sequence[Sequence[Sequence[float]]], candidates: Sequence[Sequence[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(sequences, dtype=torch.float32), torch.tensor(candidates, dtype=torch.float32)
