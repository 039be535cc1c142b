"""matplotlib is optional (the `plots` extra): without it every library module imports, the strategy
trains, the plan is made and written, no picture is drawn, and one warning line says so, once per
process however many timelines are asked for.

Each check runs in a fresh process where `import matplotlib` raises ImportError, as where it is
not installed (Lightning is imported first: torchmetrics imports matplotlib itself when it is
installed, and its own availability check would then disagree with the block)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARNING = "matplotlib is not installed: timelines are not drawn"
BLOCK = """
import sys
import lightning as L
for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
    del sys.modules[name]
sys.modules["matplotlib"] = None  # `import matplotlib` now raises ImportError
"""
TRAIN = """
sys.path.insert(0, {tests!r})
from models import LitSeq, loader, trainer_kwargs
from lightning_pipe import AutoPipeStrategy
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, gantt, simulate
strategy = AutoPipeStrategy(microbatches=2, partition="autopipe", message_costs=False)  # one process: this one
L.Trainer(devices=1, strategy=strategy, **trainer_kwargs(max_steps=2, default_root_dir={out!r})).fit(LitSeq(), loader())
timeline = simulate(build_schedule("1f1b", 2, 4), CostModel.uniform(4, 1.0, 2.0), [(0, 2), (2, 4)])
assert gantt(timeline, {out!r} + "/again.png") is None  # a second timeline: no picture, no second warning
"""
IMPORT_ALL = """
import importlib
from pathlib import Path
root = Path({package!r})
names = sorted(".".join(("lightning_pipe",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__") for p in root.rglob("*.py"))
for name in names:
    importlib.import_module(name)  # a module-level `import matplotlib` anywhere raises here
print(len(names), "modules imported")
"""


def run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_library_module_imports_without_matplotlib(tmp_path):
    proc = run(IMPORT_ALL.format(package=str(ROOT / "lightning_pipe")), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[0]) > 50, proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_training_plans_and_writes_without_matplotlib_and_says_so_once(tmp_path):
    proc = run(TRAIN.format(tests=str(ROOT / "tests"), out=str(tmp_path)), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (plan,) = tmp_path.rglob("plan.json")
    assert json.loads(plan.read_text())["bounds"] and not list(tmp_path.rglob("*.png"))
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if WARNING in line]
    assert len(said) == 1, said
    assert "lightning-pipe[plots]" in said[0]
