"""An injected slowdown for a CLI run (bench_convergence.py ttt's `-load` modes): every rank pinned to
its own core, as a device is its own, and a competing CPU-bound job on one rank's core for a span of
steps (a shared GPU that another job starts using). Added through Hydra:

    +callbacks.load._target_=benchmarks.harness.injected_load.InjectedLoad +callbacks.load.core=1 \
        +callbacks.load.start=50 +callbacks.load.stop=250
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

from lightning.pytorch.callbacks import Callback

from .bench import pin_to_core


def busy_job(core: int) -> subprocess.Popen:
    """A process that keeps `core` busy until killed."""
    code = f"import os; os.sched_setaffinity(0, {{{core}}}); x = 0\nwhile True: x += 1"
    return subprocess.Popen([sys.executable, "-c", code])


class InjectedLoad(Callback):
    """Rank r on core r mod cores; from optimizer step `start` to `stop` (global rank 0 owns the job) a
    busy process shares core `core`."""

    def __init__(self, core: int = 1, start: int = 50, stop: int = 250):
        if not 0 <= start < stop:
            raise ValueError(f"callbacks.load: start={start} and stop={stop} need 0 <= start < stop")
        self.core, self.start, self.stop = core, start, stop
        self.job: Optional[subprocess.Popen] = None

    def setup(self, trainer, pl_module, stage):
        pin_to_core(trainer.global_rank % os.cpu_count())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank != 0:
            return
        step = trainer.global_step
        if self.start <= step < self.stop and self.job is None:
            self.job = busy_job(self.core)
        elif step >= self.stop:
            self._end()

    def _end(self) -> None:
        if self.job is not None:
            self.job.kill()
            self.job.wait()
            self.job = None

    def on_train_end(self, trainer, pl_module):
        self._end()

    def on_exception(self, trainer, pl_module, exception):
        self._end()

    def teardown(self, trainer, pl_module, stage):
        self._end()
