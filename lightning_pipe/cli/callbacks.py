"""Small callbacks for the CLI's progress bar."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor


def _samples(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return _samples(batch[0])
    if isinstance(batch, dict) and batch:
        return _samples(next(iter(batch.values())))
    return 0


class SpeedMonitor(L.Callback):
    """Training throughput (samples/s of this pipeline) on the progress bar, averaged over the
    steps since the last log so the bar stays readable."""

    def __init__(self, every_n_steps: int = 10):
        self.every = every_n_steps
        self._start: float = 0.0
        self._samples = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._samples == 0:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._samples += _samples(batch)
        if (trainer.global_step % self.every) == 0:
            elapsed = time.perf_counter() - self._start
            if elapsed > 0:
                # every rank logs its own measure: same key everywhere, no collective
                pl_module.log("samples_per_s", self._samples / elapsed, prog_bar=True, on_step=True, on_epoch=False)
            self._samples = 0


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt` always holds the newest state: written after every validation and at the end
    of training. (Lightning's `save_last=True` rewrites it only when a top-k checkpoint was saved,
    so a run whose last validations did not improve left a stale `last.ckpt`.)"""

    def __init__(self, dirpath: str, filename: str = "last") -> None:
        super().__init__(
            dirpath=dirpath, filename=filename, monitor=None, save_top_k=1, save_on_train_epoch_end=False, enable_version_counter=False
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            trainer.save_checkpoint(self.format_checkpoint_name({}))
            self._last_global_step_saved = trainer.global_step
