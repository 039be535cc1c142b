"""lightning-pipe: pipeline-parallel training for Lightning, ``Trainer(strategy="autopipe")``."""

from lightning.pytorch.strategies import StrategyRegistry

from .lightning import AutoPipeStrategy
from .planning import Plan, plan, transformer_costs
from .profiler import Profile
from .schedules import PipelineSchedule, ScheduleError, build_schedule, validate
from .simulator import CostModel, Timeline, simulate

__version__ = "0.1.0"

# Idempotent: this module may be imported twice (as a package and from __main__, or reloaded).
StrategyRegistry.register(
    "autopipe",
    AutoPipeStrategy,
    description="Pipeline parallelism (GPipe / 1F1B) planned and run by lightning-pipe",
    override=True,
)

__all__ = [
    "AutoPipeStrategy",
    "CostModel",
    "PipelineSchedule",
    "Plan",
    "Profile",
    "ScheduleError",
    "Timeline",
    "build_schedule",
    "plan",
    "simulate",
    "transformer_costs",
    "validate",
]
