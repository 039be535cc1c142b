"""Partition control in Lightning: static, adaptive by rule, adaptive learned (AutoPipe-RL).

All three accept a switch requested by hand (`repartition(bounds)`); the adaptive ones also monitor
every step and decide (`lightning/adaptive.py`: the rule or the learned predictor and arbiter).
The switch itself is the composition's (`switching.switch`: `lightning/compose.Training`), where every
layer moves its state.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn

from ...lightning.adaptive import Adaptive
from ..lightning import PartitionLayer


class StaticPartition(PartitionLayer):
    """The cut stays as set up, unless a switch is requested by hand."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.adaptive: Optional[Adaptive] = None  # while fitting
        self.runner: Any = None

    def start(self) -> None:
        fitting = self.ctx.trainer.state.fn == TrainerFn.FITTING
        self.adaptive = Adaptive(self.ctx, self.switching, self.planner.profile, self.planner.costs) if fitting else None

    def on_runtime(self, runner: Any) -> None:
        self.runner = runner  # its transport's counters: what the monitor measures

    def request(self, bounds: Any, early: Optional[int] = None) -> Any:
        if self.adaptive is None:
            raise RuntimeError("repartition() works while fitting, after setup")
        return self.adaptive.request(bounds, early)

    def before_batch(self) -> None:
        if self.adaptive is not None:
            self.adaptive.apply_pending()

    def begin_step(self) -> None:
        if self.adaptive is not None and self.adaptive.enabled:
            self.adaptive.begin_step(self.runner.transport)

    def end_step(self, executor: Any, microbatches: int) -> None:
        if self.adaptive is not None and self.adaptive.enabled:
            self.adaptive.end_step(executor, microbatches)

    def after_backward(self) -> None:
        if self.adaptive is not None:
            self.adaptive.finish_transition()

    def run_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"switched": True} if self.ctx.cut.switched else {}  # a resumed run continues on it
        if self.adaptive is not None and self.adaptive.enabled:
            out["adaptive"] = self.adaptive.state_dict()
        return out

    def load(self, run: dict[str, Any], extras: dict[int, dict[str, Any]], checkpoint: dict[str, Any]) -> None:
        if self.adaptive is not None and "adaptive" in run:
            self.adaptive.load_state_dict(run["adaptive"])

    def finish(self) -> None:
        if self.adaptive is not None:
            self.adaptive.close()


class AdaptivePartition(StaticPartition):
    """adaptive="rule" or "learned": the monitor around every training step, decisions between steps
    (which of the two is the `Adaptive`'s: `config.adaptive`)."""
