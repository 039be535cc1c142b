"""A callback for soak runs: every rank's resident memory, open file descriptors and step time.

Added to a CLI run with ``+callbacks.soak._target_=benchmarks.harness.soak.SoakMonitor
+callbacks.soak.path=<file>``; every `every` steps each rank appends one JSON line
``{"rank", "step", "rss_mb", "fds", "step_ms"}`` (step_ms: the mean wall time per step since the
last line). Linux only (/proc).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import lightning as L


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class SoakMonitor(L.Callback):
    def __init__(self, path: str, every: int = 50):
        self.path, self.every = path, every
        self._since = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every:
            return
        now = time.perf_counter()
        line = {
            "rank": trainer.global_rank,
            "step": step,
            "rss_mb": round(rss_mb(), 2),
            "fds": open_fds(),
            "step_ms": round((now - self._since) * 1e3 / self.every, 2),
        }
        self._since = now
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")
