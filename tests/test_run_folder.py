"""One run folder for every process of a job, named by the job's id, and `ckpt_path=last` resuming
a requeued job from it (real CLI runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli import run_module

ROOT = Path(__file__).resolve().parents[1]
FAST = ["trainer.log_every_n_steps=1", "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "data.max_bytes=100000"]


def cli(module: str, args: list[str], cwd: Path, forked: bool = False, **env: str) -> subprocess.CompletedProcess:
    """`python -m module args`; `forked`: from the tests' fork server (tests/_cli.py), for a command that starts no processes."""
    environ = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
    environ.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **env)
    if forked:
        return run_module(module, args, cwd, environ, timeout=200)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=200)


@pytest.mark.parametrize("env, folder", [({"SLURM_JOB_ID": "4242"}, "slurm-4242"), ({"TORCHELASTIC_RUN_ID": "job7"}, "torchrun-job7")])
def test_the_run_folder_is_named_by_the_jobs_id(tmp_path, env, folder):
    proc = cli("lightning_pipe.plan", ["recipe=gpt-tiny-cpu"], tmp_path, forked=True, **env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "outputs" / "gpt-tiny-cpu" / folder / "plan.json").is_file()


@pytest.mark.timeout(400)
@pytest.mark.multiprocess
def test_ckpt_path_last_resumes_a_requeued_job(tmp_path):
    first = cli("lightning_pipe.train", [*FAST, "trainer.max_steps=3", "ckpt_path=last"], tmp_path, SLURM_JOB_ID="77")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "ckpt_path=last: no last.ckpt yet, starting fresh" in first.stdout
    last = tmp_path / "outputs" / "gpt-tiny-cpu" / "slurm-77" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 3
    again = cli("lightning_pipe.train", [*FAST, "trainer.max_steps=6", "ckpt_path=last"], tmp_path, SLURM_JOB_ID="77")  # the requeue
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"ckpt_path=last: resuming from {last}" in again.stdout
    assert torch.load(last, weights_only=False)["global_step"] == 6  # 3 more steps, in the same folder
