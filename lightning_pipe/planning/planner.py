"""`plan(costs, stages, microbatches, method)`: a partition chosen by name, simulated, explained."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..errors import SettingError, check_count
from ..schedules import ScheduleSpec
from ..simulation import CostModel, simulate
from .heuristic import clear_stop, last_stop
from .partition import Partition
from .partitioners import PARTITIONERS
from .replay import Bounds, cached_schedule, paused_gc

_SHORT = {"embedding": "emb", "attention": "att", "ffn": "ffn", "head": "head"}


@dataclass(frozen=True)
class Plan:
    """A partition and what the simulator predicts for it (times in seconds, per micro-batch for
    the per-stage figures, per step for `iteration_time`)."""

    method: str
    schedule: str
    microbatches: int
    bounds: Bounds  # half-open block ranges, one per stage
    sizes: tuple[int, ...]
    iteration_time: float
    stage_forward: tuple[float, ...]
    stage_backward: tuple[float, ...]
    stage_param_bytes: tuple[float, ...]  # empty when the costs carry no param_bytes
    master_stage: Optional[int]
    bubble_ratio: float
    planning_seconds: float
    kinds: tuple[str, ...] = ()
    options: tuple[tuple[str, int], ...] = ()  # chunks= / waves= of a multi-chunk schedule
    chunk_rank: tuple[int, ...] = ()  # the rank holding each piece (empty: piece s on rank s)
    note: str = ""  # what the search said (AutoPipe's heuristic stopped by its bound), printed under the table

    @property
    def schedule_options(self) -> dict[str, int]:
        return dict(self.options)

    @property
    def stages(self) -> int:
        return len(self.bounds)

    @property
    def partition(self) -> Partition:
        """What the strategy takes (`partition=list(plan.sizes)` in a config does the same)."""
        return Partition(self.bounds)

    @property
    def balance(self) -> float:
        """Standard deviation of per-stage forward + backward time (AutoPipe Fig. 13; lower is better)."""
        loads = [f + b for f, b in zip(self.stage_forward, self.stage_backward)]
        return statistics.pstdev(loads) if len(loads) > 1 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["bounds"] = [list(b) for b in self.bounds]
        for key in ("sizes", "stage_forward", "stage_backward", "stage_param_bytes", "kinds", "chunk_rank"):
            out[key] = list(out[key])
        out["options"] = self.schedule_options
        out["stages"] = self.stages
        out["balance"] = self.balance
        return out

    def contents(self, stage: int) -> str:
        """The block kinds a stage holds, e.g. 'emb + 3 att + 2 ffn'."""
        a, b = self.bounds[stage]
        if not self.kinds:
            return ""
        counts = Counter(self.kinds[a:b])
        parts = []
        for kind in dict.fromkeys(self.kinds[a:b]):  # in model order
            name = _SHORT.get(kind, kind)
            parts.append(name if counts[kind] == 1 and kind in ("embedding", "head") else f"{counts[kind]} {name}")
        return " + ".join(parts)

    def table(self) -> str:
        chunked = len(set(self.chunk_rank)) < len(self.chunk_rank)
        options = "".join(f" {k}={v}" for k, v in self.options)
        pieces = f"{self.stages} chunks on {len(set(self.chunk_rank))} ranks" if chunked else f"{self.stages} stages"
        head = (
            f"{self.method} plan, {self.schedule}{options}, {pieces}, {self.microbatches} micro-batches: "
            f"iteration {self.iteration_time * 1e3:.3f} ms (simulated), master {'rank' if chunked else 'stage'} {self.master_stage}, "
            f"bubble {self.bubble_ratio:.1%}, balance (std of f+b) {self.balance * 1e3:.3f} ms, "
            f"planned in {self.planning_seconds * 1e3:.1f} ms"
        )
        columns = (
            (["chunk", "rank"] if chunked else ["stage"])
            + ["blocks"]
            + (["contents"] if self.kinds else [])
            + ["forward ms", "backward ms", "f+b ms"]
        )
        columns += ["params MB"] if self.stage_param_bytes else []
        rows = []
        for s, (a, b) in enumerate(self.bounds):
            row = (
                [str(s)]
                + ([str(self.chunk_rank[s])] if chunked else [])
                + [f"{a}..{b - 1} ({b - a})"]
                + ([self.contents(s)] if self.kinds else [])
            )
            f, bw = self.stage_forward[s], self.stage_backward[s]
            row += [f"{f * 1e3:.3f}", f"{bw * 1e3:.3f}", f"{(f + bw) * 1e3:.3f}"]
            row += [f"{self.stage_param_bytes[s] / 1e6:.1f}"] if self.stage_param_bytes else []
            rows.append(row)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        lines = [head, "  ".join(c.ljust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        lines += [self.note] if self.note else []
        return "\n".join(lines)


def check_plan_settings(
    costs: CostModel, stages: int, microbatches: int, method: str, schedule: str, kinds, options: Optional[dict] = None
) -> None:
    """Every bad setting is a SettingError that names it, before any work."""
    if not isinstance(method, str) or method not in PARTITIONERS:
        raise SettingError(f"method={method!r} is not a known partitioner; allowed values: {sorted(PARTITIONERS)}", "partition")
    spec = ScheduleSpec.of(schedule, **(options or {}))  # names unknown schedules and options
    check_count("stages", stages)
    check_count("microbatches", microbatches)
    if options:
        spec.check(stages, costs.num_blocks)
    if stages > costs.num_blocks:
        raise SettingError(
            f"stages={stages} exceeds the {costs.num_blocks} blocks of the cost model: every stage needs at least "
            f"one block, so use at most {costs.num_blocks} stages",
            "stages",
        )
    if kinds is not None and len(kinds) != costs.num_blocks:
        raise ValueError(f"kinds has {len(kinds)} entries for {costs.num_blocks} blocks: give one kind per block")


def plan(
    costs: CostModel,
    stages: int,
    microbatches: int,
    method: str = "autopipe",
    schedule: str = "1f1b",
    kinds: Optional[Sequence[str]] = None,
    options: Optional[dict] = None,
) -> Plan:
    """Partition the blocks of `costs` into `stages` stages with partitioner `method` (a key of
    PARTITIONERS) and simulate the result with `schedule` (any of SCHEDULES; `options` are its
    chunks= / waves=, and a multi-chunk schedule is cut into that many chunks over `stages` ranks).

    `kinds` names each block ('embedding', 'attention', 'ffn', 'head' or anything else); `uniform`
    then counts layers instead of blocks, and the table shows what each stage holds."""
    started = time.perf_counter()
    check_plan_settings(costs, stages, microbatches, method, schedule, kinds, options)
    kinds = tuple(kinds) if kinds is not None else None
    options = dict(options or {})
    # Python's collector walking torch's objects made cold plans several times slower; nothing
    # allocated here forms cycles worth collecting meanwhile
    with paused_gc():
        clear_stop()
        bounds = tuple(tuple(b) for b in PARTITIONERS[method](costs, stages, microbatches, schedule, kinds=kinds, options=options))
        note = last_stop() or ""
        built = cached_schedule(schedule, stages, microbatches, tuple(sorted(options.items())))
        timeline = simulate(built, costs, bounds)
    planning_seconds = time.perf_counter() - started
    return Plan(
        method=method,
        schedule=schedule,
        microbatches=microbatches,
        bounds=bounds,
        sizes=tuple(b - a for a, b in bounds),
        iteration_time=timeline.iteration_time,
        stage_forward=tuple(sum(costs.forward[a:b]) for a, b in bounds),
        stage_backward=tuple(sum(costs.backward[a:b]) for a, b in bounds),
        stage_param_bytes=tuple(sum(costs.param_bytes[a:b]) for a, b in bounds) if costs.param_bytes else (),
        master_stage=timeline.master_stage,
        bubble_ratio=timeline.bubble_ratio,
        planning_seconds=planning_seconds,
        kinds=kinds or (),
        options=tuple(sorted(options.items())),
        chunk_rank=tuple(built.chunk_rank),
        note=note,
    )
