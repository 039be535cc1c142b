"""The fault matrix (docs/guide/faults.md): each fault injected into a real 2-process training job
(tests/fault_job.py, pipeline timeout 6 s) ends it with at most one `error:` line, no traceback,
the documented exit code and within a bounded time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
JOB = Path(__file__).resolve().parent / "fault_job.py"


def run_job(tmp_path, fault, rank, phase, limit=90):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(JOB.parents[1]))
    env.pop("LOCAL_RANK", None)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(JOB), fault, str(rank), phase, str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=limit
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode, errors, time.monotonic() - start, proc


@pytest.mark.timeout(120)
def test_no_fault_trains(tmp_path):
    code, errors, _, proc = run_job(tmp_path, "none", 0, "train")
    assert code == 0 and not errors and "finished" in proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_block_raising_is_one_line_exit_2(tmp_path, rank):
    code, errors, _, _ = run_job(tmp_path, "raise", rank, "train")
    assert code == 2 and errors == [f"error: rank {rank}: RuntimeError: injected failure in train"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["train", "save"])
def test_a_killed_worker_ends_the_job(tmp_path, phase):
    code, errors, _, _ = run_job(tmp_path, "kill", 1, phase)
    assert code == 1 and errors == ["error: local rank 1 was killed by SIGKILL; the job stops"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_on_one_rank_stops_both_at_the_same_step(tmp_path, rank):
    # SIGTERM in step 3 (STEP) on one rank: both ranks stop at the same step, as Lightning's SIGTERMException
    # (a clean exit, no error line); without the strategy's check a SIGTERM on rank 1 ended rank 1 alone and
    # rank 0 failed on the lost connection. Rank 1's own signal comes after it posted step 3's flag, so
    # both complete step 4 and stop before step 5. Rank 0 launched rank 1 and forwards its signal: it may
    # reach rank 1 before rank 1 posts step 3's flag (the last stage ends step 2 later), and then both stop
    # a step earlier; never later than two steps after the signal.
    code, errors, _, proc = run_job(tmp_path, "term", rank, "train")
    assert code == 0 and not errors and "finished" not in proc.stdout, proc.stderr[-3000:]
    steps = [int((tmp_path / "out" / f"step-rank{r}.txt").read_text()) for r in range(2)]
    assert steps[0] == steps[1] and steps[0] in ({5} if rank == 1 else {4, 5}), steps
    assert (proc.stdout + proc.stderr).count("SIGTERM: every rank stops after step") == 1  # said once, by rank 0
    assert f"SIGTERM: every rank stops after step {steps[0]}" in proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_a_stopped_worker_is_named_after_the_timeout(tmp_path):
    code, errors, seconds, _ = run_job(tmp_path, "stop", 1, "train")
    assert code == 1 and len(errors) == 1 and errors[0].startswith("error: rank 1 has not answered for")
    assert "pipeline.timeout=6 s" in errors[0] and seconds < 60


@pytest.mark.timeout(120)
def test_disk_full_on_checkpoint_names_the_file(tmp_path):
    code, errors, _, _ = run_job(tmp_path, "diskfull", 0, "save")
    assert code == 2 and len(errors) == 1 and "No space left on device" in errors[0] and "step=4.ckpt" in errors[0]
    assert not list((tmp_path / "out").rglob("*.ckpt")), "no half-written checkpoint"


@pytest.mark.timeout(120)
def test_a_stopped_launcher_is_killed_by_rank_1(tmp_path):
    # Rank 0 is the launching process and hosts the store: rank 1 notices the silence, names it and
    # SIGKILLs it, so the command returns instead of staying stopped.
    code, errors, seconds, _ = run_job(tmp_path, "stop", 0, "val")
    assert code == -9, code
    assert errors == ["error: rank 0 is frozen (its store has not answered for 6 s); the job stops (pipeline.timeout=6 s)"]
    assert seconds < 60


@pytest.mark.timeout(120)
def test_a_block_raising_in_validation_on_rank_1_is_one_line(tmp_path):
    code, errors, _, _ = run_job(tmp_path, "raise", 1, "val")
    assert code == 2 and errors == ["error: rank 1: RuntimeError: injected failure in val"]


@pytest.mark.timeout(120)
def test_a_worker_stopped_while_saving_is_named(tmp_path):
    code, errors, seconds, _ = run_job(tmp_path, "stop", 1, "save")
    assert code == 1 and len(errors) == 1 and errors[0].startswith("error: rank 1 has not answered for"), errors
    assert not list((tmp_path / "out").rglob("*.ckpt.tmp*")) and seconds < 60


@pytest.mark.timeout(120)
def test_a_rank_tearing_down_after_rank_0_does_not_fail_a_finished_run(tmp_path):
    # rank 0 hosts the store; it waits for every rank to leave the heartbeat before it exits
    code, errors, _, proc = run_job(tmp_path, "slowexit", 1, "end")
    assert code == 0 and not errors and "finished" in proc.stdout, proc.stderr[-2000:]
