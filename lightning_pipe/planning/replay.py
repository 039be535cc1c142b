"""A schedule's compute graph, compiled once and replayed for many partitions.

Planners simulate hundreds of partitions of one schedule. `simulator.simulate` re-walks every
action list and builds an `Event` per action each time; here the walk is done once: each compute
keeps the compute whose end releases it (the previous compute on its rank is implicit in the
rank's clock) and the stage boundary its message crosses. A partition then costs one flat loop
over the computes.

Only the loops are this module's own. The rules live in `simulator.py` and are imported, not
restated: `chunk_costs` (per-chunk times and messages), `input_source` (what a compute waits
for), `trace_critical_path` and `master_stage`, over one representation (computes as indices
with parallel lists). The loops do `simulate`'s float operations in its order, so iteration
times and master stages agree exactly on every schedule (tests/test_one_simulator.py). Shared
cores (`CostModel.cores`) make durations depend on the other ranks: those go to `simulate`.

Many partitions at once: computes at the same depth of the graph wait for nothing among
themselves, so `iteration_times` runs depth by depth with numpy, one column per partition (the
same float operations, so the same results), which is several times cheaper per partition.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator, Optional, Sequence

import numpy as np

from ..schedules import Op, PipelineSchedule, get_schedule
from ..simulation import (
    CostModel,
    chunk_costs,
    done_key,
    input_source,
    master_stage,
    message_of,
    produced_by,
    simulate,
    split_costs,
    trace_critical_path,
)

Bounds = tuple[tuple[int, int], ...]
_KINDS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)  # the blocks of `Replay._times`


@contextmanager
def paused_gc() -> Iterator[None]:
    """Building a schedule allocates tens of thousands of small objects; in a process that imported
    torch each allocation-triggered collection walks millions of objects: 90% of building 1F1B at
    32 x 64 (219 -> 25 ms). Nothing built here forms cycles worth collecting meanwhile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@lru_cache(maxsize=32)
def cached_schedule(name: str, stages: int, microbatches: int, options: tuple[tuple[str, int], ...] = ()) -> PipelineSchedule:
    """Built once per (name, stages, microbatches); nothing mutates a schedule. Not `validate`d
    (14 ms at 16 x 32, a seventh of the planning budget): the generators are validated by their
    tests, and `Replay` itself rejects a schedule that cannot finish."""
    with paused_gc():
        return get_schedule(name)(stages, microbatches, **dict(options))


class Replay:
    """The compute DAG of `schedule`, in an order where every compute follows what it waits for."""

    def __init__(self, schedule: PipelineSchedule):
        self.schedule = schedule
        chunks = schedule.num_chunks
        self.chunk_rank = schedule.chunk_rank
        per_rank: list[list[tuple[Op, int, Optional[tuple]]]] = []  # (op, chunk, input source)
        senders: dict[tuple, tuple[int, int]] = {}  # message -> (rank, index of the compute before the send)
        # the sends and receives a rank issues before each compute (since the one before) and before
        # each send: `CostModel.message_gap`'s counts, the thread time taken from computing
        gaps: list[list[tuple[int, int]]] = []
        leaves: dict[tuple, tuple[int, int]] = {}  # message -> counts up to and including its send
        self.trailing: list[tuple[int, int]] = []  # after the rank's last compute
        for r, actions in enumerate(schedule.actions):
            computes: list[tuple[Op, int, Optional[tuple]]] = []
            counts: list[tuple[int, int]] = []
            sends = recvs = 0
            for a in actions:
                if a.op.is_compute:
                    computes.append((a.op, a.chunk, input_source(schedule, a, r)))
                    counts.append((sends, recvs))
                    sends = recvs = 0
                elif a.op.is_send:
                    # a send leaves once issued: the end of its latest compute, plus the messages since
                    sends += 1
                    senders[message_of(a)] = (r, len(computes) - 1)
                    leaves[message_of(a)] = (sends, recvs)
                elif a.op.is_recv:
                    recvs += 1
            per_rank.append(computes)
            gaps.append(counts)
            self.trailing.append((sends, recvs))

        # (op, chunk, microbatch) -> (rank, position): the producer of a message, the cause on the path
        produced: dict[tuple, tuple[int, int]] = {}
        for r, actions in enumerate(schedule.actions):
            for j, a in enumerate(a for a in actions if a.op.is_compute):
                produced[done_key(a)] = (r, j)
        index_of: dict[tuple[int, int], int] = {}

        # topological order: round-robin over ranks, a compute goes once what releases it has gone
        pointer = [0] * len(per_rank)
        order: list[tuple[int, int]] = []
        remaining = sum(len(c) for c in per_rank)
        while remaining:
            progressed = False
            for r, computes in enumerate(per_rank):
                while pointer[r] < len(computes):
                    _, c, key = computes[pointer[r]]
                    dep = self._release(key, senders, produced)
                    if dep is not None and dep[0] not in index_of:
                        break
                    index_of[(r, pointer[r])] = len(order)
                    order.append((r, pointer[r]))
                    pointer[r] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise ValueError("the schedule cannot finish (validate it first: a rank waits for a message never sent)")

        n = len(order)
        self.rank = [0] * n
        self.duration = [0] * n  # index into the chunk times of forward, backward, BI, then W
        self.sender = [-1] * n  # compute whose end the message leaves at (or the local producer)
        self.producer: list[Optional[int]] = [None] * n  # compute that produced the data (the cause on the critical path)
        self.boundary = [chunks] * n  # stage boundary crossed (chunk index); `chunks` = no transfer
        self.gap_counts = [(0, 0)] * n  # messages issued on its rank since the compute before
        self.leave_counts = [(0, 0)] * n  # messages its input's sender issued up to that send
        self.forward = [True] * n
        self.counts_f = [0] * chunks
        self.counts_b = [0] * chunks
        self.split = False  # any backward split in BI + W (zero-bubble)
        for k, (r, j) in enumerate(order):
            op, c, key = per_rank[r][j]
            fwd = op is Op.FORWARD
            self.rank[k] = r
            self.forward[k] = fwd
            self.duration[k] = _KINDS.index(op) * chunks + c
            if fwd:
                self.counts_f[c] += 1
            elif op.gives_weight_grad:  # a split backward's BI + W: its W counted as the whole (bounds only)
                self.counts_b[c] += 1
            self.split = self.split or op is Op.BACKWARD_WEIGHT
            self.gap_counts[k] = gaps[r][j]
            if key is not None and not key[0]:
                self.leave_counts[k] = leaves[key[1]]
            dep = self._release(key, senders, produced)
            if dep is not None:
                send_at, producer = dep
                self.sender[k] = index_of[send_at]
                self.producer[k] = index_of[producer]
                if not key[0]:  # a message, not a local hand-over
                    # both directions cross the boundary after the lower chunk: the comm of its last block
                    self.boundary[k] = c - 1 if fwd else c
        self.ranks = len(per_rank)
        self.chunks = chunks
        self.previous: list[Optional[int]] = [None] * len(order)  # the compute before on the same rank
        latest: dict[int, int] = {}
        for k, r in enumerate(self.rank):
            self.previous[k] = latest.get(r)
            latest[r] = k
        self.one_chunk_per_rank = tuple(schedule.chunk_rank) == tuple(range(self.ranks))
        self._last = np.array([latest.get(r, n) for r in range(self.ranks)])  # each rank's last compute (n: none)
        self._levels = self._by_depth()

    def _by_depth(self) -> list[tuple[np.ndarray, ...]]:
        """Computes grouped by depth in the graph, as index arrays for the batched replay. Index
        `n` is a sentinel that ended at 0.0 (no previous compute, no message) and boundary
        `chunks` a transfer of 0.0 (a local hand-over)."""
        n = len(self.rank)
        previous = [n if p is None else p for p in self.previous]
        sender = [s if s >= 0 else n for s in self.sender]
        depth = [0] * (n + 1)
        groups: dict[int, list[int]] = {}
        for k in range(n):
            depth[k] = 1 + max(depth[previous[k]] if previous[k] < n else -1, depth[sender[k]] if sender[k] < n else -1)
            groups.setdefault(depth[k], []).append(k)
        return [
            tuple(
                np.array(v)
                for v in (g, [previous[k] for k in g], [sender[k] for k in g], [self.boundary[k] for k in g], [self.duration[k] for k in g])
            )
            for _, g in sorted(groups.items())
        ]

    @staticmethod
    def _release(source, senders, produced) -> Optional[tuple[tuple[int, int], tuple[int, int]]]:
        """(compute the message leaves after, compute that produced it) for a compute's input."""
        if source is None:
            return None
        local, key = source
        if local:
            return produced[key], produced[key]
        return senders[key], produced[produced_by(key)]

    def _times(self, costs: CostModel, bounds: Sequence[tuple[int, int]]) -> tuple[list[float], list[float]]:
        """Per-compute durations (forward chunks, backward, BI, then W chunks; slowdown included) and
        per-boundary comm times, plus a 0.0 for `chunks` (a local hand-over): `chunk_costs`'."""
        fwd, bwd, comm = chunk_costs(costs, bounds, self.chunk_rank)
        bi, w = split_costs(costs, bounds, self.chunk_rank) if self.split else ([0.0] * self.chunks,) * 2
        comm.append(0.0)
        return fwd + bwd + bi + w, comm

    def _shared(self, costs: CostModel) -> bool:
        # Shared cores make a compute's duration depend on what the other ranks do meanwhile, which
        # the compiled graph's fixed durations cannot express: those cases go to `simulate` itself.
        return costs.shares_cores(self.ranks)

    def _messages(self, costs: CostModel) -> tuple[list[float], list[float], list[float]]:
        """Per compute, its rank's thread time on messages before it and its input's sender's up to
        that send; per rank, after its last compute (`CostModel.message_gap` of the counts)."""
        gap = costs.message_gap
        return (
            [gap(*c) for c in self.gap_counts],
            [gap(*c) for c in self.leave_counts],
            [gap(*c) for c in self.trailing],
        )

    def iteration_time(self, costs: CostModel, bounds: Sequence[tuple[int, int]]) -> float:
        """`simulate(...).iteration_time`, without building events."""
        if self._shared(costs):
            return simulate(self.schedule, costs, bounds, critical_path=False).iteration_time
        durations, comm = self._times(costs, bounds)
        if costs.has_message_overheads:
            return self._with_messages(costs, durations, comm)[0]
        end = [0.0] * len(self.rank)
        clock = [0.0] * self.ranks
        for k, (r, d, s, x) in enumerate(zip(self.rank, self.duration, self.sender, self.boundary)):
            start = clock[r]
            if s >= 0:
                ready = end[s] + comm[x]
                if ready > start:
                    start = ready
            end[k] = clock[r] = start + durations[d]
        return max(clock)

    def _with_messages(self, costs: CostModel, durations: list[float], comm: list[float]):
        """`iteration_time`'s loop with the ranks' thread time on messages, as `simulate` adds it:
        (iteration time, start, end, free and ready of each compute)."""
        gap, leave, trailing = self._messages(costs)
        n = len(self.rank)
        start_of, end, free_of, ready_of = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        clock = [0.0] * self.ranks
        for k, (r, s, x, d) in enumerate(zip(self.rank, self.sender, self.boundary, self.duration)):
            free = free_of[k] = clock[r] + gap[k]
            ready = ready_of[k] = end[s] + leave[k] + comm[x] if s >= 0 else 0.0
            start_of[k] = start = ready if ready >= free else free
            end[k] = clock[r] = start + durations[d]
        return max(c + t for c, t in zip(clock, trailing)), start_of, end, free_of, ready_of

    def iteration_times(self, costs: CostModel, candidates: Sequence[Sequence[tuple[int, int]]]) -> list[float]:
        """`iteration_time` of many partitions at once (one numpy column each)."""
        if not candidates:
            return []
        if self._shared(costs):
            return [self.iteration_time(costs, bounds) for bounds in candidates]
        k, n, chunks = len(candidates), len(self.rank), self.chunks
        durations = np.empty((len(_KINDS) * chunks, k))
        comm = np.empty((chunks + 1, k))
        for j, bounds in enumerate(candidates):
            durations[:, j], comm[:, j] = self._times(costs, bounds)
        end = np.zeros((n + 1, k))
        if not costs.has_message_overheads:
            for nodes, previous, sender, boundary, duration in self._levels:
                end[nodes] = np.maximum(end[previous], end[sender] + comm[boundary]) + durations[duration]
            return end[:n].max(axis=0).tolist()
        gap, leave, trailing = (np.array(v)[:, None] for v in self._messages(costs))
        for nodes, previous, sender, boundary, duration in self._levels:
            end[nodes] = np.maximum(end[previous] + gap[nodes], end[sender] + leave[nodes] + comm[boundary]) + durations[duration]
        return (end[self._last] + trailing).max(axis=0).tolist()

    def lower_bound(self, costs: CostModel, bounds: Sequence[tuple[int, int]]) -> float:
        """A cheap lower bound of the iteration time, to skip partitions that cannot win.

        One chunk per rank: stage i starts only after micro-batch 0 crossed the stages before it,
        then computes for m (f_i + b_i), and its last backward still has to drain back through
        them: T >= sum_{s<i} (f_s + c_s) + m (f_i + b_i) + sum_{s<i} (b_s + c_s). Otherwise the
        busiest rank's compute, back to back. Shared cores only slow computes down, so these still
        hold, and the machine's floor (all compute over the cores) is one more."""
        if not self.one_chunk_per_rank or self.split:  # a split backward drains by BI only
            return self.busy_bound(costs, bounds)
        durations, comm = self._times(costs, bounds)
        c = self.chunks
        best = fill = drain = 0.0
        for i in range(c):
            v = fill + self.counts_f[i] * durations[i] + self.counts_b[i] * durations[c + i]
            if self.counts_b[i]:
                v += drain
            if v > best:
                best = v
            fill += durations[i] + comm[i]
            drain += durations[c + i] + comm[i]
        if self._shared(costs):
            return max(best, self.busy_bound(costs, bounds))
        return best

    def run(self, costs: CostModel, bounds: Sequence[tuple[int, int]]) -> tuple[float, Optional[int]]:
        """(iteration time, master stage) as `simulate` defines them, critical path included."""
        if self._shared(costs):
            timeline = simulate(self.schedule, costs, bounds)
            return timeline.iteration_time, timeline.master_stage
        durations, comm = self._times(costs, bounds)
        n = len(self.rank)
        if n == 0:
            return 0.0, None
        if costs.has_message_overheads:
            time, start_of, end, free_of, ready_of = self._with_messages(costs, durations, comm)
        else:
            start_of, end, free_of, ready_of = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
            clock = [0.0] * self.ranks
            for k, (r, s, x, d) in enumerate(zip(self.rank, self.sender, self.boundary, self.duration)):
                free = free_of[k] = clock[r]
                ready = ready_of[k] = end[s] + comm[x] if s >= 0 else 0.0
                start_of[k] = start = ready if ready >= free else free  # max(free, ready), as `simulate`
                end[k] = clock[r] = start + durations[d]
            time = max(clock)
        path = trace_critical_path(end, self.rank, free_of, ready_of, self.producer, self.previous)
        return time, master_stage(path, self.rank, self.forward, start_of, end)

    def busy_bound(self, costs: CostModel, bounds: Sequence[tuple[int, int]]) -> float:
        """A lower bound of the iteration time: the busiest rank's compute, back to back."""
        durations, _ = self._times(costs, bounds)
        busy = [0.0] * self.ranks
        for c in range(self.chunks):
            busy[self.chunk_rank[c]] += self.counts_f[c] * durations[c] + self.counts_b[c] * durations[self.chunks + c]
        if self._shared(costs):  # at most `cores` seconds of compute get done per second
            return max(max(busy), sum(busy) / costs.cores)
        return max(busy)


class Evaluator:
    """Simulated iteration time and master stage of partitions of one schedule, cached by bounds."""

    def __init__(self, costs: CostModel, schedule: str, stages: int, microbatches: int, options: Optional[dict] = None):
        # `stages` counts ranks; a multi-chunk schedule (options chunks= / waves=) cuts more pieces
        self.costs = costs
        self.replay = compiled(schedule, stages, microbatches, tuple(sorted((options or {}).items())))
        self._time: dict[Bounds, float] = {}
        self._master: dict[Bounds, Optional[int]] = {}

    def time(self, bounds: Bounds) -> float:
        t = self._time.get(bounds)
        if t is None:
            t = self._time[bounds] = self.replay.iteration_time(self.costs, bounds)
        return t

    def times(self, candidates: Sequence[Bounds]) -> list[float]:
        """Iteration times of many partitions; the ones not seen yet are replayed in one batch."""
        new = [b for b in dict.fromkeys(candidates) if b not in self._time]
        if len(new) == 1:
            self.time(new[0])
        elif new:
            self._time.update(zip(new, self.replay.iteration_times(self.costs, new)))
        return [self._time[b] for b in candidates]

    def lower_bound(self, bounds: Bounds) -> float:
        return self.replay.lower_bound(self.costs, bounds)

    def master(self, bounds: Bounds) -> Optional[int]:
        if bounds not in self._master:
            self._time[bounds], self._master[bounds] = self.replay.run(self.costs, bounds)
        return self._master[bounds]

    @property
    def evaluations(self) -> int:
        return len(self._time)


@lru_cache(maxsize=32)
def compiled(name: str, stages: int, microbatches: int, options: tuple[tuple[str, int], ...] = ()) -> Replay:
    schedule = cached_schedule(name, stages, microbatches, options)
    with paused_gc():
        return Replay(schedule)
