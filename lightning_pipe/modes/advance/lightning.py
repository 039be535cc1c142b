"""Per-step controllers in Lightning: AvgPipe's advance rule (Algorithm 1) for schedule="advance"."""

from __future__ import annotations

from typing import Any, Optional

from ...lightning.cutting import held_bytes
from ..lightning import ControllerLayer
from .engine import AdvanceRule


class AdvanceController(ControllerLayer):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self.rule: Optional[AdvanceRule] = None

    def runner_options(self) -> dict[str, Any]:
        """A rule for the runner being built (again after a live switch: the stage changed)."""
        ctx, config = self.ctx, self.ctx.config
        held = lambda: held_bytes(ctx.module, ctx.optimizers)  # noqa: E731
        self.rule = AdvanceRule(ctx.depth, config.microbatches, ctx.stage_index, config.memory_limit, held)
        return {"advance": self.rule}

    def run_state(self) -> dict[str, Any]:
        return {"advance": self.rule.state_dict()}

    def load(self, run: dict[str, Any], extras: dict[int, dict[str, Any]], checkpoint: dict[str, Any]) -> None:
        if "advance" in run:
            self.rule.load_state_dict(run["advance"])
