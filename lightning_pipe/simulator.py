"""Replay a schedule's action lists on a cost model: the timeline the runtime would produce.

The simulator runs the very lists the executor runs, with the executor's semantics: a rank does
its actions in order; a compute starts when the rank is free and its input has arrived; a send
costs the sender nothing (isend) and its message arrives `latency + bytes / bandwidth` later; a
receive is a posted buffer, so the compute that consumes the data is what waits. Nothing here
knows about torch.distributed or Lightning.

A `Timeline` holds every action's start and end and the figures planners ask for: iteration time,
per-rank busy and idle time, bubble ratio, start-up overhead (until the last stage starts
micro-batch 0), the critical path and AutoPipe's master stage, and peak stashed activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .schedules.actions import Action, Op, PipelineSchedule


@dataclass(frozen=True)
class CostModel:
    """Per-block costs of one micro-batch, and the links between ranks.

    ``forward[i]`` / ``backward[i]``: seconds for block i; ``activation_bytes[i]``: bytes of block i's
    output (what crosses a stage boundary after it); ``param_bytes[i]``: its weights. Communication
    takes ``latency + bytes / bandwidth``; ``slowdown[r]`` multiplies rank r's compute times (a
    shared or slower device).

    ``cores``: the ranks share this many processors (e.g. 4 CPU processes on 2 cores). While k
    ranks compute at once, each progresses at min(1, cores / k) of its profiled speed (processor
    sharing); a rank waiting for a message uses no core. None (the default), or at least as many
    cores as ranks: every rank has a device of its own.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation_bytes: tuple[float, ...] = ()
    param_bytes: tuple[float, ...] = ()
    bandwidth: float = math.inf  # bytes / s
    latency: float = 0.0  # s
    slowdown: tuple[float, ...] = ()
    cores: Optional[int] = None

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n == 0 or len(self.backward) != n:
            raise ValueError(f"costs: forward ({n}) and backward ({len(self.backward)}) need one time per block")
        for name in ("activation_bytes", "param_bytes"):
            values = getattr(self, name)
            if values and len(values) != n:
                raise ValueError(f"costs: {name} has {len(values)} entries for {n} blocks")
        for name in ("forward", "backward", "activation_bytes", "param_bytes"):
            bad = [v for v in getattr(self, name) if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]
            if bad:
                raise ValueError(f"costs: {name} must hold finite numbers >= 0, got {bad[:3]}")
        if not self.bandwidth > 0 or self.latency < 0 or any(not s > 0 for s in self.slowdown):
            raise ValueError("costs: bandwidth must be > 0, latency >= 0 and every slowdown > 0")
        if self.cores is not None and not (isinstance(self.cores, int) and self.cores >= 1):
            raise ValueError(f"costs: cores must be None or an integer >= 1, got {self.cores!r}")

    @property
    def num_blocks(self) -> int:
        return len(self.forward)

    @staticmethod
    def uniform(blocks: int, forward: float, backward: float, **kwargs) -> "CostModel":
        return CostModel((forward,) * blocks, (backward,) * blocks, **kwargs)

    def comm_time(self, block: int) -> float:
        size = self.activation_bytes[block] if self.activation_bytes else 0.0
        return self.latency + (size / self.bandwidth if size else 0.0)

    def factor(self, rank: int) -> float:
        return self.slowdown[rank] if rank < len(self.slowdown) else 1.0

    def shares_cores(self, ranks: int) -> bool:
        """Whether `ranks` ranks computing at once would have to share processors."""
        return self.cores is not None and self.cores < ranks


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    schedule: PipelineSchedule
    events: list[Event]  # computes, and sends as [issued, arrived] intervals
    iteration_time: float
    busy: list[float]
    startup: float
    critical_path: list[Event] = field(default_factory=list)
    master_stage: Optional[int] = None
    peak_activations: list[int] = field(default_factory=list)  # micro-batches stashed at once, per rank
    peak_activation_bytes: list[float] = field(default_factory=list)
    weight_bytes: list[float] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        return [self.iteration_time - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        """Idle share of all ranks' time: sum(idle) / (ranks x iteration time)."""
        total = self.iteration_time * len(self.busy)
        return sum(self.idle) / total if total > 0 else 0.0

    def computes(self, rank: Optional[int] = None) -> list[Event]:
        return [e for e in self.events if e.action.op.is_compute and (rank is None or e.rank == rank)]


def chunk_costs(costs: CostModel, bounds: Sequence[tuple[int, int]]) -> tuple[list[float], list[float], list[float]]:
    """Forward / backward time and boundary communication time of each chunk (block range)."""
    if bounds[-1][1] != costs.num_blocks or bounds[0][0] != 0:
        raise ValueError(f"the partition covers blocks {bounds[0][0]}..{bounds[-1][1] - 1} but the costs have {costs.num_blocks} blocks")
    for (a, b), (c, _) in zip(bounds, list(bounds[1:]) + [(costs.num_blocks, None)]):
        if not a < b or b != c:
            raise ValueError(f"the partition {list(map(tuple, bounds))} must be contiguous, non-empty block ranges")
    f = [sum(costs.forward[a:b]) for a, b in bounds]
    b_ = [sum(costs.backward[a:b]) for a, b in bounds]
    comm = [costs.comm_time(b - 1) for a, b in bounds]
    return f, b_, comm


def simulate(schedule: PipelineSchedule, costs: CostModel, bounds: Sequence[tuple[int, int]], critical_path: bool = True,
             scale: Optional[Sequence[float]] = None) -> Timeline:
    """Replay `schedule` with chunk c holding blocks ``bounds[c]`` (half-open ranges).

    ``scale[i]`` is micro-batch i's size relative to the profiled one (0.5 for a half from the
    slicer): its compute times and message sizes scale with it (a linear model of batch size)."""
    if len(bounds) != schedule.num_chunks:
        raise ValueError(f"{len(bounds)} block ranges for a schedule of {schedule.num_chunks} chunks")
    if scale is not None and len(scale) != schedule.num_microbatches:
        raise ValueError(f"scale has {len(scale)} entries for {schedule.num_microbatches} micro-batches")
    fwd, bwd, comm = chunk_costs(costs, bounds)
    if costs.shares_cores(schedule.num_ranks):
        return _simulate_shared(schedule, costs, bounds, critical_path, scale, fwd, bwd, comm)
    ranks = schedule.num_ranks
    arrival: dict[tuple, tuple[float, Optional[Event]]] = {}  # message -> (arrival time, producing compute)
    done: dict[tuple, Event] = {}  # (op, chunk, mb) -> compute event
    clock = [0.0] * ranks
    last: list[Optional[Event]] = [None] * ranks
    pointer = [0] * ranks
    events: list[Event] = []
    cause: dict[Event, Optional[Event]] = {}  # what a compute waited for last (critical path)
    busy = [0.0] * ranks
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for r in range(ranks):
            actions = schedule.actions[r]
            while pointer[r] < len(actions):
                a = actions[pointer[r]]
                c, mb = a.chunk, a.microbatch
                if a.op is Op.FORWARD or a.op is Op.BACKWARD:
                    inputs = _input(schedule, a, r, done, arrival)
                    if inputs is None:
                        break  # the message is not sent yet: another rank must advance first
                    ready, producer = inputs
                    start = max(clock[r], ready)
                    duration = (fwd[c] if a.op is Op.FORWARD else bwd[c]) * costs.factor(r) * (scale[mb] if scale is not None else 1.0)
                    event = Event(r, a, start, start + duration)
                    # the constraint that set the start; on a tie the remote one (the path toward later stages)
                    cause[event] = producer if (producer is not None and ready >= clock[r]) else last[r]
                    clock[r] = event.end
                    busy[r] += duration
                    last[r] = event
                    done[(a.op, c, mb)] = event
                    events.append(event)
                elif a.op is Op.SEND_ACT or a.op is Op.SEND_GRAD:
                    producer = done[(Op.FORWARD if a.op is Op.SEND_ACT else Op.BACKWARD, c, mb)]
                    block = bounds[c][1] - 1 if a.op is Op.SEND_ACT else bounds[c][0] - 1
                    t = comm[c] if a.op is Op.SEND_ACT else costs.comm_time(block)
                    if scale is not None and costs.activation_bytes:  # latency stays, transfer scales
                        t = costs.latency + (t - costs.latency) * scale[mb]
                    key = ("act", c, mb) if a.op is Op.SEND_ACT else ("grad", c, mb)
                    arrival[key] = (clock[r] + t, producer)
                    events.append(Event(r, a, clock[r], clock[r] + t))
                pointer[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule cannot finish (validate it first: a rank waits for a message never sent)")
    return _finish(schedule, costs, bounds, critical_path, events, clock, busy, done, cause)


def _input(schedule: PipelineSchedule, a: Any, r: int, done: dict, arrival: dict) -> Optional[tuple[float, Optional["Event"]]]:
    """(when the input of compute `a` on rank `r` is there, the event that produced it), or None
    while its message is not sent yet. Adjacent chunks on one rank hand over locally."""
    c, mb = a.chunk, a.microbatch
    if a.op is Op.FORWARD:
        need = ("act", c - 1, mb) if c > 0 else None
        local = done.get((Op.FORWARD, c - 1, mb)) if c > 0 and schedule.chunk_rank[c - 1] == r else None
    else:
        need = ("grad", c + 1, mb) if c < schedule.num_chunks - 1 else None
        local = done.get((Op.BACKWARD, c + 1, mb)) if need and schedule.chunk_rank[c + 1] == r else None
    if local is not None:
        return local.end, local
    if need is None:
        return 0.0, None
    return arrival.get(need)


def _finish(schedule: PipelineSchedule, costs: CostModel, bounds: Sequence[tuple[int, int]], critical_path: bool,
            events: list[Event], clock: list[float], busy: list[float], done: dict, cause: dict) -> Timeline:
    iteration = max(clock) if clock else 0.0
    timeline = Timeline(schedule, events, iteration, busy, _startup(schedule, done))
    _memory(timeline, costs, bounds)
    if critical_path and events:
        timeline.critical_path = _critical_path(events, cause)
        timeline.master_stage = _master_stage(timeline.critical_path, schedule)
    return timeline


def _simulate_shared(schedule: PipelineSchedule, costs: CostModel, bounds: Sequence[tuple[int, int]], critical_path: bool,
                     scale: Optional[Sequence[float]], fwd: list[float], bwd: list[float], comm: list[float]) -> Timeline:
    """`simulate` when the ranks share `costs.cores` processors: event by event in time order.

    While k ranks compute, each progresses at speed min(1, cores / k). All running computes share
    one speed, so progress is kept as a common "virtual time" V (seconds of profiled work done by
    each running compute): a compute started at V0 with work w ends when V reaches V0 + w. Equal
    finishing points are then equal floats, and simultaneous ends stay simultaneous. A rank's
    `busy` is its wall time in computes, the slow-down from sharing included."""
    ranks, cores = schedule.num_ranks, costs.cores
    arrival: dict[tuple, tuple[float, Optional[Event]]] = {}
    done: dict[tuple, Event] = {}
    clock = [0.0] * ranks  # when the rank became free
    last: list[Optional[Event]] = [None] * ranks
    pointer = [0] * ranks
    events: list[Event] = []
    cause: dict[Event, Optional[Event]] = {}
    busy = [0.0] * ranks
    running: dict[int, tuple[float, float, Action, Optional[Event], float]] = {}  # rank -> (V at end, start, action, producer, ready)
    starts: dict[int, tuple[float, Action, Optional[Event], float, float]] = {}  # rank -> (start, action, producer, ready, work): input in flight
    now = virtual = 0.0
    remaining = sum(len(a) for a in schedule.actions)
    while remaining or running:
        # at `now`: let every free rank issue its sends and start what it can, until nothing moves
        progressed = True
        while progressed:
            progressed = False
            for r in range(ranks):
                if r in running:
                    continue
                if r in starts:
                    start, a, producer, ready, work = starts[r]
                    if start > now:
                        continue
                    del starts[r]
                    running[r] = (virtual + work, start, a, producer, ready)
                    remaining -= 1
                    progressed = True
                    continue
                actions = schedule.actions[r]
                while pointer[r] < len(actions):
                    a = actions[pointer[r]]
                    c, mb = a.chunk, a.microbatch
                    if a.op is Op.FORWARD or a.op is Op.BACKWARD:
                        inputs = _input(schedule, a, r, done, arrival)
                        if inputs is None:
                            break  # not sent yet
                        ready, producer = inputs
                        work = (fwd[c] if a.op is Op.FORWARD else bwd[c]) * costs.factor(r) * (scale[mb] if scale is not None else 1.0)
                        pointer[r] += 1
                        start = max(clock[r], ready)
                        if start > now:  # the input is in flight: the rank starts when it lands
                            starts[r] = (start, a, producer, ready, work)
                        else:
                            running[r] = (virtual + work, now, a, producer, ready)
                            remaining -= 1
                        progressed = True
                        break
                    if a.op is Op.SEND_ACT or a.op is Op.SEND_GRAD:
                        producer = done[(Op.FORWARD if a.op is Op.SEND_ACT else Op.BACKWARD, c, mb)]
                        block = bounds[c][1] - 1 if a.op is Op.SEND_ACT else bounds[c][0] - 1
                        t = comm[c] if a.op is Op.SEND_ACT else costs.comm_time(block)
                        if scale is not None and costs.activation_bytes:
                            t = costs.latency + (t - costs.latency) * scale[mb]
                        key = ("act", c, mb) if a.op is Op.SEND_ACT else ("grad", c, mb)
                        arrival[key] = (clock[r] + t, producer)
                        events.append(Event(r, a, clock[r], clock[r] + t))
                    pointer[r] += 1
                    remaining -= 1
                    progressed = True
        if not running:
            if not starts:
                if remaining:
                    raise ValueError("the schedule cannot finish (validate it first: a rank waits for a message never sent)")
                break
            now = min(s[0] for s in starts.values())  # idle until the next input lands
            continue
        # advance to the next end of a compute or the next start, whichever comes first
        speed = min(1.0, cores / len(running))
        first_end = min(v for v, *_ in running.values())
        t_end = now + (first_end - virtual) / speed
        t_start = min((s[0] for s in starts.values()), default=math.inf)
        if t_start < t_end:
            virtual += (t_start - now) * speed
            now = t_start
            continue
        now, virtual = t_end, first_end
        for r in [r for r, run in running.items() if run[0] == first_end]:
            _, start, a, producer, ready = running.pop(r)
            event = Event(r, a, start, now)
            cause[event] = producer if (producer is not None and ready >= clock[r]) else last[r]
            clock[r] = now
            busy[r] += now - start
            last[r] = event
            done[(a.op, a.chunk, a.microbatch)] = event
            events.append(event)
    return _finish(schedule, costs, bounds, critical_path, events, clock, busy, done, cause)


def _startup(schedule: PipelineSchedule, done: dict) -> float:
    last = schedule.num_chunks - 1
    first = done.get((Op.FORWARD, last, 0))
    return first.start if first is not None else 0.0


def _critical_path(events: list[Event], cause: dict) -> list[Event]:
    end = max((e for e in events if e.action.op.is_compute), key=lambda e: (e.end, e.rank))
    path = [end]
    while cause.get(path[-1]) is not None:
        path.append(cause[path[-1]])
    return path[::-1]


def _master_stage(path: list[Event], schedule: PipelineSchedule) -> Optional[int]:
    """AutoPipe's master stage: the stage the critical path runs along in the 1F1B phase, i.e. where
    it takes a backward and then a forward back to back on one rank; nearest the last stage on ties."""
    counts: dict[int, int] = {}
    for prev, nxt in zip(path, path[1:]):
        if prev.rank == nxt.rank and prev.action.op is Op.BACKWARD and nxt.action.op is Op.FORWARD:
            counts[prev.rank] = counts.get(prev.rank, 0) + 1
        elif prev.rank == nxt.rank and prev.action.op is Op.FORWARD and nxt.action.op is Op.BACKWARD:
            counts[prev.rank] = counts.get(prev.rank, 0) + 1
    if not counts:
        return max(path, key=lambda e: (e.end - e.start, e.rank)).rank if path else None
    best = max(counts.values())
    return max(r for r, n in counts.items() if n == best)


def _memory(t: Timeline, costs: CostModel, bounds: Sequence[tuple[int, int]]) -> None:
    """Peak micro-batches whose activations a rank holds for backward, and their bytes (every block's
    output in the chunk is kept: the autograd graph's saved tensors, approximately)."""
    ranks = t.schedule.num_ranks
    per_chunk = [sum(costs.activation_bytes[a:b]) if costs.activation_bytes else 0.0 for a, b in bounds]
    t.peak_activations, t.peak_activation_bytes = [0] * ranks, [0.0] * ranks
    for r in range(ranks):
        live = peak = 0
        live_bytes = peak_bytes = 0.0
        for a in t.schedule.actions[r]:
            if a.op is Op.FORWARD and t.schedule.backward:
                live, live_bytes = live + 1, live_bytes + per_chunk[a.chunk]
            elif a.op is Op.BACKWARD:
                live, live_bytes = live - 1, live_bytes - per_chunk[a.chunk]
            peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
        t.peak_activations[r], t.peak_activation_bytes[r] = peak, peak_bytes
    t.weight_bytes = [
        sum(sum(costs.param_bytes[a:b]) if costs.param_bytes else 0.0 for c, (a, b) in enumerate(bounds) if t.schedule.chunk_rank[c] == r)
        for r in range(ranks)
    ]
