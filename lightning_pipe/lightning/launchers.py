"""Starting the processes: Lightning's launchers, with the checks that must pass before any
process starts, and a clean end of every worker."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Optional

import torch.distributed as dist
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from .stage import check_no_outside_parameters, find_pipeline


def close_process_groups() -> None:
    """At exit, close the process groups (ours and the default) in order. Left to interpreter
    shutdown, gloo sub-groups were seen to abort a process ("terminate called without an active
    exception") once its peers had gone. Registered once per setup; calls after the first do nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def validate_inputs(strategy: Any, args: tuple, trainer: Optional[Any]) -> None:
    """Refuse what cannot be pipelined before any process starts: the model against the settings,
    and a training batch size visible up front (every trainer function passes the model, then its
    dataloaders)."""
    config = strategy.config
    model = args[0] if args else None
    if isinstance(model, nn.Module):
        path, pipeline = find_pipeline(model)
        check_no_outside_parameters(model, path)
        config.check_model(strategy.num_nodes * strategy.num_processes, len(pipeline))
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    # fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, ...)
    strategy.resume_path = str(args[4]) if fitting and len(args) > 4 and args[4] is not None else None
    if fitting and len(args) > 1:
        config.check_batch_size(getattr(args[1], "batch_size", None))


class CheckedSubprocessLauncher(_SubprocessScriptLauncher):
    def __init__(self, strategy: Any, *args: Any):
        super().__init__(*args)
        self._strategy = strategy

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        validate_inputs(self._strategy, args, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        validate_inputs(self._strategy, args, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(process_idx, *args, **kwargs)
        # A worker is about to exit: leave together and close the process groups ourselves. Left to
        # interpreter shutdown, gloo's threads were seen to abort a worker ("terminate called
        # without an active exception") when its peer had already gone.
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        # Even so, about 1 run in 60 still aborted after all Python code had finished, in the C++
        # teardown of the interpreter (no Python frame at the abort). A worker has nothing left to
        # do here: rank 0's results went into the launcher's SimpleQueue (a synchronous pipe
        # write), the trainer closed its loggers and files. So leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
