"""AutoPipe's slicer: how many warm-up micro-batches to cut in halves (paper §III-C, Alg. 2).

Cutting micro-batch 0 in two lets the next stage start after half a forward, so the pipeline
fills in half the time; cutting more helps less and doubles their messages. Two slicers live here:

- **ours** (`choose_slicing`, ``slicer_method="sweep"``; gpipe's and auto's): ask the simulator directly. Replay the
  schedule with the first k micro-batches sliced, k = 0 .. stages, and take the fastest iteration
  (on a tie the shorter start-up, then the smaller k). The schedule (1F1B or GPipe) runs the halves
  as micro-batches of their own, so a half counts as one of the warm-up micro-batches.
- **the paper's** (`algorithm2_slicing`, in ``slicer_algorithm2.py``; ``slicer=True`` on 1F1B): Algorithm 2's recursion
  over start and end times gives the count; the schedule keeps 1F1B over the *whole* micro-batches
  ("the same number" for both halves: they run back to back where the micro-batch ran), and where
  a sliced micro-batch meets the stage that runs it as its last warm-up forward, the first half's
  message is cancelled and sent together with the second half's (the paper's merge).

In both, each half carries its share of the loss, so training stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..runtime.microbatch import sliced_sizes
from ..schedules import build_schedule
from ..simulation import CostModel, simulate


@dataclass(frozen=True)
class SlicePlan:
    sliced: int  # warm-up micro-batches cut in halves
    startup: float
    iteration_time: float
    baseline_startup: float  # without slicing
    baseline_iteration_time: float
    candidates: tuple[tuple[int, float, float], ...]  # (k, start-up, iteration time)
    method: str = "sweep"  # "sweep" (ours: every k replayed, halves as micro-batches) or "algorithm2" (the paper's)

    def summary(self) -> dict:
        """What plan.json records of the slicing (the plan command and the strategy write it)."""
        return {
            "sliced": self.sliced,
            "startup": self.startup,
            "baseline_startup": self.baseline_startup,
            "iteration_time": self.iteration_time,
            "baseline_iteration_time": self.baseline_iteration_time,
            "method": self.method,
        }

    @property
    def startup_cut(self) -> float:
        return 1.0 - self.startup / self.baseline_startup if self.baseline_startup > 0 else 0.0


def simulate_sliced(costs: CostModel, bounds: Sequence[tuple[int, int]], microbatches: int, sliced: int, schedule: str = "1f1b"):
    # profiled micro-batches have 2 units; a half has 1 (sizes only matter relative to each other)
    sizes = sliced_sizes([2] * microbatches, sliced)
    scale = [s / 2 for s in sizes] if sliced else None  # None: all whole (and a schedule may unroll several steps, as 2BW)
    timeline = simulate(build_schedule(schedule, len(bounds), len(sizes)), costs, bounds, critical_path=False, scale=scale)
    if sliced:  # the pictures name the user's micro-batches: halves "0a", "0b", ..., then the whole ones
        timeline.microbatch_labels = [f"{i}{half}" for i in range(sliced) for half in "ab"] + [str(i) for i in range(sliced, microbatches)]
    return timeline


def choose_slicing(costs: CostModel, bounds: Sequence[tuple[int, int]], microbatches: int, schedule: str = "1f1b") -> SlicePlan:
    """Ours (not the paper's Algorithm 2): every k = 0 .. min(m, stages) simulated, the fastest kept."""
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches}: must be >= 1")
    candidates = []
    for k in range(0, min(microbatches, len(bounds)) + 1):
        t = simulate_sliced(costs, bounds, microbatches, k, schedule)
        candidates.append((k, t.startup, t.iteration_time))
    best = min(candidates, key=lambda c: (round(c[2], 12), round(c[1], 12), c[0]))
    base = candidates[0]
    return SlicePlan(best[0], best[1], best[2], base[1], base[2], tuple(candidates))


def fixed_slicing(
    costs: CostModel, bounds: Sequence[tuple[int, int]], microbatches: int, sliced: int, schedule: str = "1f1b", method: str = "sweep"
) -> SlicePlan:
    """A given number of sliced micro-batches, with the simulator's figures for it in the form `method` runs."""
    if not 0 <= sliced <= microbatches:
        raise ValueError(f"slicer={sliced}: must be between 0 and microbatches={microbatches}")
    runs = [(k, simulate_slicing(costs, bounds, microbatches, k, schedule, method)) for k in sorted({0, sliced})]
    candidates = tuple((k, t.startup, t.iteration_time) for k, t in runs)
    return SlicePlan(sliced, candidates[-1][1], candidates[-1][2], candidates[0][1], candidates[0][2], candidates, method)


def simulate_slicing(costs: CostModel, bounds: Sequence[tuple[int, int]], microbatches: int, sliced: int, schedule: str, method: str):
    """The timeline of `sliced` halved micro-batches in the form `method` runs them."""
    if method == "algorithm2" and sliced:
        from .slicer_algorithm2 import simulate_paper

        return simulate_paper(costs, bounds, microbatches, sliced)
    return simulate_sliced(costs, bounds, microbatches, sliced, schedule)


def algorithm2_slicing(costs: CostModel, bounds: Sequence[tuple[int, int]], microbatches: int, merge: bool = True) -> SlicePlan:
    """The paper's slicer: the count from Algorithm 2 (`slicer_algorithm2.algorithm2`), run on the
    paper's 1F1B with the halves back to back and the blocked half's message merged; the figures are
    the simulator's for that schedule (k = 0: plain 1F1B)."""
    from .slicer_algorithm2 import algorithm2, simulate_paper, stage_times

    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches}: must be >= 1")
    f, b, comm = stage_times(costs, bounds)
    k = algorithm2(f, b, comm, microbatches).sliced
    runs = [(j, simulate_paper(costs, bounds, microbatches, j, merge)) for j in sorted({0, k})]
    candidates = tuple((j, t.startup, t.iteration_time) for j, t in runs)
    return SlicePlan(k, candidates[-1][1], candidates[-1][2], candidates[0][1], candidates[0][2], candidates, "algorithm2")
