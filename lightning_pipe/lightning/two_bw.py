"""PipeDream-2BW inside Lightning: the optimizer step one Lightning step behind, made exact.

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

from typing import Any, Callable

from ..errors import SettingError

STASH_KEY = "autopipe_2bw_previous"  # per-parameter entry in the name-keyed optimizer state: W(applied - 1)
APPLIED_KEY = "autopipe_2bw_applied"  # how many updates the checkpoint's weights hold


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


def defer_schedulers(strategy: Any) -> list[DeferredScheduler]:
    def progress() -> tuple[int, int]:
        mode = strategy.mode  # read each time: a live switch (adaptive) rebuilds the mode
        return mode.applied + len(mode.in_flight), mode.applied

    deferred = []
    for config in strategy.lr_scheduler_configs:
        if not isinstance(config.scheduler, DeferredScheduler):
            config.scheduler = DeferredScheduler(config.scheduler, progress)
        deferred.append(config.scheduler)
    return deferred


def apply_update(strategy: Any) -> None:
    """A drain's update: what Lightning's optimizer step does (clip by the global norm, step, zero),
    without counting a Lightning step; then the LR schedulers waiting for it step."""
    module = strategy.lightning_module
    trainer = module.trainer
    optimizer = strategy.optimizers[0]
    module.configure_gradient_clipping(
        optimizer, gradient_clip_val=trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def after_update(strategy: Any) -> None:
    for config in strategy.lr_scheduler_configs:
        if isinstance(config.scheduler, DeferredScheduler):
            config.scheduler.catch_up()


def stash_state(strategy: Any, stored: dict[int, str]) -> dict[str, dict[str, Any]]:
    """The mode's stashed W(applied - 1) as per-parameter optimizer-state entries (by stored name)."""
    stashed = strategy.mode.state_dict().get("stashed")
    if stashed is None:
        return {}
    return {stored[pid]: {STASH_KEY: tensor.detach().cpu()} for pid, tensor in stashed.items() if pid in stored}


def load_mode_state(strategy: Any, checkpoint: dict[str, Any], extras: dict[int, dict[str, Any]]) -> None:
    """Resume the same trajectory: the checkpoint's update count and stashed version. A checkpoint of a
    synchronous schedule (no 2BW state) starts 2BW afresh from its weights."""
    state = (checkpoint.get("optimizer_states") or [{}])[0]
    applied = int(state.get(APPLIED_KEY, 0))
    live = {id(p): p for p in strategy.mode.versions.live}
    stashed = {
        pid: extra[STASH_KEY].to(live[pid].device, live[pid].dtype) for pid, extra in extras.items() if STASH_KEY in extra and pid in live
    }
    if applied and len(stashed) != len(live):
        raise ValueError(f"the checkpoint's 2BW state holds {len(stashed)} of this stage's {len(live)} stashed weights")
    strategy.mode.load_state(applied, stashed if applied else None)


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
