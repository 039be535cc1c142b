"""The monitor (AutoPipe-RL §4.2, Table 1): static metrics once, dynamic metrics every iteration.

Static, per block, from the profile: output activation bytes O_i, input-gradient bytes G_i (the
previous block's output: what the block's backward sends back), parameter bytes P_i.
Dynamic, per iteration: each rank's forward and backward compute time (its `StepMeter`), from which
the per-block times FP_{r,j} / BP_{r,j} follow as the paper derives them: the rank's measured time
spread over blocks by the profiled ratios (the ratios are nearly constant; the speed is what
changes); and each link's achieved bandwidth: bytes over transfer time of the messages whose
receiver was waiting for them (`meter.BLOCKED`), in one clock (ranks on one host share
CLOCK_MONOTONIC; across hosts an offset to pipeline rank 0 is measured once by ping-pong).

One asynchronous `all_gather` of a small float64 vector per iteration gives every rank the same
numbers, so every rank takes the same decisions without another message; it overlaps the next
step and is read at its end, so decisions act on metrics one iteration old.
"""

from __future__ import annotations

import math
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..schedules.actions import Op, PipelineSchedule
from .meter import StepMeter

Bounds = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StaticMetrics:
    """Table 1's per-layer constants, and the profiled per-micro-batch compute (the ratios)."""

    output_bytes: tuple[float, ...]  # O_i
    input_grad_bytes: tuple[float, ...]  # G_i
    param_bytes: tuple[float, ...]  # P_i
    forward: tuple[float, ...]  # profiled seconds per micro-batch
    backward: tuple[float, ...]

    @staticmethod
    def from_profile(profile: Any) -> "StaticMetrics":
        out = tuple(float(b) for b in profile.activation_bytes)
        return StaticMetrics(out, (0.0, *out[:-1]), tuple(map(float, profile.param_bytes)), tuple(profile.forward), tuple(profile.backward))

    @property
    def num_blocks(self) -> int:
        return len(self.forward)


def blocks_of(bounds: Bounds, chunk_rank: Sequence[int], rank: int) -> list[int]:
    return [b for c, (lo, hi) in enumerate(bounds) if chunk_rank[c] == rank for b in range(lo, hi)]


@dataclass(frozen=True)
class IterationMetrics:
    """What every rank knows after iteration `step` (seconds, bytes, bytes/s)."""

    step: int
    microbatches: int
    bounds: Bounds  # the partition the iteration ran on
    chunk_rank: tuple[int, ...]
    forward_s: tuple[float, ...]  # per rank, summed over the iteration's micro-batches
    backward_s: tuple[float, ...]
    wall_s: tuple[float, ...]
    link_bytes: dict[tuple[int, int], float] = field(default_factory=dict)  # (from, to) -> bytes moved
    link_bandwidth: dict[tuple[int, int], float] = field(default_factory=dict)  # achieved; nan: no message waited for

    @property
    def ranks(self) -> int:
        return len(self.forward_s)

    def slowdown(self, static: StaticMetrics) -> tuple[float, ...]:
        """Measured compute / profiled compute of each rank's blocks (1.0: as profiled)."""
        out = []
        for r in range(self.ranks):
            mine = blocks_of(self.bounds, self.chunk_rank, r)
            predicted = self.microbatches * sum(static.forward[b] + static.backward[b] for b in mine)
            measured = self.forward_s[r] + self.backward_s[r]
            out.append(measured / predicted if predicted > 0 and measured > 0 else 1.0)
        return tuple(out)

    def block_times(self, static: StaticMetrics) -> tuple[list[list[float]], list[list[float]]]:
        """FP[r][j], BP[r][j]: seconds per micro-batch of block j were it on rank r, at rank r's
        current speed (its measured time spread by the profiled ratios)."""
        fp, bp = [], []
        for r in range(self.ranks):
            mine = blocks_of(self.bounds, self.chunk_rank, r)
            f_total = sum(static.forward[b] for b in mine) or 1.0
            b_total = sum(static.backward[b] for b in mine) or 1.0
            f_speed = self.forward_s[r] / self.microbatches / f_total
            b_speed = self.backward_s[r] / self.microbatches / b_total
            fp.append([f * f_speed for f in static.forward])
            bp.append([b * b_speed for b in static.backward])
        return fp, bp

    def bandwidth(self) -> float:
        """The slowest link's achieved bandwidth (nan when no link had a measurable message)."""
        known = [v for v in self.link_bandwidth.values() if math.isfinite(v)]
        return min(known) if known else math.nan

    def as_log(self) -> dict[str, float]:
        """Metrics for Lightning's loggers: per-stage compute ms, per-link MB/s."""
        out = {f"adaptive/stage{r}_compute_ms": (self.forward_s[r] + self.backward_s[r]) * 1e3 for r in range(self.ranks)}
        for (a, b), bw in self.link_bandwidth.items():
            if math.isfinite(bw):
                out[f"adaptive/link{a}to{b}_MBps"] = bw / 1e6
        return out


class _Layout:
    """Where each rank's stamps sit in the gathered vector, and which send each receive matches."""

    def __init__(self, schedule: PipelineSchedule):
        self.sends = [[i for i, a in enumerate(acts) if a.op.is_send] for acts in schedule.actions]
        self.recvs = [[i for i, a in enumerate(acts) if a.op.is_recv] for acts in schedule.actions]
        self.width = 3 + max(map(len, self.sends)) + 3 * max(map(len, self.recvs))
        position = [
            {(a.op, a.chunk, a.microbatch, a.peer): k for k, i in enumerate(s) for a in [acts[i]]}
            for s, acts in zip(self.sends, schedule.actions)
        ]
        self.matches: list[tuple[int, int, int, int]] = []  # (receiver, its receive slot, sender, its send slot)
        for r, acts in enumerate(schedule.actions):
            for k, i in enumerate(self.recvs[r]):
                a = acts[i]
                key = (Op.SEND_ACT, a.chunk - 1, a.microbatch, r) if a.op is Op.RECV_ACT else (Op.SEND_GRAD, a.chunk + 1, a.microbatch, r)
                if key in position[a.peer]:
                    self.matches.append((r, k, a.peer, position[a.peer][key]))

    def vector(self, rank: int, meter: StepMeter, times: tuple[float, float, float], offset: float) -> list[float]:
        v = [*times] + [math.nan] * (self.width - 3)
        for k, i in enumerate(self.sends[rank]):
            if i in meter.sends:
                v[3 + k] = meter.sends[i][0] + offset
        base = 3 + max(map(len, self.sends))
        for k, i in enumerate(self.recvs[rank]):
            if i in meter.recvs:
                done, blocked, size = meter.recvs[i]
                v[base + 3 * k : base + 3 * k + 3] = [done + offset, float(blocked), float(size)]
        return v


class Monitor:
    """Gathers each iteration's metrics on every rank of one pipeline; keeps the last `window`.

    With `replicas` > 1 pipelines side by side (width, or AvgPipe's N), global rank r being stage
    r mod ranks of replica r div ranks, the gather spans the whole job and every rank keeps the
    slowest replica's metrics, so every replica takes the same decisions (ours: AutoPipe-RL has one
    pipeline)."""

    def __init__(
        self,
        static: StaticMetrics,
        rank: int,
        ranks: int,
        group: Optional[Any],
        device: torch.device,
        to_global: Callable[[int], int],
        window: int = 5,
        replicas: int = 1,
    ):
        self.static, self.rank, self.ranks, self.group, self.device = static, rank, ranks, group, device
        self.to_global, self.replicas = to_global, replicas
        self.meter = StepMeter(device)
        self.history: deque[IterationMetrics] = deque(maxlen=window)
        self.latest: Optional[IterationMetrics] = None
        self.seconds = 0.0  # spent gathering and deriving, over the run (the monitor's overhead)
        self.iterations = 0
        self._layouts: dict[int, _Layout] = {}
        self._inflight: Optional[tuple] = None  # the last step's gather, read at the next step's end
        self.offset = clock_offset(rank, ranks, group, to_global, device)

    def begin(self, transport: Any) -> None:
        """Measure the next step run over `transport` (its executors read `transport.meter`)."""
        self.meter.reset()
        transport.meter = self.meter

    def end(self, executor: Any, step: int, microbatches: int, bounds: Bounds, chunk_rank: Sequence[int]) -> Optional[IterationMetrics]:
        """Collective over the pipeline, asynchronous: this step's numbers go out now and are read at
        the next step's end (the gather overlaps that step), so the metrics returned, the same on every
        rank, are the previous iteration's (None at the first)."""
        executor.transport.meter = None
        times = self.meter.finish()
        started = time.perf_counter()
        schedule = executor.schedule
        layout = self._layouts.get(id(schedule))
        if layout is None:
            layout = self._layouts[id(schedule)] = _Layout(schedule)
        metrics = self._collect()
        mine = layout.vector(self.rank, self.meter, times, self.offset)
        if self.ranks * self.replicas > 1:
            local = torch.tensor(mine, dtype=torch.float64, device=self.device)
            parts = [torch.empty_like(local) for _ in range(self.ranks * self.replicas)]
            group = self.group if self.replicas == 1 else None  # replicas: the whole job (the default group)
            work = dist.all_gather(parts, local, group=group, async_op=True)
            self._inflight = (work, parts, layout, step, microbatches, tuple(bounds), tuple(chunk_rank))
        else:
            self._inflight = (None, [mine], layout, step, microbatches, tuple(bounds), tuple(chunk_rank))
        self.seconds += time.perf_counter() - started
        self.iterations += 1
        return metrics

    def _collect(self) -> Optional[IterationMetrics]:
        if self._inflight is None:
            return None
        work, parts, layout, step, microbatches, bounds, chunk_rank = self._inflight
        self._inflight = None
        if work is not None:
            work.wait()
            rows = torch.stack(parts).cpu().tolist()
        else:
            rows = parts
        n = self.ranks
        replicas = [_derive(layout, rows[r * n : (r + 1) * n], step, microbatches, bounds, chunk_rank) for r in range(len(rows) // n)]
        # the slowest replica: the one with the slowest rank's compute (walls tell little: replicas that
        # reduce gradients together wait for each other); the first of equals
        metrics = max(replicas, key=lambda m: max(f + b for f, b in zip(m.forward_s, m.backward_s)))
        self.latest = metrics
        self.history.append(metrics)
        return metrics

    def flush(self) -> Optional[IterationMetrics]:
        """Read the gather in flight (before a switch, so no iteration is left unread)."""
        return self._collect()

    def clear(self) -> None:
        """After a switch: measurements of the old partition say little about the new one's links."""
        self.history.clear()


def _derive(layout: _Layout, rows: list[list[float]], step: int, m: int, bounds: Bounds, chunk_rank: tuple[int, ...]) -> IterationMetrics:
    base = 3 + max(map(len, layout.sends))
    moved: dict[tuple[int, int], float] = {}
    spent: dict[tuple[int, int], float] = {}
    counted: dict[tuple[int, int], float] = {}
    for r, k, p, j in layout.matches:
        done, blocked, size = rows[r][base + 3 * k : base + 3 * k + 3]
        issued = rows[p][3 + j]
        link = (p, r)
        if math.isfinite(size):
            moved[link] = moved.get(link, 0.0) + size
        if blocked == 1.0 and math.isfinite(issued) and done > issued:
            spent[link] = spent.get(link, 0.0) + (done - issued)
            counted[link] = counted.get(link, 0.0) + size
    bandwidth = {link: (counted[link] / spent[link] if spent.get(link) else math.nan) for link in moved}
    return IterationMetrics(
        step,
        m,
        bounds,
        chunk_rank,
        tuple(float(row[0]) for row in rows),
        tuple(float(row[1]) for row in rows),
        tuple(float(row[2]) for row in rows),
        moved,
        bandwidth,
    )


def clock_offset(
    rank: int, ranks: int, group: Optional[Any], to_global: Callable[[int], int], device: torch.device, rounds: int = 8
) -> float:
    """Seconds to add to this rank's perf_counter to read pipeline rank 0's: 0 on one host (one
    monotonic clock); else NTP's estimate from the ping-pong with the smallest round trip."""
    if ranks == 1:
        return 0.0
    hosts: list[Any] = [None] * ranks
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) == 1:
        return 0.0
    offset = 0.0
    for peer in range(1, ranks):  # one peer at a time against rank 0
        if rank == 0:
            for _ in range(rounds):
                t = torch.zeros(1, dtype=torch.float64, device=device)
                dist.recv(t, to_global(peer))
                dist.send(torch.tensor([time.perf_counter()], dtype=torch.float64, device=device), to_global(peer))
        elif rank == peer:
            best = (math.inf, 0.0)
            for _ in range(rounds):
                sent = time.perf_counter()
                dist.send(torch.zeros(1, dtype=torch.float64, device=device), to_global(0))
                t = torch.zeros(1, dtype=torch.float64, device=device)
                dist.recv(t, to_global(0))
                back = time.perf_counter()
                best = min(best, (back - sent, float(t) - (sent + back) / 2))
            offset = best[1]
    return offset
