"""Run a function on N real processes with a gloo process group; fail clearly, never hang.

benchmarks.harness.launch, the one launcher of the tests and the benchmarks:
``run_distributed(fn, world, *args, timeout=120.0) -> list`` returns ``fn(rank, world, *args)`` of
every rank (one thread per process), raises with a failing worker's traceback, and raises
TimeoutError naming the ranks still running when the one deadline of the whole job runs out.

Here its workers are forked from the tests' fork server by default (``start_method="forkserver"``,
see conftest.py): a spawned worker starts a fresh interpreter that imports torch, the package and the
test module again, 8-16 s per 2-process job on 2 loaded cores; a forked one starts in about a second.
Everything else is the launcher's own code (process group, results, failures, the deadline).
``start_method="spawn"`` runs the launcher exactly as the benchmarks do (test_launch keeps a test of
its own on it).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch.multiprocessing as mp

from benchmarks.harness import launch
from benchmarks.harness.launch import WorkerError, free_port

__all__ = ["WorkerError", "free_port", "run_distributed"]


class _ForkServer:
    """Stands in for torch.multiprocessing in the launcher: every context it asks for is the fork server's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(mp, name)

    @staticmethod
    def get_context(method: str | None = None):
        return mp.get_context("forkserver")


def run_distributed(fn, world: int, *args: Any, start_method: str = "forkserver", **options: Any) -> list:
    """`launch.run_distributed` with its workers started by ``start_method`` ("forkserver" or "spawn")."""
    if start_method == "spawn":
        return launch.run_distributed(fn, world, *args, **options)
    if start_method != "forkserver":
        raise ValueError(f"start_method={start_method!r}: 'forkserver' or 'spawn'")
    with mock.patch.object(launch, "mp", _ForkServer()):  # the launcher's only use of it: mp.get_context("spawn")
        return launch.run_distributed(fn, world, *args, **options)
