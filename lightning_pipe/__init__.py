"""lightning-pipe: pipeline-parallel training for Lightning, ``Trainer(strategy="autopipe")``."""

from lightning.pytorch.strategies import StrategyRegistry

from .lightning import AutoPipeStrategy
from .schedules import PipelineSchedule, ScheduleError, build_schedule, validate

__version__ = "0.1.0"

# Idempotent: this module may be imported twice (as a package and from __main__, or reloaded).
StrategyRegistry.register(
    "autopipe",
    AutoPipeStrategy,
    description="Pipeline parallelism (GPipe / 1F1B) planned and run by lightning-pipe",
    override=True,
)

__all__ = ["AutoPipeStrategy", "PipelineSchedule", "ScheduleError", "build_schedule", "validate"]
