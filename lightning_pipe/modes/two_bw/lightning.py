"""PipeDream-2BW's weight versions in Lightning: the optimizer step one Lightning step behind, made exact.

Lightning step t runs batch t's forwards and finishes batch t - 1, so its optimizer step applies
batch t - 1's gradient; the first step after a (re)start or a drain (the fill) applies nothing, and a
drain (validation, checkpoint, end of fit) applies the batch in flight with `apply_update` — clipping,
the user's optimizer, as Lightning's step would. So S Lightning steps apply S updates by the end of
`fit`, and `global_step` counts batches as always.

LR schedulers must see update k with the learning rate they had after k of their steps, but
Lightning steps them after every Lightning step, the fill included. `DeferredScheduler` holds a
scheduler step requested after batch b until batch b's update is applied (interval "step" or
"epoch", plateau schedulers with their metric alike).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor, nn

from ...config import PipelineConfig
from ..engine import Versions
from ..lightning import VersionsLayer
from .engine import DoubleBuffer
from .settings import check_trainer


class DeferredScheduler:
    """A Lightning LR scheduler whose steps wait for the update they follow."""

    def __init__(self, scheduler: Any, progress: Callable[[], tuple[int, int]]):
        self.scheduler = scheduler
        self._progress = progress  # () -> (batches run, updates applied)
        self._pending: list[tuple[int, tuple, dict]] = []

    def step(self, *args: Any, **kwargs: Any) -> None:
        run, _ = self._progress()
        self._pending.append((run, args, kwargs))
        self.catch_up()

    def catch_up(self) -> None:
        _, applied = self._progress()
        while self._pending and self._pending[0][0] <= applied:
            _, args, kwargs = self._pending.pop(0)
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # optimizer, get_last_lr, ... (LearningRateMonitor reads them)
        return getattr(self.__dict__["scheduler"], name)


class DoubleBufferLayer(VersionsLayer):
    def __init__(self, *args: Any):
        super().__init__(*args)
        self._carried: Optional[tuple[int, Optional[dict[int, Tensor]]]] = None  # (applied, stash) across a switch
        self.buffer: Optional[DoubleBuffer] = None  # the runner this layer made (the composition's runner)

    @classmethod
    def check_trainer(cls, config: PipelineConfig, trainer: Any, model: Any) -> None:
        check_trainer(trainer, model)

    def make_runner(self, settings: dict[str, Any]) -> Versions:
        # a drain's update is Lightning's optimizer step (clipping, the user's optimizer), then the deferred schedulers
        settings = {k: v for k, v in settings.items() if k != "costed"}  # 2BW builds its own schedule, never from costs
        sharded = self.ctx.config.shard == "full"  # FSDP2's blocks: each rank stashes its shard
        self.buffer = DoubleBuffer(**settings, module=self.ctx.cut.stage, apply=self._drain_update, sharded=sharded)
        return self.buffer

    def update_due(self) -> bool:
        """The step completes the batch in flight (none after a (re)start or a drain: the fill)."""
        return bool(self.buffer.in_flight)

    def _drain_update(self) -> None:
        """A drain's update passes every layer's hooks, as Lightning's optimizer step does."""
        self.update(lambda: (self._apply_update(), self._catch_up()))

    def start(self) -> None:
        """LR schedulers step after the update they follow (read the runner each time: a switch rebuilds it)."""

        def progress() -> tuple[int, int]:
            return self.buffer.applied + len(self.buffer.in_flight), self.buffer.applied

        for config in self.ctx.lr_scheduler_configs:
            if not isinstance(config.scheduler, DeferredScheduler):
                config.scheduler = DeferredScheduler(config.scheduler, progress)

    def _apply_update(self) -> None:
        """A drain's update: what Lightning's optimizer step does (clip by the global norm, step, zero),
        without counting a Lightning step."""
        module = self.ctx.module
        trainer = module.trainer
        optimizer = self.ctx.optimizers[0]
        module.configure_gradient_clipping(
            optimizer, gradient_clip_val=trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _catch_up(self) -> None:
        for config in self.ctx.lr_scheduler_configs:
            if isinstance(config.scheduler, DeferredScheduler):
                config.scheduler.catch_up()

    # ---- a live switch: drained, the stash moves with its parameter ------------------------------
    def switch_extras(self) -> Optional[Callable[[nn.Parameter], dict[str, Any]]]:
        self.buffer.drain()  # the update in flight is applied; the stash is what the next batch reads
        stashed = self.buffer.stashed
        self._carried = (self.buffer.applied, stashed)
        return (lambda p: {"stash": stashed[id(p)]} if id(p) in stashed else {}) if stashed else None

    def after_switch(self, received: dict[int, dict[str, Any]]) -> None:
        applied, stashed = self._carried
        self._carried = None
        if stashed is None:
            return
        live = {id(p) for p in self.buffer.versions.live}  # the runner rebuilt over the new cut
        carried = {pid: t for pid, t in stashed.items() if pid in live}
        carried.update({pid: e["stash"] for pid, e in received.items() if pid in live and "stash" in e})
        self.buffer.load_state(applied, carried)

    # ---- checkpoints -----------------------------------------------------------------------------
    def parameter_state(self, stored: dict[int, str], state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The stashed W(applied - 1), per parameter (it follows the parameter to any stage), whole (collective
        over a split or sharded weight's ranks, as the rest of the checkpoint)."""
        stashed = self.buffer.stashed
        if stashed is None:
            return {}
        whole = self.buffer.versions.whole(stashed)
        return {stored[pid]: {"stash": tensor.detach().cpu()} for pid, tensor in whole.items() if pid in stored}

    def run_state(self) -> dict[str, Any]:
        return {**super().run_state(), "applied": self.buffer.applied}

    def load(self, run: dict[str, Any], extras: dict[int, dict[str, Any]], checkpoint: dict[str, Any]) -> None:
        """Resume the same trajectory: the checkpoint's update count and stashed version. A checkpoint of
        a flushing schedule (no 2BW state) starts 2BW afresh from its weights."""
        runner = self.buffer
        applied = int(run.get("applied", 0))
        live = {id(p) for p in runner.versions.live}
        whole = {pid: e["stash"] for pid, e in extras.items() if "stash" in e and pid in live}
        if applied and len(whole) != len(live):
            raise ValueError(f"the checkpoint's 2BW state holds {len(whole)} of this stage's {len(live)} stashed weights")
        runner.load_state(applied, runner.versions.from_whole(whole) if applied else None)
