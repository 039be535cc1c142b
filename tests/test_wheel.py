"""The wheel carries its configs: built from a copy of this checkout, installed into a fresh virtual
environment (the package only from the wheel; its dependencies from this interpreter's site-packages,
--system-site-packages, so nothing is downloaded), then `plan` and a short `train` from a folder
outside any checkout find the Hydra configs the wheel installed (lightning_pipe/conf)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def run(args: list, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_RANK", "LIGHTNING_PIPE_CONF")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_installed_wheel_plans_and_trains_from_anywhere(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE", "recipes"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, source / name)
    shutil.copytree(ROOT / "conf", source / "conf", symlinks=True)  # conf/recipe stays a link to ../recipes
    shutil.copytree(ROOT / "lightning_pipe", source / "lightning_pipe", ignore=shutil.ignore_patterns("__pycache__"))
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", source], tmp_path
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("lightning_pipe-*.whl")
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", "--system-site-packages", venv], tmp_path).returncode == 0
    python = venv / "bin" / "python"
    installed = run([python, "-m", "pip", "install", "--no-deps", "-q", wheel], tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([python, "-c", "import lightning_pipe.cli.paths as p; print(p.__file__); print(p.CONFIG_DIR)"], elsewhere)
    package, conf = where.stdout.split()
    assert package.startswith(str(venv)) and conf == str(Path(package).parents[1] / "conf"), where.stdout + where.stderr
    planned = run([python, "-m", "lightning_pipe.plan", "recipe=gpt-tiny-cpu"], elsewhere)
    assert planned.returncode == 0 and "autopipe plan" in planned.stdout, planned.stdout[-2000:] + planned.stderr[-2000:]
    trained = run(
        [
            python,
            "-m",
            "lightning_pipe.train",
            "trainer.max_steps=2",
            "trainer.limit_val_batches=0",
            "data.max_bytes=100000",
            "callbacks=none",
        ],
        elsewhere,
    )
    assert trained.returncode == 0 and "[lightning-pipe] gpt-tiny-cpu: train_loss=" in trained.stdout, trained.stderr[-3000:]
    assert (elsewhere / "outputs" / "gpt-tiny-cpu").is_dir()
