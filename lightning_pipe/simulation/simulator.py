"""Replay a schedule's action lists on a cost model: the timeline the runtime would produce.

The simulator runs the very lists the executor runs, with the executor's semantics: a rank does
its actions in order; a compute starts when the rank is free and its input has arrived; a send
costs the sender nothing (isend) and its message arrives `latency + bytes / bandwidth` later; a
receive is a posted buffer, so the compute that consumes the data is what waits. Nothing here
knows about torch.distributed or Lightning.

A `Timeline` holds every action's start and end and the figures planners ask for: iteration time,
per-rank busy and idle time, bubble ratio, start-up overhead (until the last stage starts
micro-batch 0), the critical path and AutoPipe's master stage, and peak stashed activations.

This module is the one definition of the timing model. The planners' fast path,
`planning/replay.py`, compiles a schedule once and replays it for many partitions, but takes its
chunk costs (`chunk_costs`), input dependencies (`input_source`), critical path
(`trace_critical_path`) and master-stage rule (`master_stage`) from here, so the two cannot drift
apart; tests/test_one_simulator.py checks they agree on every schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..schedules.actions import Action, Op, PipelineSchedule
from .costs import CostModel


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
    # how pictures name the schedule's micro-batches (empty: their numbers); the slicer's halves are "3a", "3b"
    microbatch_labels: list[str] = field(default_factory=list)

    def microbatch_label(self, microbatch: int) -> str:
        return self.microbatch_labels[microbatch] if self.microbatch_labels else str(microbatch)

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


def chunk_costs(
    costs: CostModel, bounds: Sequence[tuple[int, int]], ranks: Optional[Sequence[int]] = None
) -> tuple[list[float], list[float], list[float]]:
    """Forward / backward time and boundary communication time of each chunk (block range).

    ``comm[c]`` is a message across the boundary after chunk c, either way: chunk c's activation
    going up, or the gradient of that same tensor coming back. With ``ranks`` (the rank holding
    each chunk, ``schedule.chunk_rank``) the compute times include that rank's slowdown.
    `simulate` and the planners' `Replay` both take their costs from here, so they add the same
    floats in the same order."""
    n = costs.num_blocks
    if bounds[-1][1] != n or bounds[0][0] != 0:
        raise ValueError(f"the partition covers blocks {bounds[0][0]}..{bounds[-1][1] - 1} but the costs have {n} blocks")
    # one pass, checks and sums together: the planners call this for every partition they try, so a
    # block range's sums are kept on the cost model (the same floats as summing again: not prefix sums,
    # whose differences would round differently and could break the planners' exact ties)
    ranges = costs._ranges
    f, b_, comm = [], [], []
    edge = 0
    for a, b in bounds:
        if a != edge or not a < b:
            raise ValueError(f"the partition {list(map(tuple, bounds))} must be contiguous, non-empty block ranges")
        known = ranges.get((a, b))
        if known is None:
            known = ranges[(a, b)] = (sum(costs.forward[a:b]), sum(costs.backward[a:b]), costs.comm_time(b - 1))
        f.append(known[0])
        b_.append(known[1])
        comm.append(known[2])
        edge = b
    if ranks is not None and costs.slowdown:  # without slowdowns every factor is 1.0: x * 1.0 == x
        factors = [costs.factor(r) for r in ranks]
        f = [t * s for t, s in zip(f, factors)]
        b_ = [t * s for t, s in zip(b_, factors)]
    return f, b_, comm


def split_costs(
    costs: CostModel, bounds: Sequence[tuple[int, int]], ranks: Optional[Sequence[int]] = None
) -> tuple[list[float], list[float]]:
    """Input-gradient (BI) and weight-gradient (W) time of each chunk (slowdown included): the blocks'
    measured BI and W (`CostModel.backward_input`, `weight`); with W alone, BI is the rest of the
    backward; with neither, half each (the paper's T_B = T_W). The first chunk's input is data, not
    an activation: its BI has nothing to compute and its W is all of its backward, as the executor runs it."""
    _, backward, _ = chunk_costs(costs, bounds, ranks)
    bi, w = [], []
    for c, ((a, b), total) in enumerate(zip(bounds, backward)):
        if costs.backward_input:  # measured split: its own total
            factor = costs.factor(ranks[c]) if ranks is not None and costs.slowdown else 1.0
            total = (sum(costs.backward_input[a:b]) + sum(costs.weight[a:b])) * factor
            share = sum(costs.weight[a:b]) * factor / total if total > 0 else 0.5
        else:
            share = sum(costs.weight[a:b]) / max(sum(costs.backward[a:b]), 1e-300) if costs.weight else 0.5
        first = a == 0
        w.append(total if first else total * min(share, 1.0))
        bi.append(0.0 if first else total - w[-1])
    return bi, w


# ---- what a compute waits for, and the critical path: one definition for `simulate` and `Replay` ----
#
# `planning/replay.py` compiles a schedule once and replays it for many partitions; it does not
# re-implement these rules but calls them, over the same representation: the computes as indices
# 0..n-1 with parallel lists: rank, forward?, start, end, when the rank was free for it, when its
# input was ready, the compute that produced the input and the rank's compute before (None: none).


def message_of(a: Action) -> tuple[str, int, int]:
    """The key of the message a send carries: ("act" | "grad", sending chunk, micro-batch)."""
    return ("act" if a.op is Op.SEND_ACT else "grad", a.chunk, a.microbatch)


def produced_by(message: tuple[str, int, int]) -> tuple[Op, int, int]:
    """The compute whose output a message carries, as (op, chunk, micro-batch)."""
    kind, c, mb = message
    return (Op.FORWARD if kind == "act" else Op.BACKWARD, c, mb)  # a split backward's BI answers to B's key


def done_key(a: Action) -> tuple[Op, int, int]:
    """The key a compute is known by to what consumes it: a BI by its backward's (B's), since it
    produces what B would hand to the previous chunk (a micro-batch's backward is B or BI + W)."""
    return (Op.BACKWARD if a.op is Op.BACKWARD_INPUT else a.op, a.chunk, a.microbatch)


def input_source(schedule: PipelineSchedule, a: Action, r: int) -> Optional[tuple[bool, tuple]]:
    """Where compute `a` on rank `r` takes its input from: None when it is there from the start
    (the first chunk's forward, the last chunk's backward, a W: its BI ran before it on this rank);
    (True, (op, chunk, mb)) for a hand-over from the adjacent chunk on the same rank (no message;
    a BI is keyed as B, `done_key`); (False, message) otherwise."""
    c, mb = a.chunk, a.microbatch
    if a.op is Op.BACKWARD_WEIGHT:
        return None
    if a.op is Op.FORWARD:
        if c == 0:
            return None
        return (True, (Op.FORWARD, c - 1, mb)) if schedule.chunk_rank[c - 1] == r else (False, ("act", c - 1, mb))
    if c == schedule.num_chunks - 1:
        return None
    return (True, (Op.BACKWARD, c + 1, mb)) if schedule.chunk_rank[c + 1] == r else (False, ("grad", c + 1, mb))


def trace_critical_path(
    end: Sequence[float],
    rank: Sequence[int],
    free: Sequence[float],
    ready: Sequence[float],
    producer: Sequence[Optional[int]],
    previous: Sequence[Optional[int]],
) -> list[int]:
    """The critical path as compute indices, first to last: from the compute that ends last (ties:
    the later rank, then the lowest index) back through what each one waited for last, which is
    the producer of its input when that set the start (its input was ready no earlier than its rank
    was free; on a tie the remote one: the path toward later stages), else the rank's previous
    compute. Applied here, along the path only, so the loops just record `free` and `ready`."""
    if not end:
        return []
    latest = max(end)
    first = end.index(latest)
    tied = [k for k in range(first, len(end)) if end[k] == latest]
    top = max(rank[k] for k in tied)
    k: Optional[int] = next(k for k in tied if rank[k] == top)
    path = []
    while k is not None:
        path.append(k)
        k = producer[k] if producer[k] is not None and ready[k] >= free[k] else previous[k]
    return path[::-1]


def master_stage(
    path: Sequence[int], rank: Sequence[int], forward: Sequence[bool], start: Sequence[float], end: Sequence[float]
) -> Optional[int]:
    """AutoPipe's master stage: the stage the critical path runs along in the 1F1B phase, i.e. where
    it takes a backward and a forward back to back on one rank most often; nearest the last stage on
    ties. With no such turn (GPipe-like paths, forward only), the rank of the longest compute on
    the path (ties: the later rank, then the earlier compute)."""
    counts: dict[int, int] = {}
    for i, j in zip(path, path[1:]):
        if rank[i] == rank[j] and forward[i] != forward[j]:
            counts[rank[i]] = counts.get(rank[i], 0) + 1
    if not counts:
        return rank[max(path, key=lambda i: (end[i] - start[i], rank[i]))] if path else None
    best = max(counts.values())
    return max(r for r, n in counts.items() if n == best)


class _Run:
    """The state `simulate`'s two loops (own devices, shared cores) share, and the steps they take
    alike: a compute's work, a send, a compute's completion, and the finished `Timeline`. They
    differ only in when a compute ends."""

    def __init__(
        self,
        schedule: PipelineSchedule,
        costs: CostModel,
        bounds: Sequence[tuple[int, int]],
        scale: Optional[Sequence[float]],
        delays: Optional[Callable[[], float]] = None,
    ):
        self.schedule, self.costs, self.bounds, self.scale, self.delays = schedule, costs, bounds, scale, delays
        self.fwd, self.bwd, self.comm = chunk_costs(costs, bounds, schedule.chunk_rank)
        self.bi, self.w = split_costs(costs, bounds, schedule.chunk_rank)
        ranks = schedule.num_ranks
        self.arrival: dict[tuple, tuple[float, Optional[int]]] = {}  # message -> (arrival time, producing compute)
        self.done: dict[tuple, int] = {}  # (op, chunk, mb) -> compute index
        self.computes: list[Event] = []
        # per compute, for the critical path: when its rank was free, when its input was there, the
        # compute that produced the input and the rank's compute before (None: none)
        self.free: list[float] = []
        self.ready: list[float] = []
        self.producer: list[Optional[int]] = []
        self.previous: list[Optional[int]] = []
        self.events: list[Event] = []  # computes, and sends as [issued, arrived] intervals
        self.clock = [0.0] * ranks  # when the rank became free
        self.last: list[Optional[int]] = [None] * ranks
        self.busy = [0.0] * ranks
        self.pointer = [0] * ranks
        self.remaining = sum(len(a) for a in schedule.actions)
        # sends and receives a rank issued since its last compute: their thread time (`message_gap`)
        self.overheads = costs.has_message_overheads
        self.sends = [0] * ranks
        self.recvs = [0] * ranks

    def input(self, a: Action, r: int) -> Optional[tuple[float, Optional[int]]]:
        """(when compute `a`'s input is there, the compute that produced it), or None while its
        message is not sent yet (or its local producer has not run)."""
        source = input_source(self.schedule, a, r)
        if source is None:
            return 0.0, None
        local, key = source
        if not local:
            return self.arrival.get(key)
        k = self.done.get(key)
        return None if k is None else (self.computes[k].end, k)

    def work(self, a: Action) -> float:
        """Seconds of profiled compute (slowdown included, scaled by the micro-batch's size)."""
        t = {Op.FORWARD: self.fwd, Op.BACKWARD: self.bwd, Op.BACKWARD_INPUT: self.bi, Op.BACKWARD_WEIGHT: self.w}[a.op][a.chunk]
        return t * self.scale[a.microbatch] if self.scale is not None else t

    def free_at(self, r: int) -> float:
        """When rank r's thread is done with the sends and receives issued since its last compute."""
        if not self.overheads:
            return self.clock[r]
        return self.clock[r] + self.costs.message_gap(self.sends[r], self.recvs[r])

    def recv(self, r: int) -> None:
        self.recvs[r] += 1

    def send(self, r: int, a: Action) -> None:
        """Leaves once the sender's thread has issued it; arrives a transfer later (the fixed part,
        latency and hand-off delay, does not scale with the micro-batch)."""
        t = self.comm[a.chunk] if a.op is Op.SEND_ACT else self.comm[a.chunk - 1]
        if self.scale is not None and self.costs.activation_bytes:
            fixed = self.costs.fixed_comm
            t = fixed + (t - fixed) * self.scale[a.microbatch]
        if self.delays is not None:
            t += self.delays()
        self.sends[r] += 1
        leave = self.free_at(r)
        message = message_of(a)
        self.arrival[message] = (leave + t, self.done[produced_by(message)])
        self.events.append(Event(r, a, leave, leave + t))

    def complete(self, r: int, a: Action, start: float, end: float, spent: float, producer: Optional[int], ready: float) -> None:
        k = len(self.computes)
        event = Event(r, a, start, end)
        self.free.append(self.free_at(r))
        self.sends[r] = self.recvs[r] = 0
        self.ready.append(ready)
        self.producer.append(producer)
        self.previous.append(self.last[r])
        self.clock[r] = end
        self.busy[r] += spent
        self.last[r] = k
        self.done[done_key(a)] = k
        self.computes.append(event)
        self.events.append(event)

    def timeline(self, critical_path: bool) -> Timeline:
        schedule, computes = self.schedule, self.computes
        first = self.done.get((Op.FORWARD, schedule.num_chunks - 1, 0))  # start-up: the last stage starts micro-batch 0
        startup = computes[first].start if first is not None else 0.0
        if self.overheads:  # what each rank's thread still spends on messages after its last compute
            self.clock = [self.free_at(r) for r in range(len(self.clock))]
        timeline = Timeline(schedule, self.events, max(self.clock) if self.clock else 0.0, self.busy, startup)
        _memory(timeline, self.costs, self.bounds)
        if critical_path and self.events:
            rank = [e.rank for e in computes]
            start, end = [e.start for e in computes], [e.end for e in computes]
            path = trace_critical_path(end, rank, self.free, self.ready, self.producer, self.previous)
            timeline.critical_path = [computes[k] for k in path]
            timeline.master_stage = master_stage(path, rank, [e.action.op is Op.FORWARD for e in computes], start, end)
        return timeline


def simulate(
    schedule: PipelineSchedule,
    costs: CostModel,
    bounds: Sequence[tuple[int, int]],
    critical_path: bool = True,
    scale: Optional[Sequence[float]] = None,
    delays: Optional[Callable[[], float]] = None,
) -> Timeline:
    """Replay `schedule` with chunk c holding blocks ``bounds[c]`` (half-open ranges).

    ``scale[i]`` is micro-batch i's size relative to the profiled one (0.5 for a half from the
    slicer): its compute times and message sizes scale with it (a linear model of batch size).
    ``delays()``: seconds added to each message on top of the cost model's, drawn anew per message
    (e.g. hand-offs sampled from a measured distribution, with the model's mean hand-off at 0)."""
    if len(bounds) != schedule.num_chunks:
        raise ValueError(f"{len(bounds)} block ranges for a schedule of {schedule.num_chunks} chunks")
    if scale is not None and len(scale) != schedule.num_microbatches:
        raise ValueError(f"scale has {len(scale)} entries for {schedule.num_microbatches} micro-batches")
    run = _Run(schedule, costs, bounds, scale, delays)
    if costs.shares_cores(schedule.num_ranks):
        return _simulate_shared(run, critical_path)
    pointer = run.pointer
    while run.remaining:
        progressed = False
        for r, actions in enumerate(schedule.actions):
            while pointer[r] < len(actions):
                a = actions[pointer[r]]
                if a.op.is_compute:
                    inputs = run.input(a, r)
                    if inputs is None:
                        break  # the message is not sent yet: another rank must advance first
                    ready, producer = inputs
                    start = max(run.free_at(r), ready)
                    duration = run.work(a)
                    run.complete(r, a, start, start + duration, duration, producer, ready)
                elif a.op.is_send:
                    run.send(r, a)
                elif a.op.is_recv:
                    run.recv(r)
                pointer[r] += 1
                run.remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule cannot finish (validate it first: a rank waits for a message never sent)")
    return run.timeline(critical_path)


def _simulate_shared(run: _Run, critical_path: bool) -> Timeline:
    """`simulate` when the ranks share `costs.cores` processors: event by event in time order.

    While k ranks compute, each progresses at speed min(1, cores / k). All running computes share
    one speed, so progress is kept as a common "virtual time" V (seconds of profiled work done by
    each running compute): a compute started at V0 with work w ends when V reaches V0 + w. Equal
    finishing points are then equal floats, and simultaneous ends stay simultaneous. A rank's
    `busy` is its wall time in computes, the slow-down from sharing included."""
    schedule, cores = run.schedule, run.costs.cores
    ranks, pointer = schedule.num_ranks, run.pointer
    running: dict[int, tuple[float, float, Action, Optional[int], float]] = {}  # rank -> (V at end, start, action, producer, ready)
    starts: dict[
        int, tuple[float, Action, Optional[int], float, float]
    ] = {}  # rank -> (start, action, producer, ready, work): input in flight
    now = virtual = 0.0
    while run.remaining or running:
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
                    run.remaining -= 1
                    progressed = True
                    continue
                actions = schedule.actions[r]
                while pointer[r] < len(actions):
                    a = actions[pointer[r]]
                    if a.op.is_compute:
                        inputs = run.input(a, r)
                        if inputs is None:
                            break  # not sent yet
                        ready, producer = inputs
                        work = run.work(a)
                        pointer[r] += 1
                        start = max(run.free_at(r), ready)
                        if start > now:  # the input is in flight: the rank starts when it lands
                            starts[r] = (start, a, producer, ready, work)
                        else:
                            running[r] = (virtual + work, now, a, producer, ready)
                            run.remaining -= 1
                        progressed = True
                        break
                    if a.op.is_send:
                        run.send(r, a)
                    elif a.op.is_recv:
                        run.recv(r)
                    pointer[r] += 1
                    run.remaining -= 1
                    progressed = True
        if not running:
            if not starts:
                if run.remaining:
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
        for r in [r for r, run_ in running.items() if run_[0] == first_end]:
            _, start, a, producer, ready = running.pop(r)
            run.complete(r, a, start, now, now - start, producer, ready)
    return run.timeline(critical_path)


def _memory(t: Timeline, costs: CostModel, bounds: Sequence[tuple[int, int]]) -> None:
    """Peak micro-batches whose activations a rank holds for backward, and their bytes (every block's
    output in the chunk is kept: the autograd graph's saved tensors, approximately). A split
    backward frees them at its W: the graph is kept for W (the executor retains it after BI)."""
    ranks = t.schedule.num_ranks
    per_chunk = [sum(costs.activation_bytes[a:b]) if costs.activation_bytes else 0.0 for a, b in bounds]
    t.peak_activations, t.peak_activation_bytes = [0] * ranks, [0.0] * ranks
    for r in range(ranks):
        live = peak = 0
        live_bytes = peak_bytes = 0.0
        for a in t.schedule.actions[r]:
            if a.op is Op.FORWARD and t.schedule.backward:
                live, live_bytes = live + 1, live_bytes + per_chunk[a.chunk]
            elif a.op.gives_weight_grad:
                live, live_bytes = live - 1, live_bytes - per_chunk[a.chunk]
            peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
        t.peak_activations[r], t.peak_activation_bytes[r] = peak, peak_bytes
    t.weight_bytes = [  # every version a rank holds at once (2BW stashes the previous one)
        t.schedule.weight_versions
        * sum(sum(costs.param_bytes[a:b]) if costs.param_bytes else 0.0 for c, (a, b) in enumerate(bounds) if t.schedule.chunk_rank[c] == r)
        for r in range(ranks)
    ]
