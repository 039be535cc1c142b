"""The one planning decision: what `python -m lightning_pipe.plan` prints is what training runs.

`plan_run(costs, stages, config, ...)` turns the settings and a cost model into the run's layout:
the schedule (schedule="auto": the fastest candidate within memory), the partition (a named
partitioner, listed sizes or equal block counts) and the slicer's count (True: ours, the fastest
simulated count; an integer: that count). Both the strategy's setup and the plan command call it,
and both write `RunPlan.summary()` and draw `RunPlan.timeline(costs)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

from ..schedules import ScheduleSpec
from ..simulation import CostModel, Timeline, simulate
from .auto import CANDIDATES, ScheduleChoice, adam_weight_copies, choose_schedule
from .heuristic import expansion_bound
from .partition import partition_blocks
from .planner import Plan, plan
from .replay import cached_schedule
from .slicer import SlicePlan, algorithm2_slicing, choose_slicing, fixed_slicing, simulate_slicing
from .zero_bubble import CostedSchedule


class RunSettings(Protocol):
    """What planning reads of the run's settings (`PipelineConfig` is one; planning sits below it)."""

    microbatches: int
    slicer: Any  # True (chosen), False, or a count
    autopipe_expansions: int
    bandwidth: Optional[float]
    latency: Optional[float]

    @property
    def auto(self) -> bool: ...

    shard: str
    reshard: str
    width: int

    @property
    def partitioner(self) -> Optional[str]: ...

    @property
    def fixed_partition(self) -> Any: ...

    @property
    def schedule_spec(self) -> ScheduleSpec: ...

    @property
    def slicing(self) -> str: ...


# The partitioners' block kinds, by the class names of the model's blocks (others: "block")
BLOCK_KINDS = {
    "Embedding": "embedding",
    "ResidualAttentionBlock": "attention",
    "ResidualFFNBlock": "ffn",
    "LMHead": "head",
    "MLMHead": "head",
    # a traced model (frontend): the code before its loop, each repeated block, the code after it
    "First": "embedding",
    "Repeated": "layer",
    "HalfA": "layer",  # a layer in two halves (attention, MLP): each half counts as a layer's block
    "HalfB": "layer",
    "Last": "head",
}


def block_kinds(names: Sequence[str]) -> list[str]:
    """Each block's kind for the partitioners, from its class name (a profile keeps them as `block_names`)."""
    return [BLOCK_KINDS.get(name, "block") for name in names]


# Link models when none is given or measured: a GPU pipeline over NVLink / PCIe, a CPU one over loopback gloo.
DEFAULT_LINKS = {"cuda": (25e9, 20e-6), "cpu": (2e9, 50e-6)}


def link_model(config: RunSettings, device_type: str) -> tuple[float, float]:
    """(bandwidth, latency) to plan with: the settings, else the default link of the device type."""
    bandwidth, latency = DEFAULT_LINKS.get(device_type, DEFAULT_LINKS["cuda"])
    return config.bandwidth or bandwidth, config.latency if config.latency is not None else latency


@dataclass
class RunPlan:
    bounds: tuple[tuple[int, int], ...]  # block range of every model chunk
    spec: ScheduleSpec  # the schedule to run (schedule="auto": the one chosen)
    stages: int  # pipeline ranks
    microbatches: int
    sliced: int = 0  # warm-up micro-batches the slicer cuts in halves
    plan: Optional[Plan] = None  # a named partitioner's plan (None: listed sizes or equal counts)
    slicing: Optional[SlicePlan] = None
    choice: Optional[ScheduleChoice] = None
    costed: Optional[CostedSchedule] = None  # schedule="zb-auto": its schedule is built from these costs

    def timeline(self, costs: CostModel) -> Timeline:
        """The simulated step of this plan."""
        if self.costed is not None:
            return self.costed.build(self.microbatches)[1]
        if self.spec.options or self.spec.kind.chunks is not None:  # multi-chunk (zb-v has no option): never sliced
            return simulate(cached_schedule(self.spec.name, self.stages, self.microbatches, self.spec.options), costs, self.bounds)
        method = self.slicing.method if self.slicing is not None else "sweep"
        return simulate_slicing(costs, self.bounds, self.microbatches, self.sliced, self.spec.name, method)

    def summary(self) -> dict[str, Any]:
        """What plan.json holds of the decision."""
        out: dict[str, Any] = {
            "schedule": self.spec.name,
            "options": self.spec.kwargs,
            "bounds": [list(b) for b in self.bounds],
            "sliced": self.sliced,
            "plan": self.plan.to_dict() if self.plan is not None else None,
        }
        if self.choice is not None:
            out["schedule_choice"] = self.choice.to_dict()
        if self.slicing is not None:
            out["slicer"] = self.slicing.summary()
        return out

    def report(self) -> list[str]:
        """The tables and lines a user reads (the schedule comparison, the plan, the slicer)."""
        lines = [self.choice.table()] if self.choice is not None else []
        if self.plan is not None:
            lines.append(self.plan.table())
        else:
            lines.append(f"partition {[b - a for a, b in self.bounds]} blocks per chunk (as set: no partitioner)")
        if self.costed is not None:
            built = self.costed.build(self.microbatches)[1]
            lines.append(
                f"zb-auto: the zero-bubble heuristic's order built on these costs: iteration {built.iteration_time * 1e3:.3f} ms "
                "(simulated; the partition was planned on its order for equal times)"
            )
        if self.slicing is not None:
            s = self.slicing
            how = "AutoPipe's Algorithm 2, halves back to back, merged send" if s.method == "algorithm2" else "sweep (ours)"
            lines.append(
                f"slicer: {s.sliced} warm-up micro-batches cut in halves ({how}); start-up {s.baseline_startup * 1e3:.2f} -> "
                f"{s.startup * 1e3:.2f} ms, iteration {s.baseline_iteration_time * 1e3:.2f} -> {s.iteration_time * 1e3:.2f} ms (simulated)"
            )
        return lines


def plan_run(
    costs: CostModel,
    stages: int,
    config: RunSettings,
    kinds: Optional[Sequence[str]] = None,
    memory_limit: Optional[float] = None,
    exclude: Sequence[str] = (),
    apart: Sequence[Sequence[int]] = (),
) -> RunPlan:
    """The run's schedule, partition and slicing on `stages` pipeline ranks. `kinds`: each block's
    kind (embedding, attention, ...) for the partitioners that use it; `exclude`: schedules
    schedule="auto" must not weigh (what the blocks cannot run, e.g. a split backward of compiled blocks);
    `apart`: groups of blocks schedule="auto" must place on different ranks (`choose_schedule`)."""
    with expansion_bound(config.autopipe_expansions):  # AutoPipe's heuristic reads the run's bound
        return _plan_run(costs, stages, config, kinds, memory_limit, tuple(exclude), tuple(map(tuple, apart)))


def _plan_run(
    costs: CostModel,
    stages: int,
    config: RunSettings,
    kinds: Optional[Sequence[str]],
    memory_limit: Optional[float],
    exclude: tuple,
    apart: tuple = (),
) -> RunPlan:
    m, method, num_blocks = config.microbatches, config.partitioner, costs.num_blocks
    copies = adam_weight_copies(config.shard, config.width, config.reshard)

    def costed(spec: ScheduleSpec, bounds: tuple) -> Optional[CostedSchedule]:
        return CostedSchedule(costs, bounds, memory_limit, copies) if spec.kind.costed else None

    if config.auto:
        choice = choose_schedule(
            costs,
            stages,
            m,
            method=method or "uniform",
            kinds=kinds if method else None,
            memory_limit=memory_limit,
            slicer=config.slicer,
            weight_copies=copies,
            candidates=[c for c in CANDIDATES if c[0] not in exclude],
            apart=apart,
        )
        chosen = choice.chosen
        spec = ScheduleSpec.of(chosen.schedule, **chosen.schedule_options)
        bounds = tuple(map(tuple, choice.plan.bounds))
        slicing = fixed_slicing(costs, bounds, m, chosen.sliced, spec.name) if chosen.sliced else None
        return RunPlan(bounds, spec, stages, m, chosen.sliced, choice.plan, slicing, choice, costed(spec, bounds))
    spec = config.schedule_spec
    result = None
    if method is not None:
        result = plan(costs, stages, m, method=method, schedule=spec.name, kinds=kinds, options=spec.kwargs)
        bounds = tuple(map(tuple, result.bounds))
    else:
        bounds = tuple(map(tuple, partition_blocks(config.fixed_partition, num_blocks, spec.chunk_count(stages)).bounds))
    slicing = None
    if config.slicer is True and config.slicing == "algorithm2":  # the paper's count, and its sliced 1F1B
        slicing = algorithm2_slicing(costs, bounds, m)
    elif config.slicer is True:  # ours: every count simulated, the fastest kept
        slicing = choose_slicing(costs, bounds, m, spec.name)
    elif config.slicer:  # a fixed count, run in the form of config.slicing
        slicing = fixed_slicing(costs, bounds, m, int(config.slicer), spec.name, config.slicing)
    return RunPlan(bounds, spec, stages, m, slicing.sliced if slicing else 0, result, slicing, costed=costed(spec, bounds))
