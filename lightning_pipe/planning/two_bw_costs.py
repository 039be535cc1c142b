"""PipeDream-2BW's cost functions (Narayanan et al., 2021, §4.2), as the planner (`two_bw.py`) uses them:
what a candidate (w, d, b, r) costs in MEMORY per stage and in time per step (the simulated step of its
schedule plus the replicas' gradient all-reduce), and THROUGHPUT from the two; `Hardware` is what they
are priced on. The simulated step and the per-stage in-flight count are ours (the paper's closed forms
are `two_bw_closed.py`). No torch, no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

from ..schedules import get_schedule
from .collectives import CollectiveCosts, ring
from .replay import Replay, paused_gc
from .sized import BlockCosts

WEIGHT_VERSIONS = {"2bw": 2, "1f1b": 1, "gpipe": 1}


@dataclass(frozen=True)
class Hardware:
    """What the planner plans for."""

    devices: int
    devices_per_node: int
    memory_limit: Optional[float]  # bytes per device; None: no cap
    intra_bandwidth: float  # bytes/s between devices of one node
    inter_bandwidth: float  # bytes/s between nodes
    latency: float = 20e-6  # seconds per message / all-reduce step
    optimizer_factor: float = 2.0  # optimizer state bytes per parameter byte (Adam, same dtype: 2; mixed precision with fp32 master: 6)
    runtime_bytes: float = 0.0  # ours: a process's own memory besides the model (profiling/runtime.py), on every stage
    shard_optimizer: bool = False  # ours, beside Algorithm 1: ZeRO-1 (shard="optimizer"), the optimizer state / width
    intra_collectives: Optional[CollectiveCosts] = None  # ours: measured within a node (None: rings at intra_bandwidth)
    inter_collectives: Optional[CollectiveCosts] = None  # ours: measured across nodes (None: rings at inter_bandwidth)

    def pipeline_bandwidth(self, depth: int, width: int = 1) -> float:
        """The pipeline is the outermost dimension (topology.py): a stage's `width` replicas fill a node
        before the next stage, so a pipeline stays inside one node only if the whole grid does."""
        return self.intra_bandwidth if width * depth <= self.devices_per_node else self.inter_bandwidth

    def replica_bandwidth(self, width: int) -> float:
        """The paper's bwth_width(w): a stage's replicas are consecutive ranks, inside one server when
        w fits it (the paper writes w < the server's GPUs; w equal to them fits too)."""
        return self.intra_bandwidth if width <= self.devices_per_node else self.inter_bandwidth

    def collectives(self, span: int) -> CollectiveCosts:
        """What collectives cost a group of ranks among `span` consecutive ones (a tp group: T; a
        replica group: width x T): measured if given, else rings at the node's or the nodes' bandwidth."""
        if span <= self.devices_per_node:
            return self.intra_collectives or ring(self.intra_bandwidth, self.latency)
        return self.inter_collectives or ring(self.inter_bandwidth, self.latency)


# (intra-node, inter-node) bytes/s when none are given: NVLink-class within a node and 100 Gb/s
# InfiniBand across (GPU); loopback gloo and 10 Gb/s Ethernet (CPU)
DEFAULT_BANDWIDTH = {"cuda": (100e9, 12.5e9), "cpu": (2e9, 1.25e9)}


def hardware(
    devices: int,
    devices_per_node: int,
    device_type: str,
    memory_limit: Optional[float],
    intra_bandwidth: Optional[float] = None,
    inter_bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
    optimizer_factor: float = 2.0,
    runtime_bytes: float = 0.0,
    shard_optimizer: bool = False,
    intra_collectives: Optional[CollectiveCosts] = None,
    inter_collectives: Optional[CollectiveCosts] = None,
) -> Hardware:
    intra, inter = DEFAULT_BANDWIDTH.get(device_type, DEFAULT_BANDWIDTH["cuda"])
    return Hardware(
        devices,
        devices_per_node,
        memory_limit,
        intra_bandwidth or intra,
        inter_bandwidth or inter,
        20e-6 if latency is None else latency,
        optimizer_factor,
        runtime_bytes,
        shard_optimizer,
        intra_collectives,
        inter_collectives,
    )


MIXED_PRECISION = ("16", "bf16", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


def optimizer_factor(precision: object) -> float:
    """Optimizer state bytes per parameter byte, for Adam: 2 (moments in the parameters' dtype), or 6
    with 16-bit parameters and fp32 master weights and moments (4 + 8 bytes per 2-byte parameter)."""
    return 6.0 if str(precision) in MIXED_PRECISION else 2.0


def in_flight(schedule: str, depth: int, microbatches: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage holds at its peak: GPipe all m; 1F1B min(d - s, m);
    2BW d - s (its continuous 1F1B). The simulator counts the same on the action lists
    (`Timeline.peak_activations`; tests/test_two_bw_planner.py holds the two equal)."""
    if schedule == "gpipe":
        return (microbatches,) * depth
    return tuple(min(depth - s, microbatches) for s in range(depth))


def memory(
    costs: BlockCosts,
    bounds: Sequence[tuple[int, int]],
    recompute: Sequence[bool],
    schedule: str,
    microbatches: int,
    hw: Hardware,
    width: int = 1,
    shard: Optional[str] = None,
) -> tuple[float, ...]:
    """MEMORY(.): predicted peak bytes per stage (`width`: the replicas a sharded optimizer divides over).
    `shard` (ours, the mesh search): none | optimizer | full over the replicas (None: as `hw.shard_optimizer`);
    full holds parameters, gradients and optimizer state / width plus one gathered block."""
    held = in_flight(schedule, len(bounds), microbatches)
    sharded = shard or ("optimizer" if hw.shard_optimizer else "none")
    optimizer = hw.optimizer_factor / (width if sharded == "optimizer" else 1)
    per_stage = []
    for (a, b), on, n in zip(bounds, recompute, held):
        params = sum(costs.param_bytes[a:b])
        if sharded == "full":
            states = (WEIGHT_VERSIONS[schedule] + 1 + hw.optimizer_factor) * params / width + max(costs.param_bytes[a:b], default=0.0)
        else:
            states = (WEIGHT_VERSIONS[schedule] + 1 + optimizer) * params  # versions + gradients + optimizer
        if on:
            acts = n * sum(costs.input_bytes[a:b]) + max(costs.saved_bytes[a:b], default=0.0)
        else:
            acts = n * sum(costs.saved_bytes[a:b])
        per_stage.append(states + acts + hw.runtime_bytes)
    return tuple(per_stage)


def allreduce_time(
    costs: BlockCosts, bounds: Sequence[tuple[int, int]], width: int, hw: Hardware, shard: Optional[str] = None, tensor: int = 1
) -> float:
    """Ring all-reduce of the largest stage's gradients over `width` replicas: 2 (w - 1) / w of the bytes;
    a sharded optimizer adds the owners' broadcast of the new weights, (w - 1) / w more (ZeRO-1).
    Ours, the mesh search (`shard` given) or measured collectives: `hw.collectives` prices it, over the
    width x tensor ranks the replica group spans; shard full reduce-scatters instead (FSDP2)."""
    if width <= 1:
        return 0.0
    if shard is not None or hw.intra_collectives is not None or hw.inter_collectives is not None:
        sharded = shard or ("optimizer" if hw.shard_optimizer else "none")
        group = hw.collectives(width * tensor)
        largest = max(sum(costs.param_bytes[a:b]) for a, b in bounds)
        if sharded == "full":
            return group.time("reduce_scatter", largest, width)
        broadcast = group.time("all_gather", largest, width) if sharded == "optimizer" else 0.0
        return group.time("all_reduce", largest, width) + broadcast
    bandwidth = hw.replica_bandwidth(width)
    largest = max(sum(costs.param_bytes[a:b]) for a, b in bounds)
    passes = 3 if hw.shard_optimizer else 2
    return passes * (width - 1) / width * largest / bandwidth + passes * (width - 1) * hw.latency


@lru_cache(maxsize=512)
def _replay(schedule: str, depth: int, m: int, batches: int = 0) -> Replay:
    options = {"batches": batches} if batches else {}
    with paused_gc():
        return Replay(get_schedule(schedule)(depth, m, **options))


def step_time(
    costs: BlockCosts, bounds: tuple, recompute: Sequence[bool], schedule: str, m: int, hw: Hardware, exact: bool = True, width: int = 1
) -> float:
    """Simulated seconds per optimizer step of one pipeline (no all-reduce). 2BW has no flush: a step
    costs what one more batch adds to the unrolled run. `exact=False` (ours, to screen hundreds of
    candidates quickly): past max(16, 2d) micro-batches the line through max(8, d) and max(16, 2d)
    (within 0.5% on most GPT-2 1.3B cases, up to 10% at d = 32 on slow links, where the pipeline
    settles slowly; the finalists are then simulated exactly)."""
    model = costs.cost_model(bounds, recompute, hw.pipeline_bandwidth(len(bounds), width), hw.latency)
    depth = len(bounds)

    def simulated(n: int) -> float:
        if schedule == "2bw":
            return _replay(schedule, depth, n, 2).iteration_time(model, bounds) - _replay(schedule, depth, n, 1).iteration_time(
                model, bounds
            )
        return _replay(schedule, depth, n).iteration_time(model, bounds)

    cap = max(16, 2 * depth)
    if exact or m <= cap:
        return simulated(m)
    half = cap // 2
    low, high = simulated(half), simulated(cap)
    return high + (m - cap) * (high - low) / (cap - half)


def throughput(step: float, allreduce: float, width: int, b: int, m: int) -> float:
    """THROUGHPUT(.): samples per second over all replicas."""
    return width * b * m / (step + allreduce)
