"""The collectives a mesh runs, measured on the real process group: all-gather, reduce-scatter and
all-reduce of a few buffer sizes, each fitted as a ring (`planning.collectives`: latency per step,
bus bandwidth), for the 2BW planner's search over tensor and shard (`Hardware.intra_collectives`).

Collective over `group` (every rank of it calls it); each size is timed on every rank and the slowest
rank's median counts (a collective ends when its last rank does). Nothing here plans.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..planning.collectives import CollectiveCosts, fit_samples

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.11 renames them
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
SIZES = (1 << 10, 1 << 16, 1 << 18, 1 << 20)  # bytes of the whole buffer


def _timed(run: callable, device: torch.device, repeats: int, warmup: int, group: Optional[dist.ProcessGroup]) -> float:
    times = []
    for i in range(warmup + repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_collectives(
    group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    sizes: Sequence[int] = SIZES,
    repeats: int = 5,
    warmup: int = 1,
) -> CollectiveCosts:
    """Every rank of `group` (None: the world) times the three collectives at `sizes` bytes on `device`
    (None: the CPU) and gets the same fits back (the slowest rank's medians)."""
    device = device or torch.device("cpu")
    ranks = dist.get_world_size(group)
    samples: dict[str, list[tuple[float, float]]] = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
    for size in sizes:
        n = max(ranks, size // 4 // ranks * ranks)  # float32 elements, a multiple of the ranks
        whole = torch.ones(n, device=device)
        part = torch.empty(n // ranks, device=device)
        runs = {
            "all_gather": lambda whole=whole, part=part: _GATHER(whole, part, group=group),
            "reduce_scatter": lambda whole=whole, part=part: _SCATTER(part, whole, group=group),
            "all_reduce": lambda whole=whole: dist.all_reduce(whole, group=group),
        }
        for kind, run in runs.items():
            samples[kind].append((n * 4.0, _timed(run, device, repeats, warmup, group)))
    flat = torch.tensor([t for kind in samples for _, t in samples[kind]], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    slowest = iter(flat.tolist())
    fits = {kind: fit_samples(kind, ranks, [(n, next(slowest)) for n, _ in rows]) for kind, rows in samples.items()}
    return CollectiveCosts(**fits, ranks=ranks, source=f"measured on {ranks} ranks ({device.type})")
