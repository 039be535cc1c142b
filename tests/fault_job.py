"""A 2-process training job with one fault injected, for tests/test_faults.py and the docs' fault
matrix: `python tests/fault_job.py <fault> <rank> <phase> <out_dir>`.

fault: raise (a block raises), kill (SIGKILL itself), stop (SIGSTOP itself), term (SIGTERM itself), diskfull (the
checkpoint write fails with ENOSPC), slowexit (a finished rank that tears down slowly), none. phase: train, val, save. The job runs through the CLI's
one-line error handling (`lightning_pipe.cli.errors.run`) with pipeline timeout 6 s.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import LitSeq, loader, trainer_kwargs  # noqa: E402

from lightning_pipe import AutoPipeStrategy  # noqa: E402
from lightning_pipe.cli import errors  # noqa: E402

FAULT, RANK, PHASE, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
STEP = 3


def hit(phase: str) -> None:
    if FAULT == "none" or phase != PHASE or int(os.environ.get("LOCAL_RANK", "0")) != RANK:
        return
    if FAULT == "raise":
        raise RuntimeError(f"injected failure in {phase}")
    if FAULT == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if FAULT == "term":
        os.kill(os.getpid(), signal.SIGTERM)


class Faulty(LitSeq):
    def training_step(self, batch, batch_idx):
        if self.global_step == STEP:
            hit("train")
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if FAULT == "term":  # where each rank stopped
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / f"step-rank{self.global_rank}.txt").write_text(str(self.global_step))

    def validation_step(self, batch, batch_idx):
        hit("val")
        return super().validation_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint):
        hit("save")

    def on_train_end(self):
        # slowexit: this rank's layers take 4.5 s to close after the last collective of the teardown (as
        # AvgPipe's does when its reference process is slow to exit), while rank 0 is done
        if FAULT == "slowexit" and int(os.environ.get("LOCAL_RANK", "0")) == RANK:
            self.trainer.strategy.layers.close = lambda graceful=True: time.sleep(4.5)


class FullDisk(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if FAULT == "diskfull":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def main() -> None:
    torch.manual_seed(0)
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=2, partition="uniform", timeout=6.0, checkpoint_io=FullDisk())
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        **trainer_kwargs(max_steps=8, val_check_interval=4, limit_val_batches=1, enable_checkpointing=True, default_root_dir=str(OUT)),
    )
    trainer.fit(Faulty(), loader(batch_size=4), loader(batch_size=4))
    if trainer.is_global_zero:
        print("finished")


if __name__ == "__main__":
    errors.run(main)
