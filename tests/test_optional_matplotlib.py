"""The strategy trains without matplotlib (an optional part): the plan is made and written, no picture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = """
import sys
import lightning as L  # torchmetrics imports matplotlib itself when it is installed: block it after
for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
    del sys.modules[name]
sys.modules["matplotlib"] = None  # `import matplotlib` now raises ImportError, as where it is not installed
sys.path.insert(0, {tests!r})
from models import LitSeq, loader, trainer_kwargs
from lightning_pipe import AutoPipeStrategy
strategy = AutoPipeStrategy(microbatches=2, partition="autopipe", message_costs=False)  # one process: this one
L.Trainer(devices=1, strategy=strategy, **trainer_kwargs(max_steps=2, default_root_dir={out!r})).fit(LitSeq(), loader())
"""


@pytest.mark.timeout(200)
def test_training_plans_and_writes_without_matplotlib(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    code = JOB.format(tests=str(ROOT / "tests"), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (plan,) = tmp_path.rglob("plan.json")
    assert json.loads(plan.read_text())["bounds"] and not list(tmp_path.rglob("*.png"))
    assert "matplotlib is not installed: timelines are not drawn" in proc.stderr
