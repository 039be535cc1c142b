"""One planning entry: `python -m lightning_pipe.plan` prints exactly the plan `train` runs.

Both commands get the same saved profile (so neither measures), the plan command prints and writes
plan.json, training plans in its setup on 2 real processes and writes its own plan.json; the
schedule, its options, the partition and the slicer's count must be equal for every setting.
(Before the planning entry, a fixed `slicer` count printed `choose_slicing`'s count and trained with
the fixed one; a saved profile was planned with a GPU link and without block kinds.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _cli import run_module

from lightning_pipe.profiling import Profile

ROOT = Path(__file__).resolve().parents[1]
# uneven block costs (GPT-tiny: 10 blocks), so partitioners, schedules and slicer counts differ
FORWARD = [1e-3, 2e-3, 1.5e-3, 3e-3, 1e-3, 2.5e-3, 1e-3, 2e-3, 1e-3, 4e-3]

SETTINGS = {
    # a fixed slicer count: the command printed choose_slicing's 2 here (and refused listed sizes)
    "1f1b-slicer-1": ["pipeline.slicer=1"],
    "1f1b-slicer-2-listed": ["pipeline.slicer=2", "pipeline.partition=[3,7]"],
    "gpipe-slicer-true-dp": ["schedule=gpipe", "pipeline.slicer=true", "partition=dp"],
    "interleaved-autopipe": ["schedule=interleaved", "pipeline.chunks=2"],
    "wave-parameters": ["schedule=wave", "partition=parameters"],
    "hanayo-exhaustive": ["schedule=hanayo", "partition=exhaustive"],
    "advance-dp": ["schedule=advance", "pipeline.advance_num=2", "partition=dp"],
    "auto-slicer": ["schedule=auto", "pipeline.slicer=true"],
}


def run(module: str, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m module args`, forked from the tests' fork server (tests/_cli.py). Training forks its
    second rank (pipeline.start_method=fork) instead of re-running the command line: what these tests
    compare, the plan printed and the plan trained, does not depend on how the ranks start (the CLI's
    own tests start them as a user's run does)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("LOCAL_RANK", None)
    if module == "lightning_pipe.train":
        args = [*args, "pipeline.start_method=fork"]
    return run_module(module, args, cwd, env, timeout=timeout)


def decision(plan_json: Path) -> dict:
    summary = json.loads(plan_json.read_text())
    return {k: summary[k] for k in ("schedule", "options", "bounds", "sliced")}


@pytest.mark.timeout(200)
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_plan_command_prints_the_plan_training_runs(tmp_path, name):
    profile = Profile.synthetic(FORWARD, activation_bytes=1e5).save(tmp_path / "profile.json")
    common = ["recipe=gpt-tiny-cpu", f"pipeline.profile={profile}", *SETTINGS[name]]
    planned = run("lightning_pipe.plan", [*common, f"hydra.run.dir={tmp_path / 'plan'}"], tmp_path, 90)
    assert planned.returncode == 0, planned.stderr[-2000:]
    trained = run(
        "lightning_pipe.train",
        [
            *common,
            "trainer.max_steps=1",
            "trainer.limit_val_batches=0",
            "data.max_bytes=100000",
            "callbacks=none",
            f"hydra.run.dir={tmp_path / 'train'}",
        ],
        tmp_path,
        150,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    (ran,) = (tmp_path / "train").rglob("plan.json")
    printed = decision(tmp_path / "plan" / "plan.json")
    assert printed == decision(ran)
    # and what the command printed is that plan (the partition's sizes per chunk in its table or line)
    sizes = [b - a for a, b in printed["bounds"]]
    assert f"({sizes[0]})" in planned.stdout or str(sizes) in planned.stdout, planned.stdout[-2000:]
    if printed["sliced"]:
        assert f"slicer: {printed['sliced']} warm-up micro-batches" in planned.stdout
