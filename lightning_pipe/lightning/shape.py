"""A planner that chooses the run's shape at setup (`planner=`; today PipeDream-2BW's, `plan_2bw`).

Width, depth, micro-batch count and size, schedule, recomputation and partition are its answer, so
the config is replaced before the topology and process groups are built, and the Trainer checks of
the layers the new config composes run again.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn

from ..config import PipelineConfig
from .compose import choose_layers
from .plan_2bw import TwoBWChoice, Where, plan_in_setup, rebatched

__all__ = ["Where", "choose_shape", "rebatched"]


def choose_shape(
    config: PipelineConfig, module: Any, where: Where, resumed: dict[str, Any]
) -> tuple[PipelineConfig, TwoBWChoice, Optional[Any]]:
    """(the config with the chosen shape, the choice, and on global rank 0 the plan with every candidate)."""
    choice, plan = plan_in_setup(config, module, where, resumed)
    config = config.replace(**choice.settings())
    if module.trainer.state.fn == TrainerFn.FITTING:
        choose_layers(config).check_trainer(config, module.trainer, module)
    return config, choice, plan
