"""benchmarks.harness.launch: results of every rank, a worker's traceback, one deadline that kills."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from benchmarks.harness.launch import WorkerError, timed_steps

# Spawned workers import this module (and with it the package) first: leave them time for that on
# a loaded machine; the deadline test itself uses a short timeout.
START = 90.0
# The launcher starts its workers with spawn; the tests' run_distributed (tests/_dist.py) forks them
# from the tests' fork server unless told start_method="spawn". The first test runs the launcher as it
# is (spawn: the function and its arguments pickled, the module imported again); the failure and
# deadline tests fork (8-16 s less each on 2 loaded cores): what they test, how the launcher collects
# results, raises and kills, is the same code whichever way the processes started.


def report(rank: int, world: int, tag: str) -> dict:
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world": world,
        "tag": tag,
        "group": dist.get_world_size(),
        "sum": total.item(),
        "threads": torch.get_num_threads(),
    }


@pytest.mark.multiprocess
def test_results_of_all_ranks_in_rank_order():
    got = run_distributed(report, 2, "x", timeout=START, start_method="spawn")
    assert [r["rank"] for r in got] == [0, 1]
    assert all(r["world"] == 2 and r["group"] == 2 and r["tag"] == "x" and r["threads"] == 1 for r in got)
    assert all(r["sum"] == 3.0 for r in got)  # they were in one process group


def started_from(rank: int, world: int) -> tuple[int, bool]:
    """The worker's parent and whether it found the fork server's preloaded command module already imported."""
    return os.getppid(), "lightning_pipe.cli.train" in sys.modules


@pytest.mark.multiprocess
def test_the_tests_launcher_forks_its_workers_from_the_fork_server():
    # else every test on it would pay for spawn again, unnoticed (tests/_dist.py patches the launcher), or
    # fork pytest's own threaded process (conftest.py says why not)
    got = run_distributed(started_from, 2, timeout=START)
    assert all(parent != os.getpid() and preloaded for parent, preloaded in got)


def fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from the worker")
    dist.barrier()  # rank 0 would wait here for ever: the launcher must not wait for it


@pytest.mark.multiprocess
def test_worker_exception_surfaces_with_traceback_without_waiting_for_the_deadline():
    started = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 of 2 failed") as err:
        run_distributed(fail_on_one, 2, timeout=START)
    assert time.monotonic() - started < START  # the blocked rank 0 was stopped, not waited for
    assert err.value.rank == 1
    assert "Traceback" in str(err.value) and "in fail_on_one" in str(err.value) and "ValueError: boom from the worker" in str(err.value)
    assert isinstance(err.value, RuntimeError)


def exit_without_result(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # a crash: no exception, no result
    dist.barrier()  # fails when the peer is gone: the crash is reported, not this consequence


@pytest.mark.multiprocess
def test_worker_that_dies_without_a_result():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 died without a result \(exit code 3\)"):
        run_distributed(exit_without_result, 2, timeout=START)


def hang_on_one(rank: int, world: int, folder: str) -> int:
    Path(folder, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    return rank


@pytest.mark.multiprocess
def test_hanging_worker_hits_the_one_deadline_and_is_killed(tmp_path):
    timeout = 4.0  # forked workers: rank 0 is done well within it
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\b1 of 2 did not finish within 4 s"):
        run_distributed(hang_on_one, 2, str(tmp_path), timeout=timeout)
    assert time.monotonic() - started < timeout + 5
    for pid_file in tmp_path.glob("*.pid"):
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(int(pid_file.read_text()), 0)


def test_timed_steps_counts_warmup_and_timed_steps():
    seen = []
    timing = timed_steps(seen.append, steps=3, warmup=2)
    assert seen == [0, 1, 2, 3, 4]
    assert len(timing) == 4 and timing[0] >= sum(timing[1:]) > 0


@pytest.mark.multiprocess
def test_launch_module_does_not_import_lightning():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "harness" / "launch.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('standalone_launch', {str(path)!r})\n"
        "module = sys.modules['standalone_launch'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_pipe')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
