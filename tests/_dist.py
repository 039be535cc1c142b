"""Run a function on N real processes with a gloo process group; fail clearly, never hang.

A re-export of lightning_pipe.bench.launch, the one launcher of the tests and the benchmarks:
``run_distributed(fn, world, *args, timeout=120.0) -> list`` returns ``fn(rank, world, *args)`` of
every rank (one thread per process), raises with a failing worker's traceback, and raises
TimeoutError naming the ranks still running when the one deadline of the whole job runs out.
"""

from __future__ import annotations

from lightning_pipe.bench.launch import WorkerError, free_port, run_distributed

__all__ = ["WorkerError", "free_port", "run_distributed"]
