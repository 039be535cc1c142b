"""The README's Python API example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_pipe as lp

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs(tmp_path, capsys):
    text = README.read_text()
    block = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert (tmp_path / "timeline.png").exists() and (tmp_path / "timeline.json").exists()
    best, timeline = scope["best"], scope["timeline"]
    assert isinstance(best, lp.Plan) and best.iteration_time == timeline.iteration_time
    assert timeline.master_stage in (0, 1) and 0 < timeline.bubble_ratio < 1
    assert "stage" in capsys.readouterr().out
