"""Cutting the user's module down to this rank's stage.

The partition comes from, in this order: the checkpoint being resumed at its depth unless a
partition is listed (its partition and schedule, exactly, not a new and noisy plan), the planner
(a named partitioner, the slicer or schedule="auto": profile first), or the fixed setting (listed
sizes, else equal block counts).
The pipeline's `nn.Sequential` is then replaced by a `PipelineStage` holding this rank's blocks
under their original indices, so state-dict keys stay the full model's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ..adaptive.switch import skeleton
from ..modes.advance import AdvanceRule
from ..planning.partition import partition_blocks
from ..runtime.p2p import Transport
from ..runtime.tied import TiedParameter, TieGroup, find_tied_parameters, tie_groups
from ..schedules import ScheduleSpec
from .checkpoints import resumed_layout
from .stage import PipelineStage, check_no_outside_parameters, find_pipeline, set_submodule

log = logging.getLogger(__name__)
Bounds = tuple[tuple[int, int], ...]


@dataclass
class Cut:
    path: str  # where the pipeline sits in the module
    pipeline: Optional[nn.Sequential]  # the full pipeline, kept on global rank 0 to hand the trained model back
    stage: PipelineStage
    spec: ScheduleSpec  # the schedule it was cut for (schedule="auto": the one chosen)
    bounds: Bounds  # block range of every model chunk
    placement: tuple[int, ...]  # the rank holding each chunk
    sliced: int = 0  # warm-up micro-batches the slicer cuts in halves
    plan: Optional[Any] = None  # the Plan (planner partitions)
    choice: Optional[Any] = None  # schedule="auto": every candidate and the chosen one
    tied: list[TiedParameter] = field(default_factory=list)
    # for live switches (adaptive): meta-device copies of the blocks this rank does not hold, and
    # which blocks share a weight, by name
    skeletons: dict[int, nn.Module] = field(default_factory=dict)
    ties: list[TieGroup] = field(default_factory=list)
    switched: bool = False  # the partition changed while training (checkpoints keep it on resume)

    @property
    def chunk_blocks(self) -> dict[int, list[int]]:
        """This rank's chunks -> their block indices."""
        return {c: list(range(*self.bounds[c])) for c in self.stage.chunk_bounds}

    def mode_settings(self, strategy: Any) -> dict[str, Any]:
        """What a training mode (lightning_pipe.modes) is built from."""
        topo, replica, config = strategy.topology, strategy.replica_index, strategy.config
        transport = Transport(lambda r: topo.global_rank(replica, r), strategy.root_device)
        extra: dict[str, Any] = {}
        if config.schedule == "advance" and config.advance_num is None:  # AvgPipe's Algorithm 1 chooses it
            extra["advance"] = AdvanceRule(
                topo.depth, config.microbatches, strategy.stage_index, config.memory_limit, lambda: held_bytes(strategy)
            )
        return dict(
            **extra,
            spec=self.spec,
            stages=topo.depth,
            microbatches=config.microbatches,
            rank=strategy.stage_index,
            transport=transport,
            prefetch=config.prefetch,
            trace=config.trace,
            sliced=self.sliced,
        )

    @property
    def loss_stage(self) -> int:
        """The rank holding the last chunk computes the loss (the last stage, or rank 0 in a wave)."""
        return self.placement[-1]


def held_bytes(strategy: Any) -> float:
    """What the stage holds whatever the schedule: its parameters, their gradients and the optimizers' state."""
    params = [p for p in strategy.model.parameters()] if strategy.model is not None else []
    total = sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in params)
    for optimizer in getattr(strategy, "optimizers", []) or []:
        for state in getattr(optimizer, "state", {}).values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return float(total)


def choose_layout(strategy: Any, module: Any, pipeline: nn.Sequential) -> tuple[ScheduleSpec, Bounds, int, Any, Any]:
    """(schedule, bounds, sliced, plan, choice) for this run."""
    config, depth = strategy.config, strategy.topology.depth
    spec = config.schedule_spec
    fitting = module.trainer.state.fn == TrainerFn.FITTING
    resumed = resumed_layout(strategy, strategy.resume_path) if fitting else None
    if resumed is not None:
        if config.auto and resumed.schedule is not None:
            spec = resumed.schedule
        if resumed.bounds is not None and len(resumed.bounds) == spec.chunk_count(depth):
            return spec, resumed.bounds, resumed.sliced, None, None
        # else (another schedule asked for): plan anew; optimizer states follow the parameters' names
    if config.needs_profile:
        result = strategy.planner.run(strategy, module, pipeline, spec)
        return result.spec, tuple(map(tuple, result.bounds)), result.sliced, result.plan, result.choice
    bounds = partition_blocks(config.fixed_partition, len(pipeline), spec.chunk_count(depth)).bounds
    return spec, bounds, 0, None, None


def cut_module(strategy: Any, module: Any) -> Cut:
    path, pipeline = find_pipeline(module)
    check_no_outside_parameters(module, path)
    spec, bounds, sliced, plan, choice = choose_layout(strategy, module, pipeline)
    if strategy.config.adaptive and strategy.planner.costs is None:  # the monitor's ratios and the scorer's costs
        strategy.planner.profile_only(strategy, module, pipeline)
    placement = spec.placement(strategy.topology.depth, strategy.config.microbatches)
    mine = {c: bounds[c] for c in range(len(placement)) if placement[c] == strategy.stage_index}
    blocks = {i: pipeline[i] for start, stop in mine.values() for i in range(start, stop)}
    recompute = strategy.config.recompute_stages(strategy.topology.depth)[strategy.stage_index]
    stage = PipelineStage(blocks, mine, len(pipeline), recompute=recompute)
    tied = find_tied_parameters(pipeline, bounds, placement)
    skeletons = {i: skeleton(pipeline[i]) for i in range(len(pipeline)) if i not in blocks}
    full = pipeline if strategy.global_rank == 0 else None
    set_submodule(module, path, stage)
    log.info(
        f"rank {strategy.global_rank}: stage {strategy.stage_index}/{strategy.topology.depth} holds chunks {mine} (blocks [start, stop))"
    )
    cut = Cut(path, full, stage, spec, tuple(tuple(b) for b in bounds), placement, sliced, plan, choice, tied)
    cut.skeletons, cut.ties = skeletons, tie_groups(pipeline)
    return cut


def uncut_module(module: Any, cut: Cut, state: dict[str, Any]) -> None:
    """Put the full pipeline back with the trained weights of every stage (`state`: the gathered
    full state dict, on global rank 0)."""
    prefix = cut.path + "."
    assert cut.pipeline is not None
    cut.pipeline.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    set_submodule(module, cut.path, cut.pipeline)
