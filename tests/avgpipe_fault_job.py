"""AvgPipe on 2 pipelines x 2 stages with stage k's reference process killed (SIGKILL) at step 3,
for tests/test_avgpipe.py: `python tests/avgpipe_fault_job.py <stage> <out_dir>`. Runs through the
CLI's one-line error handling with pipeline timeout 20 s; an optional third argument names the
pipelines' schedule (default 1f1b)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import LitSeq, loader, trainer_kwargs  # noqa: E402

from lightning_pipe import AutoPipeStrategy  # noqa: E402
from lightning_pipe.cli import errors  # noqa: E402

STAGE, OUT = int(sys.argv[1]), Path(sys.argv[2])
SCHEDULE = sys.argv[3] if len(sys.argv) > 3 else "1f1b"


class KillsItsReference(LitSeq):
    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        if self.global_step == 3 and strategy.global_rank == STAGE:  # pipeline 0's stage k started it
            os.kill(strategy.layers.replicas.elastic.link.proc.pid, signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def main() -> None:
    torch.manual_seed(0)
    strategy = AutoPipeStrategy(schedule=SCHEDULE, microbatches=2, partition="uniform", pipelines=2, timeout=20.0)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=8, default_root_dir=str(OUT)))  # shared: 4 processes
    trainer.fit(KillsItsReference(), loader(batch_size=4))
    if trainer.is_global_zero:
        print("finished")


if __name__ == "__main__":
    errors.run(main)
