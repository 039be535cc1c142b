"""Ours: SIGTERM in a pipeline, without a blocking world collective every step.

Lightning 2.6 broadcasts rank 0's SIGTERM flag over the whole world at the start of every training
step (`_TrainingEpochLoop._broadcast_sigterm_tensor`), and its SIGTERM handler broadcasts from rank 0
to meet that call. In a pipeline the first stage ends every 1F1B step and starts the next, so that
broadcast sits on the critical path (docs/results/emulated_torch.md, "The Trainer path"). Here each
step posts a non-blocking all-reduce (max) of this rank's flag and reads the one posted a step
earlier, long since landed: every rank reads the same value at the same step and all of them stop
there together, at most two steps after a SIGTERM reached any of them. (Lightning's acts on rank 0's
flag only: a SIGTERM on another rank ends that rank alone, and its peers then fail on a lost
connection.) The handler keeps Lightning's first half (forward the signal to the launched processes)
and drops its broadcast, which no longer has a partner; Lightning's own flag, which would end the
signalled rank's epoch at once, is set on every rank when they stop. Where Lightning's loop or
connector lacks these names, its own protocol is left in place.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

_LOOP_HOOK = "_broadcast_sigterm_tensor"
_HANDLER = "_sigterm_notifier_fn"


class StepSignals:
    """Installed on one Trainer (`install`) before Lightning registers its signal handlers."""

    def __init__(self, trainer: Any, device: torch.device):
        self.trainer, self.device = trainer, device
        self.flag: Optional[torch.Tensor] = None
        self.pending: Optional[Any] = None  # the all-reduce posted a step ago
        self.signalled = False  # this rank got SIGTERM

    @classmethod
    def install(cls, trainer: Any, device: torch.device) -> Optional["StepSignals"]:
        loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
        if not (hasattr(loop, _LOOP_HOOK) and hasattr(connector, _HANDLER)):
            return None
        signals = cls(trainer, device)
        setattr(loop, _LOOP_HOOK, signals.per_step)  # instance attributes: this Trainer only
        setattr(connector, _HANDLER, signals.on_sigterm)
        return signals

    def on_sigterm(self, signum: int, _frame: Any) -> None:
        if not self.signalled and (launcher := self.trainer.strategy.launcher) is not None:
            launcher.kill(signum)
        self.signalled = True  # Lightning's flag waits for the others: it ends this rank's epoch at once

    def per_step(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            if self.flag.item():
                self.trainer._signal_connector.received_sigterm = True  # the fit loop's handling, on every rank
                rank_zero_info(f"SIGTERM: every rank stops after step {self.trainer.global_step}")
                raise SIGTERMException()
        self.flag = torch.tensor([int(self.signalled)], dtype=torch.int32, device=self.device)
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)

    def finish(self, graceful: bool) -> None:  # None: for `signals = signals.finish(...)`
        """End of fit: every rank posted as many all-reduces, so the last one lands (after a failure it
        may not: it is left to the process group's teardown)."""
        if self.pending is not None and graceful:
            with contextlib.suppress(Exception):
                self.pending.wait()
        self.pending = None
        vars(self.trainer.fit_loop.epoch_loop).pop(_LOOP_HOOK, None)  # Lightning's own again for a later fit
        vars(self.trainer._signal_connector).pop(_HANDLER, None)
