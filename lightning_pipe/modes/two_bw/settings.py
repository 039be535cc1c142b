"""PipeDream-2BW's settings, checked before any process starts: its planner's (`planner=2bw`) and
the Trainer settings its 1-stale update cannot honour. Which schedules and modes combine with it is
the legality table's (`config.py`)."""

from __future__ import annotations

from typing import Any, Optional

from ...errors import SettingError, check_count

PLANNERS = ("2bw",)
PLANNED_SCHEDULES = ("2bw", "1f1b", "gpipe")  # what its planner chooses among (schedule=auto: all three)
PLANNER_COSTS = {"simulated": "simulated", "paper": "closed"}  # planner_2bw_cost -> planning.two_bw's cost_model


def check_config(config: Any) -> None:
    """Each of its settings on its own (construction)."""
    if config.planner is not None:
        if not isinstance(config.planner, str) or config.planner.lower() not in PLANNERS:
            raise SettingError(f"planner={config.planner!r}: allowed values are {list(PLANNERS)} or None (set by hand)", "planner")
        config.planner = config.planner.lower()
    if config.planner_2bw_cost not in PLANNER_COSTS:
        raise SettingError(
            f"planner_2bw_cost={config.planner_2bw_cost!r}: 'simulated' (ours: every candidate on the simulator) or 'paper' "
            "(PipeDream-2BW's closed-form THROUGHPUT and MEMORY, §4.2)",
            "planner_2bw_cost",
        )
    if not isinstance(config.plan_mesh, bool):
        raise SettingError(f"plan_mesh={config.plan_mesh!r}: allowed values are True or False", "plan_mesh")
    if config.plan_mesh and (config.planner is None or config.planner_2bw_cost != "simulated"):
        raise SettingError(
            "plan_mesh=True is a setting of planner=2bw with planner_2bw_cost='simulated' (the search over tensor and shard "
            f"runs on the simulator), not planner={config.planner!r}, planner_2bw_cost={config.planner_2bw_cost!r}",
            "plan_mesh",
        )
    if config.global_batch is not None:
        if config.planner is None:
            raise SettingError(f"global_batch={config.global_batch!r} is a setting of planner=2bw: set planner=2bw too", "global_batch")
        check_count("global_batch", config.global_batch)


def check_plannable(config: Any, world_size: int, num_blocks: int, batch_size: Optional[int] = None) -> None:
    """planner=2bw: some (width, depth) exists for the devices and reaches the global batch
    (global_batch, else the DataLoader's `batch_size` once known)."""
    from ...planning.two_bw import check_reachable

    batch = config.global_batch or batch_size
    schedules = PLANNED_SCHEDULES if config.auto else (config.schedule,)
    try:
        check_reachable(world_size, num_blocks, batch or 1, schedules)
    except ValueError as err:
        raise SettingError(str(err), "global_batch" if batch else "planner") from None


def check_applied(config: Any) -> None:
    """A training run applies the planner's width and depth, not a planned tensor or shard (plan_mesh)."""
    if config.plan_mesh:
        raise SettingError(
            "plan_mesh=True: the plan command prints the mesh it chooses (tensor, shard); a training run does not apply them: "
            "set width, tensor and shard by hand (planner unset), or plan_mesh=False",
            "plan_mesh",
        )


def check_trainer(trainer: Any, model: Any) -> None:
    """What 2BW cannot honour, named before any process starts."""
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if isinstance(accumulate, int) and accumulate > 1:
        raise SettingError(
            f"accumulate_grad_batches={accumulate}: schedule='2bw' applies one update per batch of micro-batches; "
            "raise pipeline.microbatches (or the batch size) instead of accumulating batches",
            "accumulate_grad_batches",
        )
    precision = str(getattr(getattr(trainer, "precision_plugin", None), "precision", ""))
    if precision.startswith("16-mixed") or getattr(getattr(trainer, "precision_plugin", None), "scaler", None) is not None:
        raise SettingError(
            "precision='16-mixed': schedule='2bw' computes a batch's gradient under one loss scale and applies it a step "
            "later under another; use bf16-mixed, 32 or 64, or a flushing schedule (1f1b)",
            "precision",
        )
    if model is not None and not getattr(model, "automatic_optimization", True):
        raise SettingError(
            "automatic_optimization=False: schedule='2bw' runs the backward and the optimizer step itself; use automatic optimization",
            "schedule",
        )


def cost_model(config: Any) -> str:
    """The 2BW planner's cost functions for `planner_2bw_cost` (planning.two_bw.COST_MODELS)."""
    return PLANNER_COSTS[config.planner_2bw_cost]
