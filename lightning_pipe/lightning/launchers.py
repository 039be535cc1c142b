"""Starting the processes: Lightning's launchers, with the checks that must pass before any
process starts, and a clean end of every worker.

The launchers see the strategy through `LaunchedStrategy`, what they read of it, so the strategy
imports them and never the reverse."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Callable, Optional, Protocol

import torch.distributed as dist
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.fabric.strategies.launchers.subprocess_script import _set_num_threads_if_needed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from .. import faults
from ..config import PipelineConfig
from .cut import Cut
from .front import restore_model
from .preflight import validate_inputs


class LaunchedStrategy(Protocol):
    """What the launchers use of the strategy: its settings and world, and fit's ckpt_path to note."""

    config: PipelineConfig
    resume_path: Optional[str]

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def cluster_environment(self) -> Optional[Any]: ...

    @property
    def checkpoint_io(self) -> Any: ...

    @property
    def cut(self) -> Optional[Cut]: ...


def close_process_groups() -> None:
    """At exit, close the process groups (ours and the default) in order. Left to interpreter
    shutdown, gloo sub-groups were seen to abort a process ("terminate called without an active
    exception") once its peers had gone. Registered once per setup; calls after the first do nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class CheckedSubprocessLauncher(_SubprocessScriptLauncher):
    def __init__(self, strategy: LaunchedStrategy, *args: Any):
        super().__init__(*args)
        self._strategy = strategy

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        _validate(self._strategy, args, trainer)
        # As Lightning's launch, with our watcher of the children instead of Lightning's (which
        # looks every 5 s and then SIGKILLs this process too, so its exit code says nothing).
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            faults.add_children(self.procs)
            threading.Thread(target=_watch_children, name="lightning-pipe child watcher", daemon=True).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def _watch_children(period: float = 0.2) -> None:
    while (failed := faults.failed_child(wait=period)) is None:
        pass
    faults.end_for_child(*failed)


def _validate(strategy: LaunchedStrategy, args: tuple, trainer: Optional[Any]) -> None:
    """The checks before any process starts; the strategy notes fit's ckpt_path (read ahead in setup)."""
    strategy.resume_path = validate_inputs(strategy.config, strategy.num_nodes * strategy.num_processes, args, trainer)


_STOPPED = "lightning-pipe: every rank stopped on SIGTERM"


class CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        _validate(self._strategy, args, trainer)
        # forkserver pickles the model to its workers as spawn does, but Lightning gives only spawn the
        # launching process's random state and private weights (on CPU, torch.multiprocessing passes
        # tensors as shared memory: every rank would update one copy). The launcher itself travels with
        # its _wrapping_function, so the snapshot rides on it.
        self._forkserver_states = _GlobalStateSnapshot.capture() if self._start_method == "forkserver" else None
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:  # the trained weights are in; a model converted by the front end is the user's model again
            if args and isinstance(args[0], nn.Module):
                restore_model(args[0])

    def _recover_results_in_main_process(self, worker_output: Any, trainer: Any) -> None:
        if isinstance(worker_output, str) and worker_output == _STOPPED:  # every rank stopped at one step (signals.py)
            raise SIGTERMException()
        super()._recover_results_in_main_process(worker_output, trainer)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        output = super()._collect_rank_zero_results(trainer, results)
        cut = self._strategy.cut
        if output is not None and output.weights_path is not None and cut is not None and cut.built_empty:
            # a model created empty stays empty in the launching process (its weights are in the checkpoint)
            self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
            output = output._replace(weights_path=None)
        return output

    def _wrapping_function(self, process_idx: int, trainer: Any, function: Callable, args: Any, kwargs: Any, *rest: Any) -> None:
        if getattr(self, "_forkserver_states", None) is not None:
            self._forkserver_states.restore()
            if isinstance(self._strategy.accelerator, CPUAccelerator):
                args, kwargs = _disable_module_memory_sharing((args, kwargs))
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)
        except SIGTERMException:  # every rank stopped on SIGTERM (signals.py; a SystemExit, which spawn takes for
            if process_idx == 0:  # a clean exit): the launching process raises it once every worker has left
                rest[0].put(_STOPPED)
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


def make_launcher(strategy: LaunchedStrategy) -> Any:
    """The launcher for the strategy's `start_method`, after the checks on the world's size."""
    assert strategy.cluster_environment is not None
    strategy.config.check_world(strategy.num_nodes * strategy.num_processes)  # fail before spawning anything
    if strategy.config.start_method == "popen":
        return CheckedSubprocessLauncher(strategy, strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    # Lightning's launcher drives it further as the ParallelStrategy it also is
    return CheckedMultiProcessingLauncher(strategy, start_method=strategy.config.start_method)
