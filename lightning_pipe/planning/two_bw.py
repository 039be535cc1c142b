"""PipeDream-2BW's planner (Narayanan et al., 2021, §4): width, depth, micro-batch size and
recomputation under a memory cap.

Algorithm 1 sweeps every equi-replicated (w, d), w = 1..N and d = 1..N/w (a grid may use fewer than
the N devices; the strategy, which starts N processes, keeps w x d = N); SEARCH finds, for each, the
micro-batch size b and recomputation r with the highest THROUGHPUT whose MEMORY fits the device;
gradient accumulation g = B / (w b) micro-batches per step reaches the global batch B.
Beyond the paper's closed forms (§4.2), and named as ours:

- THROUGHPUT comes from the simulator: the schedule's own action lists (2bw, 1f1b or gpipe) on a
  balanced partition for that depth at that b, plus the replicas' ring all-reduce of each stage's
  gradients (intra-node bandwidth when a stage's replicas share a node, else inter-node), which our
  runtime runs synchronously after a stage's last backward. Costs are per block at b, interpolated
  from a profile at a few sizes (`SizedProfile`), recomputation's extra forward measured.
- MEMORY per stage: weight versions (2 for 2BW, §3.1) + gradients + optimizer state, plus the
  micro-batches in flight on that stage (counted from the schedule, as the simulator does) times
  what each keeps: every block's saved activations, or with recomputation only each block's input
  plus one block's activations while it is recomputed (§4.2.2 with the per-stage in-flight count
  instead of d). The fullest stage decides.
- r is also tried per stage (ours, "stages"): recompute only the stages that would not fit
  without it (in 1F1B / 2BW the first stages hold the most micro-batches).
- Candidates are compared on the min-max (DP) partition of forward + backward time; the chosen one
  is planned again by the configured partitioner (AutoPipe by default) and simulated exactly.

No torch, no Lightning: `plan_2bw(profile, hardware, global_batch) -> TwoBWPlan`, a table of every
candidate considered (and why each was discarded).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Callable, Iterable, Optional, Sequence

from .minmax import min_max_bounds
from .replay import paused_gc
from .sized import BlockCosts, SizedProfile
from .two_bw_closed import closed_memory, closed_step, even_bounds
from .two_bw_costs import Hardware, allreduce_time, memory, step_time, throughput
from .two_bw_mesh import FULL_SCHEDULES, mesh_costs
from .two_bw_mesh import options as mesh_options

SCHEDULES = ("2bw", "1f1b", "gpipe")
RECOMPUTE = ("off", "on", "stages")  # stages: ours, recompute only the stages that need it
REFINED = 3  # finalists the partitioner (AutoPipe) re-plans before the choice
COST_MODELS = ("simulated", "closed")  # ours; the paper's closed forms (§4.2)


def refiner(method: str, kinds: Optional[Sequence[str]] = None) -> Callable:
    """`refine` for `plan_2bw`: the partitioner `method` (e.g. AutoPipe) re-plans the chosen configuration."""
    from .planner import plan

    def refine(costs: object, depth: int, microbatches: int, schedule: str) -> tuple:
        return plan(costs, depth, microbatches, method=method, schedule=schedule, kinds=kinds).bounds

    return refine


@dataclass
class Candidate:
    width: int
    depth: int
    microbatch_size: int
    microbatches: int  # g: micro-batches per replica per optimizer step
    schedule: str
    recompute: str  # off | on | stages
    stage_recompute: tuple[bool, ...] = ()
    bounds: tuple[tuple[int, int], ...] = ()
    step_time: float = math.inf  # seconds per optimizer step, all-reduce included
    allreduce_time: float = 0.0
    throughput: float = 0.0  # samples / s over all replicas
    memory: float = math.inf  # bytes on the fullest device
    stage_memory: tuple[float, ...] = ()
    verdict: str = ""  # chosen | runs | over memory_limit | skipped: why
    exact: bool = False  # step_time simulated at its m (else screened: extrapolated past max(16, 2d))
    tensor: int = 1  # ours (mesh search): tensor-parallel ranks per stage
    shard: str = "none"  # ours (mesh search): none | optimizer | full over the width's replicas

    @property
    def mesh(self) -> str:
        return f"pp {self.depth} x dp {self.width} x tp {self.tensor}, shard={self.shard}"

    @property
    def feasible(self) -> bool:
        return self.verdict in ("chosen", "runs")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TwoBWPlan:
    chosen: Candidate
    candidates: list[Candidate]
    hardware: Hardware
    global_batch: int
    source: str
    planning_seconds: float
    partitioner: str = "dp"
    notes: list[str] = field(default_factory=list)
    mesh: bool = False  # tensor and shard priced (ours): searched, or the run's (`fixed_mesh`)
    mesh_searched: bool = False  # False with `fixed_mesh`: the run's tensor and shard, not the search's

    def table(self, all_rows: bool = False) -> str:
        """The paper's Table 1 shape: per (w, d, schedule, r) the best b that fits, and why the rest did not."""
        rows = self.candidates if all_rows else _best_rows(self.candidates)
        limit = "none" if self.hardware.memory_limit is None else size_text(self.hardware.memory_limit)
        head = (
            f"planner=2bw: {self.hardware.devices} devices ({self.hardware.devices_per_node} per node), memory limit {limit}, "
            f"global batch {self.global_batch}; costs: {self.source}; {len(self.candidates)} candidates in {self.planning_seconds:.2f} s"
            + (f"; memory includes each process's runtime, {size_text(self.hardware.runtime_bytes)}" if self.hardware.runtime_bytes else "")
        )
        cols = (
            "w",
            "d",
            *(("t", "shard") if self.mesh else ()),
            "b",
            "g",
            "schedule",
            "r",
            "samples/s",
            "step ms",
            "all-reduce ms",
            "memory",
            "simulated",
            "verdict",
        )
        legend = (
            "w: pipeline replicas, d: stages, b: micro-batch size, g: micro-batches per replica per step, "
            "r: recomputation (off, on, or the stages that recompute)"
            + ("; t: tensor-parallel ranks per stage, shard: over the w replicas (none, optimizer, full)" if self.mesh else "")
        )
        lines = [head, legend, " | ".join(cols), " | ".join("---" for _ in cols)]
        for c in rows:
            ok = c.feasible
            lines.append(
                " | ".join(
                    [
                        str(c.width),
                        str(c.depth),
                        *((str(c.tensor), c.shard) if self.mesh else ()),
                        str(c.microbatch_size),
                        str(c.microbatches),
                        c.schedule,
                        _recompute_text(c),
                        f"{c.throughput:.1f}" if ok else "-",
                        f"{c.step_time * 1e3:.1f}" if ok else "-",
                        f"{c.allreduce_time * 1e3:.1f}" if ok else "-",
                        size_text(c.memory) if math.isfinite(c.memory) else "-",
                        ("exact" if c.exact else "screened") if ok else "-",
                        c.verdict,
                    ]
                )
            )
        c = self.chosen
        lines.append(
            f"chosen: w={c.width}, d={c.depth}, b={c.microbatch_size}, g={c.microbatches}, schedule={c.schedule}, "
            f"recompute per stage={list(c.stage_recompute)}, blocks per stage={[b - a for a, b in c.bounds]} "
            f"({self.partitioner} partition): {c.throughput:.1f} samples/s predicted, {size_text(c.memory)}"
        )
        lines.append(self.mesh_line())
        return "\n".join(lines + self.notes)

    def mesh_line(self) -> str:
        """The chosen mesh and the predicted memory of a rank of each stage."""
        c = self.chosen
        per_stage = ", ".join(size_text(m) for m in c.stage_memory)
        return f"mesh: {c.mesh}; predicted memory per rank: {size_text(c.memory)} at most (per stage: {per_stage})"

    def to_dict(self) -> dict:
        return {
            "chosen": self.chosen.to_dict(),
            "hardware": asdict(self.hardware),
            "global_batch": self.global_batch,
            "source": self.source,
            "planning_seconds": self.planning_seconds,
            "partitioner": self.partitioner,
            "mesh": {
                "pp": self.chosen.depth,
                "dp": self.chosen.width,
                "tp": self.chosen.tensor,
                "shard": self.chosen.shard,
                "searched": self.mesh_searched,
            },
            "candidates": [c.to_dict() for c in self.candidates],
        }


def size_text(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _recompute_text(c: Candidate) -> str:
    """off | on | "stages 0,2": the stages that recompute (not a bit string that reads like a number)."""
    if c.recompute != "stages":
        return c.recompute
    return "stages " + ",".join(str(s) for s, on in enumerate(c.stage_recompute) if on)


def _best_rows(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Per (w, d, schedule, r): the fastest feasible b, else the smallest b tried (with why)."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault((c.width, c.depth, c.tensor, c.shard, c.schedule, c.recompute), []).append(c)
    rows = []
    for group in groups.values():
        feasible = [c for c in group if c.feasible]
        rows.append(max(feasible, key=lambda c: c.throughput) if feasible else min(group, key=lambda c: c.microbatch_size))
    return rows


# ---- Algorithm 1 ------------------------------------------------------------------------------------
def grids(devices: int, blocks: int, every_device: bool = False) -> list[tuple[int, int]]:
    """Algorithm 1's loop: w = 1..N, d = 1..N/w (a grid may leave devices unused), at least one block
    per stage. `every_device`: only w x d = N (a run that starts N processes uses all of them)."""
    pairs = [(w, d) for w in range(1, devices + 1) for d in range(1, devices // w + 1) if d <= blocks]
    return [(w, d) for w, d in pairs if w * d == devices] if every_device else pairs


def check_reachable(devices: int, blocks: int, global_batch: int, schedules: Sequence[str] = ("2bw",)) -> None:
    """Before any profiling: some (w, d) exists, divides the global batch and (2bw alone) has g >= d."""
    pairs = grids(devices, blocks, every_device=True)  # the run starts all its processes
    if not pairs:
        raise ValueError(f"devices={devices}: no (width, depth) with width x depth = devices and depth <= {blocks} blocks")
    for w, d in pairs:
        if global_batch % w == 0 and (set(schedules) != {"2bw"} or global_batch // w >= d):
            return
    raise ValueError(
        f"global_batch={global_batch} is reachable by no (width, depth) on {devices} devices: each needs global_batch "
        f"divisible by the width{' and global_batch / width >= depth (2bw: g >= d)' if set(schedules) == {'2bw'} else ''}; "
        f"(width, depth) pairs: {pairs}"
    )


def plan_2bw(
    profile: SizedProfile,
    hw: Hardware,
    global_batch: int,
    schedules: Iterable[str] = ("2bw",),
    recompute: Iterable[str] = RECOMPUTE,
    max_microbatch_size: Optional[int] = None,
    refine: Optional[callable] = None,
    finalists: int = 6,
    cost_model: str = "simulated",
    every_device: bool = False,
    mesh: bool = False,
    kinds: Optional[Sequence[str]] = None,
    fixed_mesh: Optional[tuple[int, str]] = None,
) -> TwoBWPlan:
    """Algorithm 1 over every (w, d), schedule, r and b dividing B / w; the fastest that fits wins.
    (w, d) runs as Algorithm 1's loop does, w = 1..N, d = 1..N/w, so a grid on fewer than N devices
    competes; `every_device=True` keeps only w x d = N (the strategy: it starts all N processes).
    Every candidate is screened (`step_time(exact=False)`); the `finalists` fastest are simulated
    exactly and the best of those is chosen.

    `refine(costs_model, depth, m, schedule) -> bounds` re-partitions the chosen configuration (e.g.
    the AutoPipe planner); None keeps the min-max partition.

    `cost_model="closed"`: the paper's closed forms instead (`two_bw_closed.py`: even split of
    blocks, r off / on only, no simulation, no optimizer state), the baseline ours is measured against.

    `mesh=True` (ours, beside Algorithm 1): each candidate also gets a tensor-parallel degree T and a shard
    mode (`two_bw_mesh.py`); `kinds` (each block's kind, `entry.block_kinds`) says which blocks T splits.
    Off, Algorithm 1 runs as above: T = 1, the shard of `hw.shard_optimizer`. `fixed_mesh=(T, shard)`: the
    strategy's run, whose tensor degree and shard the user set: priced as `mesh` prices them, not searched."""
    if cost_model not in COST_MODELS:
        raise ValueError(f"cost_model={cost_model!r}: one of {list(COST_MODELS)}")
    if (mesh or fixed_mesh) and cost_model != "simulated":
        raise ValueError("mesh=True and fixed_mesh price tensor and shard on the simulated cost functions, not the paper's closed forms")
    if cost_model == "closed":
        recompute, refine = tuple(r for r in recompute if r != "stages"), None
    with paused_gc():  # one collection after planning instead of hundreds during it
        found = tuple(schedules), tuple(recompute), max_microbatch_size, refine, finalists, cost_model, every_device
        return _plan(profile, hw, global_batch, *found, mesh, tuple(kinds) if kinds else None, fixed_mesh)


def _plan(
    profile: SizedProfile,
    hw: Hardware,
    global_batch: int,
    schedules: tuple,
    recompute: tuple,
    max_microbatch_size: Optional[int],
    refine: Optional[callable],
    finalists: int,
    cost_model: str,
    every_device: bool,
    mesh: bool = False,
    kinds: Optional[tuple] = None,
    fixed_mesh: Optional[tuple[int, str]] = None,
) -> TwoBWPlan:
    started = time.perf_counter()
    searched_mesh = mesh
    mesh = mesh or fixed_mesh is not None
    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"schedule={s!r}: planner=2bw plans one of {list(SCHEDULES)}")
    for r in recompute:
        if r not in RECOMPUTE:
            raise ValueError(f"recompute option {r!r}: one of {list(RECOMPUTE)}")
    pairs = grids(hw.devices, profile.num_blocks, every_device)
    if not pairs:
        shape = "width x depth = devices" if every_device else "width x depth <= devices"
        raise ValueError(f"devices={hw.devices}: no (width, depth) with {shape} and depth <= {profile.num_blocks} blocks")
    candidates: list[Candidate] = []
    at: dict[int, BlockCosts] = {}
    meshed: dict[tuple, BlockCosts] = {}  # (b, tensor, shard, width) -> a rank's costs
    memo: dict[tuple, float] = {}  # screened step times: shard none and optimizer simulate the same pipeline
    found: dict[tuple, list[Candidate]] = {}  # shard none's candidates per (tensor, w, d, b, schedule)
    default_shard = "optimizer" if hw.shard_optimizer else "none"

    def costs_of(b: int, tensor: int, shard: str, width: int) -> BlockCosts:
        base = at.setdefault(b, profile.at(b))
        if not mesh:
            return base
        key = (b, tensor, "full" if shard == "full" else "none", width)
        if key not in meshed:
            meshed[key] = mesh_costs(base, kinds, tensor, shard, width, hw)
        return meshed[key]

    meshes = [fixed_mesh] if fixed_mesh is not None else mesh_options(hw, kinds, schedules) if searched_mesh else [(1, default_shard)]
    for tensor, shard in meshes:
        for w, d in grids(hw.devices // tensor, profile.num_blocks, every_device):
            if shard != "none" and w < 2 and (searched_mesh or shard == "full"):
                continue  # nothing to shard over (searched: the same as shard none)
            if global_batch % w:
                why = f"skipped: global batch {global_batch} is not a multiple of w={w}"
                candidates.append(Candidate(w, d, 0, 0, "-", "-", verdict=why, tensor=tensor, shard=shard))
                continue
            per_replica = global_batch // w
            sizes = [
                b for b in range(1, per_replica + 1) if per_replica % b == 0 and (max_microbatch_size is None or b <= max_microbatch_size)
            ]
            for b in sizes:
                costs = costs_of(b, tensor, shard, w)
                m = per_replica // b
                for schedule in schedules:
                    if mesh and shard == "full" and schedule not in FULL_SCHEDULES:
                        continue
                    if schedule == "2bw" and m < d:
                        why = f"skipped: 2bw needs g >= d (g={m} micro-batches, d={d})"
                        candidates.append(Candidate(w, d, b, m, schedule, "-", verdict=why, tensor=tensor, shard=shard))
                        continue
                    if cost_model == "simulated" and shard == "optimizer" and mesh:
                        # ZeRO-1 simulates the same pipeline as shard none and adds the owners' broadcast: only where none is over the limit
                        unsharded = {c.recompute for c in found.get((tensor, w, d, b, schedule), ()) if c.verdict == "runs"}
                        options_left = tuple(r for r in recompute if r not in unsharded)
                        candidates += _search(costs, w, d, b, m, schedule, options_left, hw, tensor, shard, memo)
                    elif cost_model == "simulated":
                        searched = _search(costs, w, d, b, m, schedule, recompute, hw, tensor, shard if mesh else None, memo)
                        found[(tensor, w, d, b, schedule)] = searched
                        candidates += searched
                    else:
                        candidates += _search_closed(costs, w, d, b, m, schedule, recompute, hw)
    feasible = [c for c in candidates if c.verdict == "runs"]
    if not feasible:
        raise NoConfiguration(candidates, hw, global_batch)
    for c in sorted(feasible, key=lambda c: -c.throughput)[:finalists]:  # screened -> exact
        if not c.exact:
            costs = costs_of(c.microbatch_size, c.tensor, c.shard, c.width)
            c.step_time = step_time(costs, c.bounds, c.stage_recompute, c.schedule, c.microbatches, hw, width=c.width * c.tensor)
            c.throughput, c.exact = throughput(c.step_time, c.allreduce_time, c.width, c.microbatch_size, c.microbatches), True
    ranked = sorted((c for c in feasible if c.exact), key=lambda c: (-c.throughput, c.memory))
    notes: list[str] = []
    pick = {id(c): c for c in ranked}
    if refine is not None:  # the partitioner re-plans the best few, so its gain can change their order
        for c in ranked[:REFINED]:
            again = _refined(c, costs_of(c.microbatch_size, c.tensor, c.shard, c.width), hw, refine, c.shard if mesh else None)
            if again.memory <= (hw.memory_limit or math.inf) and again.throughput > c.throughput:
                pick[id(c)] = again
    best = max(ranked, key=lambda c: (pick[id(c)].throughput, -pick[id(c)].memory))
    chosen = pick[id(best)]
    if best.width * best.depth * best.tensor < hw.devices:
        notes.append(
            f"the chosen grid w x d{' x t' if mesh else ''} = {best.width * best.depth * best.tensor} leaves "
            f"{hw.devices - best.width * best.depth * best.tensor} of the "
            f"{hw.devices} devices unused (Algorithm 1 allows it); a run on all {hw.devices} plans with every_device=True"
        )
    if refine is not None and chosen is best:
        notes.append("the partitioner's plan of the chosen configuration was no faster or over the limit: the min-max partition is kept")
    candidates = [replace(chosen, verdict="chosen") if c is best else c for c in candidates]
    chosen = next(c for c in candidates if c.verdict == "chosen")
    source = f"{profile.source} profile of {profile.model} at micro-batch sizes {profile.sizes}, {cost_model} cost functions"
    kept = refine is not None and chosen.bounds == best.bounds  # the partitioner's plan was not taken
    partitioner = "even (the paper's B/d)" if cost_model == "closed" else "min-max (dp)" if refine is None or kept else "refined"
    return TwoBWPlan(chosen, candidates, hw, global_batch, source, time.perf_counter() - started, partitioner, notes, mesh, searched_mesh)


def _search(
    costs: BlockCosts,
    w: int,
    d: int,
    b: int,
    m: int,
    schedule: str,
    options: tuple,
    hw: Hardware,
    tensor: int = 1,
    shard: Optional[str] = None,
    memo: Optional[dict] = None,
) -> list[Candidate]:
    """SEARCH for one (w, d, b, schedule): each recomputation option, its memory and, if it fits, its throughput.
    `tensor`, `shard` (ours, the mesh search; `costs` are then a rank's, `two_bw_mesh.mesh_costs`); None: Algorithm 1's."""
    memo = {} if memo is None else memo
    named = shard or ("optimizer" if hw.shard_optimizer else "none")
    limit = hw.memory_limit if hw.memory_limit is not None else math.inf
    found: list[Candidate] = []
    plans: dict[tuple[bool, ...], tuple] = {}
    off = (False,) * d
    for option in options:
        if option == "off":
            flags = off
        elif option == "on":
            flags = (True,) * d
        else:  # ours: only the stages over the limit without recomputation
            bounds0 = _bounds(costs, d, off)
            flags = tuple(s > limit for s in memory(costs, bounds0, off, schedule, m, hw, w, shard))
            if not any(flags) or all(flags):
                continue  # the same as off or on
        bounds = plans.setdefault(flags, _bounds(costs, d, flags))
        stage_memory = memory(costs, bounds, flags, schedule, m, hw, w, shard)
        c = Candidate(
            w, d, b, m, schedule, option, flags, bounds, memory=max(stage_memory), stage_memory=stage_memory, tensor=tensor, shard=named
        )
        if c.memory > limit:
            c.verdict = "over memory_limit"
        else:
            key = (id(costs), bounds, flags, schedule, m, hw.pipeline_bandwidth(d, w * tensor))
            if key not in memo:
                memo[key] = step_time(costs, bounds, flags, schedule, m, hw, exact=False, width=w * tensor)
            c.step_time = memo[key]
            c.exact = m <= max(16, 2 * d)
            c.allreduce_time = allreduce_time(costs, bounds, w, hw, shard, tensor)
            c.throughput = throughput(c.step_time, c.allreduce_time, w, b, m)
            c.verdict = "runs"
        found.append(c)
    return found


def _search_closed(costs: BlockCosts, w: int, d: int, b: int, m: int, schedule: str, options: tuple, hw: Hardware) -> list[Candidate]:
    """The paper's SEARCH on its closed forms: r off / on, the even split, no simulation."""
    limit = hw.memory_limit if hw.memory_limit is not None else math.inf
    found = []
    bounds = even_bounds(len(costs.forward), d)
    for option in options:
        on = option == "on"
        footprint = closed_memory(costs, d, schedule, m, on) + hw.runtime_bytes  # the paper's MEMORY(.) and the process (ours)
        c = Candidate(w, d, b, m, schedule, option, (on,) * d, bounds, memory=footprint, stage_memory=(footprint,) * d, exact=True)
        if footprint > limit:
            c.verdict = "over memory_limit"
        else:
            # one micro-batch per step (g = 1) is not pipelined: the paper's sum over stages
            c.step_time = m * closed_step(costs, d, w, m, on, hw, pipelined=m > 1)
            c.throughput, c.verdict = w * b * m / c.step_time, "runs"
        found.append(c)
    return found


def _bounds(costs: BlockCosts, depth: int, flags: Sequence[bool]) -> tuple:
    """Min-max partition of each block's forward + backward (recomputed backward if every stage recomputes)."""
    return _min_max(costs, depth, bool(flags) and all(flags))


@lru_cache(maxsize=4096)
def _min_max(costs: BlockCosts, depth: int, recomputed: bool) -> tuple:
    backward = costs.recompute_backward if recomputed else costs.backward
    weights = [f + bw for f, bw in zip(costs.forward, backward)]
    return tuple(tuple(x) for x in min_max_bounds(weights, depth))


def _refined(best: Candidate, costs: BlockCosts, hw: Hardware, refine: callable, shard: Optional[str] = None) -> Candidate:
    d, flags, span = best.depth, best.stage_recompute, best.width * best.tensor
    model = costs.cost_model(best.bounds, flags, hw.pipeline_bandwidth(d, span), hw.latency)
    bounds = tuple(tuple(x) for x in refine(model, d, min(best.microbatches, d + min(d, 8)), best.schedule))
    stage_memory = memory(costs, bounds, flags, best.schedule, best.microbatches, hw, best.width, shard)
    step = step_time(costs, bounds, flags, best.schedule, best.microbatches, hw, width=span)
    ar = allreduce_time(costs, bounds, best.width, hw, shard, best.tensor)
    return replace(
        best,
        bounds=bounds,
        stage_memory=stage_memory,
        memory=max(stage_memory),
        step_time=step,
        allreduce_time=ar,
        throughput=throughput(step, ar, best.width, best.microbatch_size, best.microbatches),
    )


class NoConfiguration(ValueError):
    """No (w, d, b, r) fits: the error names the setting to change and the smallest footprint found."""

    def __init__(self, candidates: Sequence[Candidate], hw: Hardware, global_batch: int):
        sized = [c for c in candidates if math.isfinite(c.memory)]
        if sized:
            small = min(sized, key=lambda c: c.memory)
            limit = hw.memory_limit or math.inf
            message = (
                f"memory_limit={size_text(limit)}: no configuration fits on {hw.devices} devices; the smallest footprint "
                f"found is {size_text(small.memory)} (w={small.width}, d={small.depth}, b={small.microbatch_size}, "
                f"schedule={small.schedule}, recompute={small.recompute}). Raise memory_limit or use more devices"
            )
            self.setting = "memory_limit"
        else:
            reasons = sorted({c.verdict for c in candidates})
            message = f"global_batch={global_batch}: no configuration reaches it on {hw.devices} devices ({'; '.join(reasons)})"
            self.setting = "global_batch"
        super().__init__(message)
        self.candidates = list(candidates)
