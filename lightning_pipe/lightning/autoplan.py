"""`partition="autopipe"` (or any planner), `slicer` or `schedule="auto"`: profile the blocks on the
real ranks, then plan with `planning.entry.plan_run` (the plan command's decision too).

Runs in the strategy's setup, before the model is cut:
1. A sample micro-batch is taken from the training dataset directly (not through the DataLoader,
   whose sampler state must stay untouched for exact training) and the user's own step is run up
   to the pipeline call, which gives the pipeline's input.
2. Each rank profiles its share of the blocks (a uniform cut) on its own device, the shares are
   all-gathered, so every rank holds the same profile and computes the same plan.
3. The random-number state and the blocks' buffers are restored afterwards, so profiling leaves no
   trace in training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..legality import COMPILE_EXCLUDED
from ..models.init import is_meta, profiling_blocks
from ..planning.auto import adam_weight_copies, memory_line, stage_memory, version_share
from ..planning.entry import BLOCK_KINDS as KINDS  # noqa: F401  (benchmarks read it here)
from ..planning.entry import DEFAULT_LINKS, RunPlan, block_kinds, link_model, plan_run  # noqa: F401
from ..planning.gathers import gather_times, with_gathers
from ..planning.partition import partition_blocks
from ..planning.tensor import split_by_tensor, splits_vocabulary
from ..profiling import Profile, profile_blocks
from ..profiling.collectives import measure_collectives
from ..profiling.messages import MessageCosts, measure_messages
from ..profiling.runtime import runtime_bytes
from ..runtime.call import as_input
from ..runtime.tied import tied_blocks
from ..schedules import ScheduleSpec
from ..simulation.timelines import chrome_trace, gantt, traced_timeline
from .compiling import compile_blocks, uncompile_blocks
from .context import RankContext
from .metric_state import untouched
from .profile_precision import run_precision
from .stage import _Handoff

log = logging.getLogger(__name__)


def dataset_sample(trainer: Any, size: int) -> Optional[Any]:
    """The first `size` samples of the training (or else validation) dataset, collated as its
    DataLoader would (None if there is none to take)."""
    for loader, dataset in _datasets(trainer):
        collate = getattr(loader, "collate_fn", None) or torch.utils.data.default_collate
        return collate([dataset[i % len(dataset)] for i in range(size)])
    return None


def _datasets(trainer: Any) -> Any:
    for source in (trainer.fit_loop._data_source, trainer.validate_loop._data_source):
        try:
            loader = source.dataloader() if source.is_defined() else None
        except Exception:  # a user hook that needs more setup than we have: fall back
            loader = None
        loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
        dataset = getattr(loader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or len(dataset) == 0:
            continue
        yield loader, dataset


def sample_microbatch(trainer: Any, microbatches: int) -> tuple[Optional[Any], int]:
    """A micro-batch (batch size // microbatches samples) of the training (or else validation)
    dataset, collated as the DataLoader would, and its size; (None, 0) if there is none to take."""
    for loader, dataset in _datasets(trainer):
        return loader_sample(loader, dataset, microbatches)
    return None, 0


def loader_sample(loader: Any, dataset: Any, microbatches: int) -> tuple[Any, int]:
    collate = getattr(loader, "collate_fn", None) or torch.utils.data.default_collate
    size = max(1, min((getattr(loader, "batch_size", None) or 1) // microbatches, len(dataset)))
    return collate([dataset[i] for i in range(size)]), size


def pipeline_input(module: Any, pipeline: nn.Sequential, batch: Any) -> Any:
    """Run the user's training_step on `batch` until it calls the pipeline; return the call's input."""

    def stop(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Handoff(as_input(args, kwargs))

    handle = pipeline.register_forward_pre_hook(stop, with_kwargs=True)
    module.log = lambda *a, **k: None  # type: ignore[method-assign]  # no logging outside the loop
    try:
        with torch.no_grad():
            module.training_step(batch, 0)
    except _Handoff as handoff:
        return handoff.value
    finally:
        handle.remove()
        del module.log
    raise RuntimeError("training_step never called the pipeline; call self.<pipeline>(x) in it")


def step_loss(module: Any, pipeline: nn.Sequential, batch: Any) -> Any:
    """`loss_fn(output)`: the rest of the user's training_step after the pipeline call, on `output`
    (so the profile charges the loss to the last block, as the last stage pays it)."""

    def loss_fn(output: Any) -> Any:
        pipeline.forward = lambda *args, **kwargs: output  # type: ignore[method-assign]  # skip the blocks
        try:
            result = module.training_step(batch, 0)
        finally:
            del pipeline.forward
        return result["loss"] if isinstance(result, dict) else result

    return loss_fn


def profile_pipeline(
    module: Any,
    pipeline: nn.Sequential,
    batch: Any,
    device: torch.device,
    rank: int,
    world: int,
    model_name: str,
    microbatch_size: int,
    repeats: int = 3,
    precision: Optional[Any] = None,
) -> Profile:
    """The blocks' costs (collective: each rank times its uniform share), in the run's `precision`
    (Lightning's plugin, `profile_precision`), and the process's runtime memory."""
    runtime = runtime_bytes(device, [module])  # before profiling adds buffers of its own
    with run_precision(precision, pipeline) as convert_input:
        args = (module, pipeline, convert_input(batch), device, rank, world, model_name, microbatch_size, repeats)
        return dataclasses.replace(_measure(*args), runtime_bytes=max(all_ranks(runtime, world)))


def _measure(
    module: Any,
    pipeline: nn.Sequential,
    batch: Any,
    device: torch.device,
    rank: int,
    world: int,
    model_name: str,
    microbatch_size: int,
    repeats: int,
) -> Profile:
    blocks = list(pipeline)
    shares = min(world, len(blocks))  # more ranks than blocks (replicas, tensor groups): the last ranks time none
    mine = range(*partition_blocks("uniform", len(blocks), shares).bounds[rank]) if rank < shares else range(0)
    if is_meta(pipeline):  # a meta-built model: values only for this rank's share, one block at a time before it
        blocks = profiling_blocks(blocks, mine)
    buffers = [{n: b.detach().clone() for n, b in blk.named_buffers()} for blk in blocks]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), untouched(module):  # the user's step runs here: metrics as if it had not
        x = pipeline_input(module, pipeline, batch)
        module.log = lambda *a, **k: None  # type: ignore[method-assign]  # the loss step logs nothing here
        try:  # the rank's blocks run together, 2 micro-batches in flight: caches as busy as in training
            measured = profile_blocks(
                blocks,
                x,
                device,
                model=model_name,
                repeats=repeats,
                warmup=1,
                indices=list(mine),
                inflight=2,
                loss_fn=step_loss(module, pipeline, move_data_to_device(batch, device)),
            )
        finally:
            del module.log
    for blk, saved in zip(blocks, buffers):  # e.g. BatchNorm statistics: as if never run
        for n, b in blk.named_buffers():
            b.data.copy_(saved[n])
    merged = {i: v for part in all_ranks(measured, world) for i, v in part.items()}
    field = lambda name: [merged[i][name] for i in range(len(blocks))]  # noqa: E731
    dtype = str(next((p.dtype for p in pipeline.parameters()), torch.float32)).replace("torch.", "")
    return Profile(
        model_name,
        microbatch_size,
        dtype,
        device.type,
        field("forward"),
        field("backward"),
        field("activation_bytes"),
        field("param_bytes"),
        field("peak_memory"),
        [type(b).__name__ for b in blocks],
        weight=field("weight") if all("weight" in merged[i] for i in merged) else [],
        backward_input=field("backward_input") if all("backward_input" in merged[i] for i in merged) else [],
    )


def all_ranks(value: Any, world: int) -> list:
    """Every rank's `value` (a collective when world > 1)."""
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, value)
        return parts
    return [value]


# Link models when none is given: a GPU pipeline over NVLink / PCIe, a CPU one over loopback gloo.
def profile_messages(profile: Profile, chain: list[int], device: torch.device, depth: int) -> MessageCosts:
    """Message costs on the pipeline's ranks (collective): the median block output's size, and a
    stage's forward time (0.2-5 ms) of work between hops, busy on CPU, idle on an accelerator."""
    nbytes = int(sorted(profile.activation_bytes)[len(profile.activation_bytes) // 2])
    think = min(max(sum(profile.forward) / depth, 2e-4), 5e-3)
    costs = measure_messages(chain, nbytes, device, think=think, sleep=device.type != "cpu")
    assert costs is not None  # depth > 1
    return costs


class AutoPlanner:
    """Profile -> (choose a schedule) -> plan -> (slice) for the strategy; also keeps and writes
    traces of real steps."""

    def __init__(self, config: Any):
        self.config = config
        self.profile_path = config.profile
        self._trace: Optional[tuple[Any, list]] = None
        self.out_dir: Optional[Path] = None
        self.profile: Optional[Profile] = None  # what the plan was made from (adaptive re-partitioning reads them)
        self.costs: Optional[Any] = None
        self.collectives: Optional[Any] = None  # shard=full: the replicas' collectives, measured once

    def memory_limit(self, device: torch.device) -> Optional[float]:
        """schedule="auto"'s limit: as configured, else a GPU's total memory; none on CPU."""
        if self.config.memory_limit is not None:
            return float(self.config.memory_limit)
        if device.type == "cuda":
            return float(torch.cuda.get_device_properties(device).total_memory)
        return None

    def run(self, ctx: RankContext, module: Any, pipeline: nn.Sequential, spec: ScheduleSpec) -> RunPlan:
        """Profile on the ranks, then `plan_run` (the plan command's decision too); rank 0's result is final."""
        self.out_dir = ctx.out_dir
        depth, m = ctx.depth, self.config.microbatches
        sample, mbs = sample_microbatch(module.trainer, m)
        if sample is None and self.profile_path is None:
            if ctx.global_rank == 0:
                log.warning(f"no map-style dataset to profile with: running {spec.name} on a uniform partition, no slicing")
            bounds = partition_blocks(self.config.fixed_partition, len(pipeline), spec.chunk_count(depth)).bounds
            return RunPlan(tuple(map(tuple, bounds)), spec, depth, m)
        start = time.perf_counter()
        compiled = self.config.compile is True
        plans = {compiled: self._plan(ctx, module, pipeline, sample, mbs, compiled)}
        if self.config.compile == "auto":  # the same blocks compiled, profiled and planned again; the faster kept
            compile_blocks(pipeline, split=self.config.tensor > 1)
            plans[True] = self._plan(ctx, module, pipeline, sample, mbs, True)
            times = {k: plan[2].choice.chosen.iteration_time for k, plan in plans.items()}
            compiled = times[True] < times[False]  # a tie: no compile
        result = plans[compiled][2]
        box = [(result.bounds, result.spec, result.sliced, result.costed, compiled)]
        if ctx.topology.world_size > 1:  # the same numbers everywhere already; rank 0's word is final
            dist.broadcast_object_list(box, 0)
        bounds, spec, sliced, costed, compiled = box[0]
        if self.config.compile == "auto" and not compiled:
            uncompile_blocks(pipeline)
        profile, costs, result = plans[compiled]
        self.profile, self.costs = profile, costs
        if (bounds, spec, sliced) != (result.bounds, result.spec, result.sliced):
            result = RunPlan(bounds, spec, depth, m, sliced)
        result.costed = costed  # zb-auto: every rank builds its schedule from rank 0's costs
        if ctx.global_rank == 0:
            weighed = {("compiled" if k else "eager"): plan[2].choice for k, plan in plans.items()} if len(plans) > 1 else None
            self._report(profile, costs, result, time.perf_counter() - start, weighed, compiled)
        return result

    def _plan(self, ctx: RankContext, module: Any, pipeline: nn.Sequential, sample: Any, mbs: int, compiled: bool) -> tuple:
        """Profile the blocks as they are now and plan on them; compiled blocks: without the schedules
        whose split backward they cannot run."""
        profile, costs = self._profile(ctx, module, pipeline, sample, mbs)
        names = [type(b).__name__ for b in pipeline]
        kinds = block_kinds(names)
        vocab = splits_vocabulary(names) and not callable(getattr(module, "parallelize_block", None))  # our plan's split
        costs = split_by_tensor(costs, kinds, self.config.tensor, vocab)  # profiled whole, run split over tp
        costs = self.costs = self._with_gathers(ctx, costs)
        exclude = COMPILE_EXCLUDED if compiled else ()
        # shard=full shards each block on its own: blocks sharing a weight (a tied embedding and head) on different ranks
        apart = tied_blocks(pipeline) if self.config.shard == "full" and self.config.width > 1 else []
        return profile, costs, plan_run(costs, ctx.depth, self.config, kinds, self.memory_limit(ctx.device), exclude, apart)

    def _with_gathers(self, ctx: RankContext, costs: Any) -> Any:
        """shard=full: FSDP2's all-gathers over the stage's replicas charged to each block (`planning.gathers`),
        the collectives measured on this rank's data-parallel group; rank 0's fit on every rank, so all plan alike."""
        c = self.config
        if c.shard != "full" or c.width < 2:
            return costs
        if self.collectives is None:
            box = [measure_collectives(ctx.groups.stage, ctx.device)]
            dist.broadcast_object_list(box, 0)
            self.collectives = box[0]
        return with_gathers(costs, c.width, c.reshard, c.microbatches, self.collectives)

    def _profile(self, ctx: RankContext, module: Any, pipeline: nn.Sequential, sample: Any, mbs: int) -> tuple[Profile, Any]:
        topo = ctx.topology
        if self.profile_path is not None:
            profile = Profile.load(self.profile_path)
            profile.check_blocks(len(pipeline))
        else:
            where = (ctx.device, ctx.global_rank, topo.world_size, type(module).__name__, mbs)
            profile = profile_pipeline(module, pipeline, sample, *where, precision=module.trainer.precision_plugin)
            if self.config.message_costs and topo.depth > 1:
                profile.messages = profile_messages(profile, topo.pipeline_ranks(0), ctx.device, topo.depth).to_dict()
        costs = profile.costs(*link_model(self.config, ctx.device.type))
        self.profile, self.costs = profile, costs
        return profile, costs

    def profile_only(self, ctx: RankContext, module: Any, pipeline: nn.Sequential) -> None:
        """A profile without a plan (adaptive on a listed or resumed partition)."""
        sample, mbs = sample_microbatch(module.trainer, self.config.microbatches)
        if sample is None and self.profile_path is None:
            raise RuntimeError(
                "adaptive=True measures each rank against the blocks' profile, and there is no map-style training dataset "
                "to profile with: pass profile= (a saved profile.json) or a dataset with __getitem__"
            )
        self._profile(ctx, module, pipeline, sample, mbs)

    def _report(
        self, profile: Profile, costs: Any, result: RunPlan, seconds: float, weighed: Optional[dict] = None, compiled: bool = False
    ) -> None:
        out = self._out()
        profile.save(out / "profile.json")
        timeline = result.timeline(costs)
        copies = adam_weight_copies(self.config.shard, self.config.width, self.config.reshard)
        extra = version_share(self.config.shard, self.config.width)  # 2BW's stash
        memory = stage_memory(timeline, copies, costs.runtime_bytes, extra)  # what schedule="auto" holds to memory_limit
        summary = {"profile": profile.key, "profiled_and_planned_seconds": seconds, **result.summary(), "messages": profile.messages}
        summary["predicted_memory_bytes"] = {"per_rank": memory, "weight_copies": copies, "runtime_bytes": costs.runtime_bytes}
        if self.collectives is not None:  # shard=full: what FSDP2's gathers were priced at
            gathers = gather_times(costs, self.config.width, self.collectives)
            summary["gathers"] = {"seconds_per_block": gathers, "reshard": self.config.reshard, "collectives": self.collectives.source}
            rank_zero_info(
                f"shard='full': all-gathers of each block's weights over the {self.config.width} replicas priced at "
                f"{sum(gathers) * 1e3:.3f} ms for the model's blocks ({self.collectives.source}), "
                + ("once a step" if self.config.reshard == "step" else "before every forward and backward")
            )
        if weighed is not None:  # compile='auto': both plans, the one kept
            summary["compile"] = {"chosen": "compiled" if compiled else "eager", **{k: c.to_dict() for k, c in weighed.items()}}
            rank_zero_info(
                "compile='auto': "
                + ", ".join(f"{k} blocks {c.chosen.name} {c.chosen.iteration_time * 1e3:.3f} ms" for k, c in weighed.items())
                + f" (simulated step): running them {'compiled' if compiled else 'eager'}"
            )
        (out / "plan.json").write_text(json.dumps(summary, indent=1))
        gantt(timeline, out / "plan_timeline.png", title=f"predicted: {timeline.schedule.name}, chunks {[b - a for a, b in result.bounds]}")
        if profile.message_costs is not None:
            rank_zero_info("messages (planned with): " + profile.message_costs.summary())
        for lines in result.report():
            rank_zero_info("\n" + lines)
        rank_zero_info(
            memory_line(memory, self.config.shard, self.config.width, costs.runtime_bytes, self.config.reshard, self.config.tensor)
        )
        rank_zero_info(f"plan, profile and predicted timeline written to {out}")

    def _out(self) -> Path:
        assert self.out_dir is not None, "prepare() runs in setup"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir

    # ---- traces of real steps ---------------------------------------------------------------
    def keep_trace(self, executor: Any) -> None:
        origin = min((s for _, s, _ in executor.records), default=0.0)
        self._trace = (executor.schedule, [(i, s - origin, e - origin) for i, s, e in executor.records])

    def write_trace(self, ctx: RankContext) -> None:
        """Gather the last traced step of replica 0's stages to rank 0; draw it and write a Chrome trace."""
        if self._trace is None or ctx.replica_index != 0:
            return
        self.out_dir = ctx.out_dir
        schedule, mine = self._trace
        parts = [None] * ctx.depth if ctx.global_rank == 0 else None
        if ctx.depth > 1:
            dist.gather_object(mine, parts, dst=0, group=ctx.groups.pipeline)
        else:
            parts = [mine]
        if ctx.global_rank == 0:
            timeline = traced_timeline(schedule, parts)
            out = self._out()
            chrome_trace(timeline, out / "trace.json")
            gantt(timeline, out / "trace_timeline.png", title=f"measured: {schedule.name}, last training step")
            rank_zero_info(f"measured iteration {timeline.iteration_time * 1e3:.2f} ms; trace written to {out}")
