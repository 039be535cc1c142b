"""Run a function on N real processes with a gloo process group; fail clearly, never hang."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report the worker's traceback to the test
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Return ``[fn(rank, world, *args) for each rank]``; raise with the worker's traceback or on timeout."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, out_dir)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout  # one deadline for the whole job, not per process
        deadline_hit = False
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                deadline_hit = True
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pt")
            if not os.path.exists(path):
                if deadline_hit:
                    raise TimeoutError(f"rank {r} of {world} did not finish within {timeout:.0f} s (hang?)")
                raise RuntimeError(f"rank {r} of {world} died without a result (exit code {procs[r].exitcode})")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"rank {r} of {world} failed:\n{record['error']}")
            results.append(record["result"])
        return results
