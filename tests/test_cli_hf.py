"""The Hydra CLI with Hugging Face models (recipes hf-gpt2, hf-llama): a short real run on 2 processes,
the plan command (the blocks profiled on the CPU) and a bad model.config. Nothing is downloaded: the
models are built from tiny built-in configs."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
from test_cli import FAST, bad, cli, plan_cli

pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recipe", ["hf-gpt2", "hf-llama"])
def test_hf_recipe_trains_on_2_processes(tmp_path, recipe):
    run = tmp_path / "run"
    proc = cli([f"recipe={recipe}", *FAST, f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run / "logs" / "version_0" / "metrics.csv")))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    # one per step; from about uniform over the 260 byte ids (ln 260 = 5.56) the loss falls (NaN fails every comparison)
    assert len(losses) == 5 and abs(losses[0] - math.log(260)) < 0.6 and losses[-1] < losses[0] - 0.2, losses
    (val_loss,) = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    (val_ppl,) = [float(r["val_ppl"]) for r in rows if r.get("val_ppl")]
    assert val_loss < math.log(260) and val_ppl == pytest.approx(math.exp(val_loss), rel=1e-5)
    summary = re.search(rf"\[lightning-pipe\] {recipe}: train_loss=([\d.]+), val_loss=([\d.]+), val_ppl=([\d.]+)", proc.stdout)
    assert summary, proc.stdout[-2000:]
    assert [float(v) for v in summary.groups()] == pytest.approx([losses[-1], val_loss, val_ppl], abs=1e-4)
    # planned by autopipe from the blocks profiled on the ranks: [First, 4 layers as attention and MLP halves, Last]
    plan = json.loads((run / "logs" / "version_0" / "plan.json").read_text())
    assert sum(b - a for a, b in plan["bounds"]) == 10 and len(plan["bounds"]) == 2
    assert (run / "checkpoints" / "last.ckpt").exists()


@pytest.mark.timeout(120)
def test_plan_profiles_the_blocks_of_an_hf_model(tmp_path):
    out = tmp_path / "p"
    proc = plan_cli(["recipe=hf-gpt2", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # [first, 4 layers as attention and MLP halves, last]
    assert "the 10 blocks of GPT2LMHeadModel (first, 8 repeated or their halves, last) profiled on this machine's CPU" in proc.stdout
    assert "autopipe plan, 1f1b, 2 stages" in proc.stdout
    summary = json.loads((out / "plan.json").read_text())
    assert sum(summary["plan"]["sizes"]) == 10 and summary["costs"].startswith("the 10 blocks of GPT2LMHeadModel")
    profile = json.loads((out / "profile.json").read_text())
    assert profile["block_names"] == ["First", *["HalfA", "HalfB"] * 4, "Last"] and all(t > 0 for t in profile["forward"])


@pytest.mark.timeout(120)
def test_bad_model_config_is_one_line(tmp_path):
    line = bad(tmp_path, "recipe=hf-llama", f"model.config={tmp_path / 'nowhere' / 'config.json'}")
    assert line.startswith("error: model.config=") and "no such file or directory" in line and "built-in config: gpt2, llama" in line
