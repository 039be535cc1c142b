"""SIGTERM during a pipelined fit (lightning/signals.py): whichever rank gets it, every rank stops at the
same step, two steps later at most, with Lightning's SIGTERMException, and nothing hangs; a fit without a signal
runs to its end with the check in place. Real processes, the Trainer and its signal connector."""

from __future__ import annotations

import json
import os
import signal

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from models import START, LitSeq, loader, trainer_kwargs

from lightning_pipe import AutoPipeStrategy

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]
SIGNALLED = 2  # the step after which one rank gets SIGTERM


class Signal(Callback):
    """Sends SIGTERM to this process on rank `rank` after step SIGNALLED; each rank writes the last step it
    completed (a spawned worker's exception goes to the launching process, not to its callbacks)."""

    def __init__(self, folder, rank):
        self.folder, self.rank = folder, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(os.path.join(self.folder, f"step-rank{trainer.global_rank}.json"), "w") as f:
            json.dump(trainer.global_step, f)
        if trainer.global_step == SIGNALLED and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def last_steps(folder, ranks):
    return [json.load(open(os.path.join(folder, f"step-rank{r}.json"))) for r in range(ranks)]


@pytest.mark.parametrize("rank", [0, 3])
def test_sigterm_on_any_rank_stops_every_rank_at_the_same_step(tmp_path, rank):
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=2, partition="uniform", start_method=START)
    trainer = L.Trainer(devices=4, strategy=strategy, callbacks=[Signal(tmp_path, rank)], **trainer_kwargs(max_steps=8))
    with pytest.raises(SIGTERMException):
        trainer.fit(LitSeq(blocks=4), loader(batch_size=4))
    # the flag posted at the start of the step after the signal is read at the start of the next one, on every
    # rank: each completed that step and no other (a worker that failed would have raised its own error above)
    assert last_steps(tmp_path, 4) == [SIGNALLED + 1] * 4


def test_without_a_signal_the_fit_runs_to_its_end(tmp_path):
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=2, partition="uniform", start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, callbacks=[Signal(tmp_path, -1)], **trainer_kwargs(max_steps=4))
    trainer.fit(LitSeq(blocks=4), loader(batch_size=4))
    assert last_steps(tmp_path, 2) == [4, 4]
