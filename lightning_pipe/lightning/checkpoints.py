"""Checkpoints of a cut model: the full model in single-process layout, optimizer states per stage.

The state dict is gathered to global rank 0 from replica 0's stages, so a checkpoint loads into
the unchanged LightningModule on one process. Optimizer states stay per stage (they are shaped by
the stage's parameters), together with what a resumed run needs to cut and schedule the model
exactly as this run did: the partition (`autopipe_bounds`), the slicer's count and the schedule
(with schedule="auto", the one chosen). Resuming therefore needs the same depth.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from ..schedules import ScheduleSpec


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def gather_to_zero(strategy: Any, obj: Any) -> Optional[list[Any]]:
    """Gather `obj` from the stages of replica 0 onto global rank 0 (others: None)."""
    if strategy.topology.depth == 1:
        return [obj] if strategy.global_rank == 0 else None
    if strategy.replica_index != 0:
        return None
    parts = [None] * strategy.topology.depth if strategy.global_rank == 0 else None
    dist.gather_object(obj, parts, dst=0, group=strategy.process_groups.pipeline)
    return parts


def full_state_dict(strategy: Any) -> dict[str, Any]:
    local = {k: v.detach().cpu() for k, v in strategy.lightning_module.state_dict().items()}
    parts = gather_to_zero(strategy, local)
    merged: dict[str, Any] = {}
    for part in parts or []:
        merged.update(part)
    return merged


def stage_optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    parts = gather_to_zero(strategy, _to_cpu(optimizer.state_dict()))
    if parts is None:
        return {}
    cut, mode = strategy.cut, strategy.mode.state_dict()
    return {
        "autopipe_stage_states": parts,
        "autopipe_depth": strategy.topology.depth,
        "autopipe_bounds": [list(b) for b in cut.bounds],
        "autopipe_sliced": mode["sliced"],
        "autopipe_schedule": mode["schedule"],
    }


def load_stage_optimizer_states(strategy: Any, checkpoint: dict[str, Any]) -> None:
    for optimizer, state in zip(strategy.optimizers, checkpoint["optimizer_states"]):
        if "autopipe_stage_states" not in state:
            raise ValueError(
                "this checkpoint's optimizer state was not written by AutoPipeStrategy; resume it with the strategy that wrote it"
            )
        if state["autopipe_depth"] != strategy.topology.depth:
            raise ValueError(
                f"the checkpoint was written by a {state['autopipe_depth']}-stage pipeline and this one has "
                f"{strategy.topology.depth} stages: resume with the same devices x nodes / width"
            )
        optimizer.load_state_dict(state["autopipe_stage_states"][strategy.stage_index])


def load_stage_state(module: Any, checkpoint: dict[str, Any], strict: bool = True) -> None:
    """This stage's keys of a full-model state dict."""
    local_keys = module.state_dict().keys()
    state = {k: v for k, v in checkpoint["state_dict"].items() if k in local_keys}
    if strict:
        missing = [k for k in local_keys if k not in state]
        if missing:
            raise KeyError(f"the checkpoint lacks this stage's keys: {missing[:5]}")
    module.load_state_dict(state, strict=strict)


@dataclass(frozen=True)
class ResumedLayout:
    """How the checkpoint's run cut and scheduled the model."""

    bounds: Optional[tuple[tuple[int, int], ...]]  # None: the checkpoint holds none (or for another depth)
    sliced: int
    schedule: Optional[ScheduleSpec]


def resumed_layout(strategy: Any, path: Optional[str]) -> Optional[ResumedLayout]:
    """What `fit(ckpt_path=path)` will resume from; Lightning loads the checkpoint only after
    setup, so the launcher noted the path and this reads the layout ahead."""
    if path is None or not os.path.isfile(path):
        return None
    states = strategy.checkpoint_io.load_checkpoint(path).get("optimizer_states") or [{}]
    bounds, chosen = states[0].get("autopipe_bounds"), states[0].get("autopipe_schedule")
    spec = ScheduleSpec.of(chosen[0], **dict(chosen[1])) if chosen is not None else None
    return ResumedLayout(tuple(tuple(b) for b in bounds) if bounds is not None else None, int(states[0].get("autopipe_sliced", 0)), spec)
