"""The link between two ranks, measured one way: round trips of a buffer, halved.

One measurement (`round_trip`) behind both uses: `ping_pong` fits latency and bandwidth between
ranks 0 and 1 over several sizes (the benchmarks' link model), and `measure_link` times one message
size between every pair of neighbouring stages (AvgPipe's tuner's communication time).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist


def round_trip(peer: int, first: bool, buf: torch.Tensor, repeats: int, warmup: int = 0) -> float:
    """One-way seconds of `buf` between this rank and global rank `peer`: the median of `repeats`
    round trips (after `warmup` untimed ones), halved. `first`: this end sends first. The transfer
    is waited for (isend / irecv + wait, as the Transport; on CUDA the stream is synchronised too,
    since NCCL returns once the kernel is enqueued)."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        if first:
            dist.isend(buf, peer).wait()
            dist.irecv(buf, peer).wait()
        else:
            dist.irecv(buf, peer).wait()
            dist.isend(buf, peer).wait()
        if buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


def ping_pong(
    rank: int, sizes: Sequence[int] = (4, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22), repeats: int = 30, warmup: int = 5
) -> Optional[dict]:
    """Ranks 0 and 1 bounce float32 messages of ``sizes`` bytes; the others wait. Returns, on rank 0,
    ``{"latency", "bandwidth", "samples"}``: the one-way times per size and the fit ``time = latency +
    bytes / bandwidth`` (latency: the smallest message's time; bandwidth: least squares of the larger
    ones' extra time, through the origin); None on the other ranks. Collective: every rank calls it."""
    result = None
    if rank in (0, 1):
        samples = []
        for size in sizes:
            buf = torch.zeros(max(1, size // 4))
            samples.append((buf.numel() * 4, round_trip(1 - rank, rank == 0, buf, repeats, warmup)))
        if rank == 0:
            latency = samples[0][1]
            rest = [(b, t - latency) for b, t in samples[1:]]
            per_byte = sum(b * t for b, t in rest) / sum(b * b for b, _ in rest) if rest else 0.0
            result = {"latency": latency, "bandwidth": 1.0 / per_byte if per_byte > 0 else math.inf, "samples": samples}
    dist.barrier()
    return result


def measure_link(stage: int, stages: int, to_global: Callable[[int], int], nbytes: int, device: torch.device, reps: int = 7) -> float:
    """One-way seconds of an `nbytes` message between this stage and its neighbours (the larger of
    the two ends' sizes; a rank with two links averages them). Collective over the pipeline: pairs
    (0,1), (2,3), ... first, then (1,2), (3,4), ..."""
    if stages == 1:
        return 0.0
    out = []
    for phase in (0, 1):
        for left in range(phase, stages - 1, 2):
            if stage not in (left, left + 1):
                continue
            peer, first = (left + 1, True) if stage == left else (left, False)
            size = torch.tensor([nbytes], dtype=torch.int64, device=device)
            other = torch.empty_like(size)
            if first:
                dist.send(size, to_global(peer))
                dist.recv(other, to_global(peer))
            else:
                dist.recv(other, to_global(peer))
                dist.send(size, to_global(peer))
            payload = torch.zeros(max(1, int(max(nbytes, int(other.item()))) // 4), dtype=torch.float32, device=device)
            out.append(round_trip(to_global(peer), first, payload, reps))
    return statistics.fmean(out) if out else 0.0
