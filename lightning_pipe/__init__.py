"""lightning-pipe: pipeline-parallel training for Lightning, ``Trainer(strategy="autopipe")``."""

from lightning.pytorch.strategies import StrategyRegistry

from .config import PipelineConfig
from .errors import SettingError
from .lightning import AutoPipeStrategy
from .lightning.metrics import PipelineMetrics
from .planning import Plan, plan, transformer_costs
from .profiling import Profile
from .schedules import PipelineSchedule, ScheduleError, ScheduleSpec, build_schedule, validate
from .simulation import CostModel, Timeline, simulate

__version__ = "0.2.0"

# "autopipe" and one name per schedule ("autopipe_wave", ...); idempotent (override=True): this
# module may be imported twice (as a package and from __main__, or reloaded).
AutoPipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "AutoPipeStrategy",
    "CostModel",
    "PipelineConfig",
    "PipelineMetrics",
    "PipelineSchedule",
    "Plan",
    "Profile",
    "ScheduleError",
    "ScheduleSpec",
    "SettingError",
    "Timeline",
    "build_schedule",
    "plan",
    "simulate",
    "transformer_costs",
    "validate",
]
