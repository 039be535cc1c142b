"""Cutting the user's module down to this rank's stage.

The partition comes from, in this order: the checkpoint being resumed at its depth unless a
partition is listed (its partition and schedule, exactly, not a new and noisy plan), the planner
(a named partitioner, the slicer or schedule="auto": profile first), or the fixed setting (listed
sizes, else equal block counts).
The pipeline's `nn.Sequential` is then replaced by a `PipelineStage` holding this rank's blocks
under their original indices, so state-dict keys stay the full model's.

A model built on the meta device (`trainer.init_module(empty_init=True)`, `configure_model()`)
is planned from block-by-block profiles, and each rank then creates and initialises only its own
blocks (models/init.py): no rank ever holds the whole model, and the weights are those a one-process
run starts from when the module defines `init_pipeline_block(index, block)` (our GPT and BERT do).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ..adaptive.switch import skeleton
from ..frontend import TracedPipeline, restore
from ..frontend.weights import init_traced_block, release_others
from ..models.init import InitBlock, draw_seed, is_meta, materialize, reset_block, seeded
from ..planning.partition import partition_blocks
from ..runtime.tied import find_tied_parameters, tie_groups
from ..schedules import ScheduleSpec
from .autoplan import AutoPlanner
from .checkpoint.resume import resumed_layout, resumed_state
from .compiling import compile_blocks
from .context import RankContext
from .cut import Bounds, Cut
from .stage import PipelineStage, check_no_outside_parameters, find_pipeline, set_submodule

log = logging.getLogger(__name__)


def held_bytes(module: nn.Module, optimizers: list[Any]) -> float:
    """What the stage holds whatever the schedule: its parameters, their gradients and the optimizers' state."""
    total = sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in module.parameters())
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return float(total)


def choose_layout(
    ctx: RankContext, planner: AutoPlanner, module: Any, pipeline: nn.Sequential
) -> tuple[ScheduleSpec, Bounds, int, Any, Any, Any]:
    """(schedule, bounds, sliced, plan, choice, costed) for this run; `costed` builds a schedule made
    from the run's costs (zb-auto), else None."""
    config, depth = ctx.config, ctx.depth
    spec = config.schedule_spec
    fitting = module.trainer.state.fn == TrainerFn.FITTING
    listed = not isinstance(config.partition, str)
    resumed = resumed_layout(resumed_state(ctx.checkpoint_io, ctx.resume_path), depth, listed) if fitting else None
    if resumed is not None:
        if config.auto and resumed.schedule is not None:
            spec = resumed.schedule
        # (a schedule built from costs is planned again: the checkpoint keeps no costs; flush schedules
        # all give one process's gradients, so the trajectory is the same)
        if resumed.bounds is not None and len(resumed.bounds) == spec.chunk_count(depth) and not spec.kind.costed:
            return spec, resumed.bounds, resumed.sliced, None, None, None
        # else (another schedule asked for): plan anew; optimizer states follow the parameters' names
    if config.needs_profile:
        result = planner.run(ctx, module, pipeline, spec)
        return result.spec, tuple(map(tuple, result.bounds)), result.sliced, result.plan, result.choice, result.costed
    bounds = partition_blocks(config.fixed_partition, len(pipeline), spec.chunk_count(depth)).bounds
    return spec, bounds, 0, None, None, None


def cut_module(ctx: RankContext, planner: AutoPlanner, module: Any) -> Cut:
    path, pipeline = find_pipeline(module, ctx.config.blocks)
    check_no_outside_parameters(module, path)
    if ctx.config.compile is True:  # before the profile: the planners plan on compiled costs ('auto': autoplan.py)
        compile_blocks(pipeline, split=ctx.config.tensor > 1)
    spec, bounds, sliced, plan, choice, costed = choose_layout(ctx, planner, module, pipeline)
    if ctx.config.adaptive and planner.costs is None:  # the monitor's ratios and the scorer's costs
        planner.profile_only(ctx, module, pipeline)
    placement = spec.placement(ctx.depth, ctx.config.microbatches)
    mine = {c: bounds[c] for c in range(len(placement)) if placement[c] == ctx.stage_index}
    blocks = {i: pipeline[i] for start, stop in mine.values() for i in range(start, stop)}
    built_empty = is_meta(pipeline)
    traced = isinstance(pipeline, TracedPipeline)
    if built_empty:  # a traced model's blocks share its modules: the whole model is `within`
        materialize(blocks, block_initializer(ctx, module, pipeline), within=pipeline.original if traced else pipeline)
    recompute = ctx.config.recompute_stages(ctx.depth)[ctx.stage_index]
    stage = PipelineStage(blocks, mine, len(pipeline), recompute=recompute)
    tied = find_tied_parameters(pipeline, bounds, placement)
    skeletons = {i: skeleton(pipeline[i]) for i in range(len(pipeline)) if i not in blocks}
    full = pipeline if ctx.global_rank == 0 and not built_empty else None  # a meta-built model is not gathered back
    if traced and full is None:  # the model's other parts stay referenced by its forward: keep their shapes only
        release_others(pipeline, blocks.values())
    set_submodule(module, path, stage)
    # every rank's own line: the plan's table (rank 0) already lists what each stage holds
    log.debug(f"rank {ctx.global_rank}: stage {ctx.stage_index}/{ctx.depth} holds chunks {mine} (blocks [start, stop))")
    cut = Cut(path, full, stage, spec, tuple(tuple(b) for b in bounds), placement, sliced, plan, choice, tied)
    cut.skeletons, cut.ties, cut.built_empty, cut.costed = skeletons, tie_groups(pipeline), built_empty, costed
    return cut


def block_initializer(ctx: RankContext, module: Any, pipeline: nn.Sequential) -> InitBlock:
    """The module's `init_pipeline_block(index, block)`, else every sub-module's reset_parameters()
    under a per-block seed that all ranks share (global rank 0's)."""
    if callable(getattr(module, "init_pipeline_block", None)):  # a user hook, as Lightning's configure_model
        return module.init_pipeline_block
    seed = [getattr(pipeline, "init_seed", None) or draw_seed()]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(seed, src=0)
    if isinstance(pipeline, TracedPipeline):
        return init_traced_block(pipeline, lambda index: seeded(seed[0], index))

    def init(index: int, block: nn.Module) -> None:
        with seeded(seed[0], index):
            reset_block(block)

    return init


def uncut_module(module: Any, cut: Cut, state: dict[str, Any]) -> None:
    """Put the full pipeline back with the trained weights of every stage (`state`: the gathered
    full state dict, on global rank 0)."""
    prefix = cut.path + "."
    assert cut.pipeline is not None
    cut.pipeline.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    set_submodule(module, cut.path, restore(cut.pipeline) if isinstance(cut.pipeline, TracedPipeline) else cut.pipeline)
