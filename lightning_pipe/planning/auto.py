"""`schedule="auto"`: plan every candidate schedule on the profile, simulate, run the fastest that fits.

Each candidate (1F1B, interleaved v = 2, 4, wave W = 1, 2, 4 in our greedy order and in Hanayo's
own order) gets its own partition from the same
partitioner (a multi-chunk schedule cuts P·v or 2PW chunks), then the simulator predicts its
iteration time and each rank's peak memory. Memory is the rank's weights times `weight_copies`
(parameters, gradients and the optimizer's state: 4 for Adam in fp32) plus the activations it holds
for backward at its peak. A candidate that cannot run (more chunks than blocks, a micro-batch count
it cannot use) or does not fit `memory_limit` is kept in the table with the reason, so the choice
can be read and checked. Ties go to fewer chunks: the same time with fewer messages.

Zero-bubble candidates (ZB-H1, ZB-V, and zb-auto: the paper's automatic scheduler, whose order is
built on the profile's own F / BI / W times) are simulated only on a profile that measured each
block's weight-gradient (W) time: their gain is the W's filling bubbles, which a guessed split
cannot tell.

The wave guard: a wave order ("wave" or "hanayo") is never chosen when the simulator predicts it
slower than 1F1B on the same profile (1F1B simulated even when it is not a candidate or does not
fit the memory limit), nor over the memory limit; its verdict says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..schedules import schedule_kind
from ..simulation import CostModel, Timeline, simulate
from .planner import Plan, plan
from .replay import cached_schedule
from .slicer import choose_slicing, fixed_slicing, simulate_sliced
from .zero_bubble import zero_bubble_auto

CANDIDATES: tuple[tuple[str, dict[str, int]], ...] = (
    ("1f1b", {}),
    ("interleaved", {"chunks": 2}),
    ("interleaved", {"chunks": 4}),
    ("wave", {"waves": 1}),
    ("wave", {"waves": 2}),
    ("wave", {"waves": 4}),
    ("hanayo", {"waves": 1}),
    ("hanayo", {"waves": 2}),
    ("hanayo", {"waves": 4}),
    ("zb-h1", {}),
    ("zb-v", {}),
    ("zb-auto", {}),
)
ZERO_BUBBLE = ("zb-h1", "zb-v", "zb-auto")  # backward split in BI and W: candidates on a profile with measured W times
WAVE_ORDERS = ("wave", "hanayo")  # Hanayo's placement: our greedy order, the paper's order


SHARDED = {  # how a rank's Adam state is laid out over the `width` replicas of its stage: what each holds
    "none": "whole on every replica",
    "optimizer": "Adam's moments sharded over {w} replicas (ZeRO-1)",
    "full": "parameters and moments sharded over {w} replicas, gradients whole while a step accumulates them (FSDP2)",
}


def adam_weight_copies(shard: str = "none", width: int = 1, reshard: str = "microbatch") -> float:
    """A rank's bytes per weight byte of its stage under Adam: parameters + gradients + exp_avg + exp_avg_sq.
    shard="optimizer" divides the two moments over the `width` replicas; "full" also the parameters (the
    gradients accumulate unsharded over a step's micro-batches and are reduce-scattered once), and with
    reshard="step" the stage's gathered parameters are held through the step as well."""
    if width <= 1 or shard == "none":
        return 4.0
    if shard == "optimizer":
        return 2.0 + 2.0 / width
    return (2.0 if reshard == "step" else 1.0) + 3.0 / width


ADAM_WEIGHT_COPIES = adam_weight_copies()


def version_share(shard: str = "none", width: int = 1) -> float:
    """The bytes of a further weight version (2BW's stash) per weight byte of the stage: each rank stashes
    its 1/width shard under shard="full", the whole stage otherwise."""
    return 1.0 / width if shard == "full" and width > 1 else 1.0


def memory_line(
    per_stage: Sequence[float], shard: str, width: int, runtime_bytes: float, reshard: str = "microbatch", tensor: int = 1
) -> str:
    """The predicted peak per rank, as the plan and the training log print it."""
    layout = SHARDED[shard if width > 1 else "none"].format(w=width)
    layout += ", gathered parameters held through the step" if shard == "full" and width > 1 and reshard == "step" else ""
    layout += f", layers' weights split over {tensor} tensor-parallel ranks" if tensor > 1 else ""
    return (
        "predicted peak memory per rank (by stage): " + ", ".join(f"{b / 2**30:.2f}" for b in per_stage) + " GiB (weights x "
        f"{adam_weight_copies(shard, width, reshard):g} for parameters, gradients and Adam's moments, {layout}; stashed activations; "
        f"the process's runtime {runtime_bytes / 2**30:.2f} GiB)"
    )


def label(schedule: str, options: dict[str, int]) -> str:
    return schedule + "".join(f" {k}={v}" for k, v in sorted(options.items()))


@dataclass(frozen=True)
class Candidate:
    schedule: str
    options: tuple[tuple[str, int], ...]
    plan: Optional[Plan]  # None: the schedule cannot run this model / micro-batch count
    iteration_time: float  # simulated seconds per step; inf when it cannot run
    peak_memory: float  # predicted bytes on the fullest rank; inf when it cannot run
    sliced: int  # warm-up micro-batches the slicer cuts in halves (1F1B with slicer only)
    verdict: str  # "chosen", "runs", "over the memory limit" or "cannot run: <why>"

    @property
    def name(self) -> str:
        return label(self.schedule, dict(self.options))

    @property
    def schedule_options(self) -> dict[str, int]:
        return dict(self.options)

    @property
    def num_chunks(self) -> int:
        return self.plan.stages if self.plan is not None else 0

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "options": dict(self.options),
            "iteration_time": self.iteration_time,
            "peak_memory": self.peak_memory,
            "sliced": self.sliced,
            "verdict": self.verdict,
            "bounds": [list(b) for b in self.plan.bounds] if self.plan else None,
        }


@dataclass(frozen=True)
class ScheduleChoice:
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    memory_limit: Optional[float]

    @property
    def plan(self) -> Plan:
        assert self.chosen.plan is not None
        return self.chosen.plan

    @property
    def reason(self) -> str:
        runners = sorted((c for c in self.candidates if c.verdict in ("chosen", "runs")), key=lambda c: c.iteration_time)
        why = f"{self.chosen.name} is the fastest simulated schedule"
        if len(runners) > 1:
            why += f", {runners[1].iteration_time / self.chosen.iteration_time - 1:.1%} ahead of {runners[1].name}"
        if self.memory_limit is not None:
            why += f", within the memory limit of {self.memory_limit / 2**30:.2f} GiB"
        return why

    def table(self) -> str:
        limit = "none" if self.memory_limit is None else f"{self.memory_limit / 2**30:.2f} GiB"
        lines = [f"schedule=auto (memory limit {limit}): {self.reason}"]
        columns = ("schedule", "chunks", "iteration ms", "vs chosen", "peak memory MiB", "verdict")
        rows = []
        for c in self.candidates:
            runs = c.plan is not None
            rows.append(
                (
                    c.name + (f" (sliced {c.sliced})" if c.sliced else ""),
                    str(c.num_chunks) if runs else "-",
                    f"{c.iteration_time * 1e3:.3f}" if runs else "-",
                    f"{c.iteration_time / self.chosen.iteration_time:.3f}x" if runs else "-",
                    f"{c.peak_memory / 2**20:.1f}" if runs else "-",
                    c.verdict if runs else f"{c.verdict.split(':')[0]} (below)",
                )
            )
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(columns)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(columns, widths)))
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines += [f"{c.name}: {c.verdict}" for c in self.candidates if c.plan is None]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "chosen": self.chosen.to_dict(),
            "reason": self.reason,
            "memory_limit": self.memory_limit,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def stage_memory(timeline: Timeline, weight_copies: float, runtime_bytes: float = 0.0, extra_version: float = 1.0) -> list[float]:
    """Predicted peak bytes of each rank: its weights' copies, its stashed activations and the
    process's runtime (`CostModel.runtime_bytes`: the interpreter and libraries, a CUDA context). A
    schedule holding a second weight version (2BW) adds that version's weights only, `extra_version` of
    them per weight byte (`version_share`), not a second set of gradients and optimizer state."""
    versions = timeline.schedule.weight_versions
    per_weight = weight_copies + (versions - 1) * extra_version
    return [w / versions * per_weight + a + runtime_bytes for w, a in zip(timeline.weight_bytes, timeline.peak_activation_bytes)]


def peak_memory(timeline: Timeline, weight_copies: float, runtime_bytes: float = 0.0) -> float:
    """Predicted peak bytes of the fullest rank (`stage_memory`'s largest)."""
    return max(stage_memory(timeline, weight_copies, runtime_bytes), default=0.0)


def choose_schedule(
    costs: CostModel,
    stages: int,
    microbatches: int,
    method: str = "autopipe",
    kinds: Optional[Sequence[str]] = None,
    memory_limit: Optional[float] = None,
    candidates: Sequence[tuple[str, dict[str, int]]] = CANDIDATES,
    slicer: Union[bool, int] = False,
    weight_copies: float = ADAM_WEIGHT_COPIES,
    apart: Sequence[Sequence[int]] = (),
) -> ScheduleChoice:
    """Plan and simulate each candidate on `stages` ranks; choose the fastest within `memory_limit`
    (bytes; None: no limit). `slicer` applies to the 1F1B / GPipe candidates as in `plan`'s strategy.
    `apart`: groups of blocks sharing a weight that must land on different ranks (shard="full" shards each
    block on its own); a candidate that places two of a group on one rank cannot run."""
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and memory_limit > 0):
        raise ValueError(f"memory_limit={memory_limit!r}: a number of bytes > 0, or None for no limit")
    if not candidates:
        raise ValueError("candidates is empty: give at least one (schedule, options) pair")
    found: list[Candidate] = []
    for schedule, options in candidates:
        key = tuple(sorted(options.items()))
        if schedule in ZERO_BUBBLE and not costs.weight:
            found.append(
                Candidate(schedule, key, None, math.inf, math.inf, 0, "skipped: the profile has no measured W (weight-gradient) times")
            )
            continue
        try:
            chosen_plan = plan(costs, stages, microbatches, method=method, schedule=schedule, kinds=kinds, options=options)
        except ValueError as error:  # e.g. more chunks than blocks, m not a multiple of p
            found.append(Candidate(schedule, key, None, math.inf, math.inf, 0, f"cannot run: {error}"))
            continue
        clash = _together(apart, chosen_plan.bounds, cached_schedule(schedule, stages, microbatches, key).chunk_rank)
        if clash:
            found.append(Candidate(schedule, key, None, math.inf, math.inf, 0, f"cannot run: {clash}"))
            continue
        sliced, time = 0, chosen_plan.iteration_time
        if schedule_kind(schedule).costed:  # the partition planned on its form without costs, the schedule on them
            try:
                held = None if memory_limit is not None else stages  # as a run builds it (CostedSchedule)
                _, timeline = zero_bubble_auto(costs, chosen_plan.bounds, microbatches, memory_limit, weight_copies, max_held=held)
            except ValueError as error:  # its weights and one micro-batch do not fit
                found.append(Candidate(schedule, key, None, math.inf, math.inf, 0, f"cannot run: {error}"))
                continue
            time = timeline.iteration_time
        elif slicer and not options and schedule not in ZERO_BUBBLE:
            slicing = (
                choose_slicing(costs, chosen_plan.bounds, microbatches, schedule)
                if slicer is True
                else fixed_slicing(costs, chosen_plan.bounds, microbatches, int(slicer), schedule)
            )
            sliced, time = slicing.sliced, slicing.iteration_time
            timeline = simulate_sliced(costs, chosen_plan.bounds, microbatches, sliced, schedule)
        else:
            timeline = simulate(cached_schedule(schedule, stages, microbatches, key), costs, chosen_plan.bounds, critical_path=False)
        memory = peak_memory(timeline, weight_copies, costs.runtime_bytes)
        verdict = "runs" if memory_limit is None or memory <= memory_limit else "over the memory limit"
        found.append(Candidate(schedule, key, chosen_plan, time, memory, sliced, verdict))
    found = _wave_guard(found, costs, stages, microbatches, method, kinds, slicer)
    fits = [c for c in found if c.verdict == "runs"]
    if not fits:
        detail = "; ".join(f"{c.name}: {c.verdict}" + (f" ({c.peak_memory / 2**20:.1f} MiB)" if c.plan else "") for c in found)
        raise ValueError(f"schedule='auto' found no candidate that runs within memory_limit={memory_limit!r}: {detail}")
    # fastest; on a tie (to float noise) fewer chunks, then the listed order
    best = min(fits, key=lambda c: (round(c.iteration_time, 12), c.num_chunks, found.index(c)))
    chosen = _with_verdict(best, "chosen")
    return ScheduleChoice(tuple(chosen if c is best else c for c in found), chosen, memory_limit)


def _together(apart: Sequence[Sequence[int]], bounds: Sequence[Sequence[int]], chunk_rank: Sequence[int]) -> str:
    """Why a placement puts two blocks of one `apart` group on one rank ("" where none does)."""
    rank = {b: chunk_rank[c] for c, (start, stop) in enumerate(bounds) for b in range(start, stop)}
    for group in apart:
        seen: dict[int, int] = {}
        for block in group:
            if rank[block] in seen:
                return (
                    f"blocks {seen[rank[block]]} and {block} share a weight and would both be on pipeline rank {rank[block]} "
                    "(each block is sharded on its own)"
                )
            seen[rank[block]] = block
    return ""


def _wave_guard(found: list[Candidate], costs: CostModel, stages: int, microbatches: int, method: str, kinds, slicer) -> list[Candidate]:
    """A wave order the simulator predicts slower than 1F1B does not run (verdict says why)."""
    waves = [c for c in found if c.schedule in WAVE_ORDERS and c.verdict == "runs"]
    if not waves:
        return found
    one = next((c for c in found if c.schedule == "1f1b" and c.plan is not None), None)
    if one is not None:
        reference = one.iteration_time
    else:  # 1F1B is not a candidate: simulate it anyway, it is the bar a wave must clear
        try:
            one_plan = plan(costs, stages, microbatches, method=method, schedule="1f1b", kinds=kinds)
        except ValueError:
            return found
        reference = one_plan.iteration_time
        if slicer:  # the best slicing is at least as fast as any fixed one
            reference = min(reference, choose_slicing(costs, one_plan.bounds, microbatches, "1f1b").iteration_time)
    out = []
    for c in found:
        if any(c is w for w in waves) and c.iteration_time > reference * (1 + 1e-12):
            c = _with_verdict(c, f"slower than 1f1b ({c.iteration_time * 1e3:.3f} vs {reference * 1e3:.3f} ms simulated)")
        out.append(c)
    return out


def _with_verdict(c: Candidate, verdict: str) -> Candidate:
    return Candidate(c.schedule, c.options, c.plan, c.iteration_time, c.peak_memory, c.sliced, verdict)
