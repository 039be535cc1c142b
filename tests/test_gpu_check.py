"""The prepared GPU check's CPU smoke version (what CI runs so the check cannot rot): every section
runs and passes its own assertions, and the report and the measured profile are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipe.profiling import Profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(540)
def test_gpu_check_smoke_runs_every_section(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=520,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert set(sections) == {
        "strategy on one GPU",
        "2BW and AvgPipe(2BW) on one GPU",
        "AvgPipe: two pipelines sharing one GPU",
        "precision plugin",
        "CUDA-timed block profiles",
        "planners on the measured profiles",
        "peak memory per stage",
        "pipeline x sharded data parallel on 4 GPUs",
        "pipeline x tensor parallel on 4 and 8 GPUs",
        "torch.compile per block",
    }
    assert all(s["status"] == "ok" for s in sections.values()), {k: s["result"] for k, s in sections.items() if s["status"] != "ok"}
    exact = sections["strategy on one GPU"]["result"]
    assert all(exact[s]["max_rel_error_vs_plain_trainer"] <= 1e-10 for s in ("1f1b", "interleaved"))
    assert sections["2BW and AvgPipe(2BW) on one GPU"]["result"]["AvgPipe(2BW) N=1 vs 2BW: max rel error"] <= 1e-10
    assert Profile.load(tmp_path / "profile_gpt-tiny.json").num_blocks == 10
    assert "autopipe plan, 1f1b, 4 stages" in sections["planners on the measured profiles"]["result"]["gpt-tiny on 4"]["autopipe"]
    # 4 processes: its CPU twin is tests/test_zero.py, so the smoke run only names it
    assert "tests/test_zero.py" in sections["pipeline x sharded data parallel on 4 GPUs"]["result"]["not run on CPU"]
    compiled = sections["torch.compile per block"]["result"]
    assert len(compiled["per block"]) == 10 and compiled["max relative output difference"] < 1e-4
    assert all(b["eager ms"] > 0 and b["compiled ms"] > 0 for b in compiled["per block"].values())
    assert "# GPU check: cpu (smoke)" in (tmp_path / "gpu_check.md").read_text()
