"""The Hydra CLI: recipes, a short real run on 2 processes, a multirun, and bad settings."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from _cli import run_module
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lightning_pipe.cli.paths import CONFIG_DIR
from lightning_pipe.models import count_parameters

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
PAPER = {"gpt2-345m": 345e6, "gpt2-762m": 762e6, "gpt2-1.3b": 1314e6, "bert-large": 340e6}
FAST = [
    "trainer.max_steps=5",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=5",
    "trainer.limit_val_batches=2",
    "data.max_bytes=300000",
]


def cli(args, cwd, timeout=200, forked=False):
    """`python -m lightning_pipe.train args`. `forked`: from the tests' fork server (tests/_cli.py), its second
    rank forked (pipeline.start_method=fork) rather than a re-run command line: for tests of what a run
    computes and writes; test_tiny_recipe_trains_5_steps_on_2_processes starts its ranks as a user's run does."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("LOCAL_RANK", None)
    if forked:
        return run_module("lightning_pipe.train", [*args, "pipeline.start_method=fork"], cwd, env, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "lightning_pipe.train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_recipes_are_the_documented_set():
    # the README's recipe table lists exactly the recipes there are
    documented = sorted(re.findall(r"^\| `([\w.-]+)`", (ROOT / "README.md").read_text(), flags=re.M))
    assert RECIPES == documented and {"gpt-tiny-cpu", "bert-tiny-cpu", "bert-tiny-wave", "gpt2-345m"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_resolves_and_builds_on_meta(recipe):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"recipe={recipe}"])
    with torch.device("meta"):
        module = instantiate(cfg.model)
    n = count_parameters(module.model)
    name = cfg.model.model.get("name")  # the Hugging Face recipes' models have none (their config names them)
    if name in PAPER:
        assert abs(n - PAPER[name]) / PAPER[name] <= 0.05, f"{name}: {n / 1e6:.1f}M vs {PAPER[name] / 1e6:.0f}M"
    assert cfg.data.batch_size >= cfg.pipeline.microbatches
    assert cfg.trainer.devices % cfg.pipeline.width == 0


@pytest.mark.timeout(240)
@pytest.mark.multiprocess
def test_tiny_recipe_trains_5_steps_on_2_processes(tmp_path):
    run = tmp_path / "run"
    proc = cli([*FAST, f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run / "logs" / "version_0" / "metrics.csv")))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == 5  # one per step (log_every_n_steps=1)
    # it learns: from about uniform over the 260 ids (ln 260 = 5.56) the loss falls within 5 steps
    # (5.40 -> 4.81 when written; NaN fails every comparison)
    assert abs(losses[0] - math.log(260)) < 0.5 and losses[-1] < losses[0] - 0.2, losses
    (val_loss,) = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    (val_ppl,) = [float(r["val_ppl"]) for r in rows if r.get("val_ppl")]
    assert val_loss < math.log(260) - 0.3 and val_ppl == pytest.approx(math.exp(val_loss), rel=1e-5)
    # the summary line reports this run's figures: the last step's train loss, the validation loss
    summary = re.search(r"\[lightning-pipe\] gpt-tiny-cpu: train_loss=([\d.]+), val_loss=([\d.]+), val_ppl=([\d.]+)", proc.stdout)
    assert summary, proc.stdout[-2000:]
    assert [float(v) for v in summary.groups()] == pytest.approx([losses[-1], val_loss, val_ppl], abs=1e-4)
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert "schedule: 1f1b" in (run / "config_resolved.yaml").read_text()
    # a quiet CLI: Lightning's start-up lines only with verbose=true (our plan lines stay)
    shown = proc.stdout + proc.stderr
    assert "GPU available" not in shown and "litlogger" not in shown and "Initializing distributed" not in shown, shown[-3000:]
    assert "plan, profile and predicted timeline written" in shown
    # one line per event, not one per rank: the tie said once by rank 0, no per-rank placement lines, no
    # model summary (it would count rank 0's stage only), no sync_dist advice (every rank logs one value)
    assert shown.count("tied across stages") == 1 and "holds chunks" not in shown, shown[-3000:]
    assert "Trainable params" not in shown and "sync_dist=True" not in shown, shown[-3000:]
    # ... and in the run's train.log, with Lightning's own start-up lines kept off it as off the console
    logged = (run / "train.log").read_text()
    assert "plan, profile and predicted timeline written" in logged and "GPU available" not in logged, logged[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_multirun_puts_each_job_in_its_own_folder(tmp_path):
    # the README's command as typed (no hydra.sweep.dir override: its default must resolve)
    proc = cli(["-m", "pipeline.schedule=gpipe,1f1b", *FAST, "trainer.max_steps=3"], tmp_path, timeout=280, forked=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun" / "gpt-tiny-cpu").iterdir()
    for schedule in ["gpipe", "1f1b"]:
        (job,) = sweep.glob(f"*pipeline.schedule={schedule}*")
        assert f"schedule: {schedule}" in (job / "config_resolved.yaml").read_text()
        assert (job / "logs" / "version_0" / "metrics.csv").exists()
    # the same math: both schedules report the same loss
    losses = [line.split("train_loss=")[1].split()[0].rstrip(",") for line in proc.stdout.splitlines() if "[lightning-pipe]" in line]
    assert len(losses) == 2 and losses[0] == losses[1]


RESUME = [
    "trainer.max_steps=12",
    "model.max_steps=12",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "pipeline.partition=uniform",
    "data.synthetic=true",
    "data.synthetic_samples=96",  # 6 batches of 16: step 6 ends epoch 0, step 9 is inside epoch 1
    "callbacks.checkpoint.save_top_k=-1",
]


@pytest.mark.timeout(400)
@pytest.mark.multiprocess
def test_cli_resume_is_bit_for_bit_mid_epoch_and_at_epoch_boundaries(tmp_path):
    whole = tmp_path / "whole"
    proc = cli([*RESUME, f"hydra.run.dir={whole}"], tmp_path, forked=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=False)
    assert final["global_step"] == 12  # last.ckpt is the newest state, whether val_loss improved or not
    for step in (6, 9):
        (ckpt,) = (whole / "checkpoints").glob(f"*step={step}.ckpt")
        resumed = tmp_path / f"from{step}"
        proc = cli([*RESUME, f"hydra.run.dir={resumed}", f"ckpt_path='{ckpt}'"], tmp_path, forked=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "not resumable" not in proc.stderr
        again = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False)
        assert again["global_step"] == 12
        for key, value in final["state_dict"].items():
            assert torch.equal(value, again["state_dict"][key]), f"resumed at step {step}: {key} differs"


def bad(tmp_path, *args, fresh=False):
    """The run fails with one `error:` line, exit 2, no traceback and no run folder (the default
    run folder, outputs/, as a user gets it). Refused before any worker starts, so the command is
    forked from the tests' fork server (tests/_cli.py); `fresh`: a real `python -m` interpreter."""
    if fresh:
        proc = cli(list(args), tmp_path, timeout=120)
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        env.pop("LOCAL_RANK", None)
        proc = run_module("lightning_pipe.train", list(args), tmp_path, env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and sum(line.startswith("error:") for line in proc.stderr.splitlines()) == 1
    assert not (tmp_path / "outputs").exists(), "nothing half-written may be left behind"
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.multiprocess
def test_unknown_recipe(tmp_path):
    line = bad(tmp_path, "recipe=gpt-huge", fresh=True)  # the one refusal checked through a new interpreter
    assert line.startswith("error: Could not find 'recipe/gpt-huge' (available: ") and "gpt-tiny-cpu" in line  # the recipes there are


@pytest.mark.multiprocess
def test_unknown_schedule(tmp_path):
    assert bad(tmp_path, "pipeline.schedule=zigzag").startswith("error: schedule='zigzag' is not a known schedule; allowed values")


@pytest.mark.multiprocess
def test_unknown_model_name(tmp_path):
    assert "unknown model name 'gpt-huge'" in bad(tmp_path, "model.model.name=gpt-huge")


@pytest.mark.multiprocess
def test_missing_data_path(tmp_path):
    assert "data.path" in bad(tmp_path, f"data.path={tmp_path / 'nowhere.txt'}")


@pytest.mark.multiprocess
def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    line = bad(tmp_path, f"data.path={empty}")
    assert line.startswith("error:") and "empty" in line and "data.path" in line


@pytest.mark.multiprocess
def test_sequence_longer_than_the_context(tmp_path):
    line = bad(tmp_path, "data.seq_len=4096")
    assert line.startswith("error:") and "data.seq_len" in line


@pytest.mark.multiprocess
def test_devices_that_do_not_fit_the_pipeline(tmp_path):
    line = bad(tmp_path, "trainer.devices=3", "pipeline.width=2")
    assert line.startswith("error:") and "pipeline.width" in line
    line = bad(tmp_path, "trainer.devices=2", "pipeline.partition=[4,4]")
    assert line.startswith("error:") and "sums to 8 blocks but the model has 10 blocks" in line


def plan_cli(args, cwd):
    """`python -m lightning_pipe.plan` (it starts no processes: forked from the fork server, tests/_cli.py)."""
    return run_module("lightning_pipe.plan", args, cwd, dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)


@pytest.mark.multiprocess
def test_plan_command_prints_and_saves_a_plan(tmp_path):
    import json

    proc = plan_cli(["recipe=gpt2-345m", "pipeline.stages=8", "pipeline.slicer=true", f"hydra.run.dir={tmp_path / 'p'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "autopipe plan, 1f1b, 8 stages" in proc.stdout and "master stage" in proc.stdout
    summary = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert summary["plan"]["stages"] == 8 and sum(summary["plan"]["sizes"]) == 2 * 24 + 2
    assert summary["slicer"]["startup"] < summary["slicer"]["baseline_startup"]
    assert (tmp_path / "p" / "plan_timeline.png").exists()


@pytest.mark.multiprocess
def test_plan_command_prints_the_mesh_and_the_sharded_memory(tmp_path):
    import json

    runs, out = {}, {}
    for shard in ("none", "optimizer", "full"):
        args = ["recipe=gpt2-345m", "trainer.devices=8", "pipeline.width=2", f"pipeline.shard={shard}", f"hydra.run.dir={tmp_path / shard}"]
        proc = plan_cli([*args, "pipeline.schedule=auto"], tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[shard], out[shard] = json.loads((tmp_path / shard / "plan.json").read_text()), proc.stdout
        assert "mesh: pp 4 x dp 2" in proc.stdout and "predicted peak memory per rank (by stage)" in proc.stdout
    sharded, whole = runs["optimizer"], runs["none"]
    # shard=full: every candidate priced with FSDP2's all-gathers (rings on the link settings here), so each is slower
    # than on whole replicas, and a rank holds its weights' parameters, Adam's moments / 2 and whole gradients
    assert runs["full"]["mesh"]["shard"] == "full" and runs["full"]["predicted_memory_bytes"]["weight_copies"] == 2.5
    times = {
        k: {c["schedule"] + str(c["options"]): c["iteration_time"] for c in r["schedule_choice"]["candidates"]} for k, r in runs.items()
    }
    assert times["optimizer"] == times["none"]
    full = {k: t for k, t in times["full"].items() if t != float("inf")}
    assert full and all(t > times["none"][k] for k, t in full.items()), (times["full"], times["none"])
    # the tied embedding (block 0) and head (block 49) on different ranks, as FSDP2 shards each block on its own: the
    # V-shaped placements (the wave's first and last chunk on rank 0) cannot run
    verdicts = {c["schedule"] + str(c["options"]): c["verdict"] for c in runs["full"]["schedule_choice"]["candidates"]}
    assert "blocks 0 and 49 share a weight" in verdicts["wave{'waves': 1}"] and "share" not in verdicts["1f1b{}"], verdicts
    assert times["none"]["wave{'waves': 1}"] != float("inf")  # which whole replicas can run
    assert (
        sharded["mesh"] == {"pp": 4, "dp": 2, "tp": 1, "shard": "optimizer"}
        and "Adam's moments sharded over 2 replicas" in out["optimizer"]
    )
    assert sharded["predicted_memory_bytes"]["weight_copies"] == 3.0 and whole["predicted_memory_bytes"]["weight_copies"] == 4.0
    # the same partition: each stage's prediction drops by one weight copy (Adam's two moments, halved)
    assert sharded["plan"]["sizes"] == whole["plan"]["sizes"]
    for a, b in zip(sharded["predicted_memory_bytes"]["per_rank"], whole["predicted_memory_bytes"]["per_rank"]):
        assert a < b
    # tensor=2 on the same 8 devices: pp 2 x dp 2 x tp 2, each rank holding half of its layers' weights
    args = ["recipe=gpt2-345m", "trainer.devices=8", "pipeline.width=2", "pipeline.tensor=2", f"hydra.run.dir={tmp_path / 'tp'}"]
    proc = plan_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    split = json.loads((tmp_path / "tp" / "plan.json").read_text())
    assert "mesh: pp 2 x dp 2 x tp 2" in proc.stdout and "layers' weights split over 2 tensor-parallel ranks" in proc.stdout
    assert split["mesh"] == {"pp": 2, "dp": 2, "tp": 2, "shard": "none"}
    # the stages' weights summed: the whole model's at pp4, half at pp2 x tp2 (a tensor rank's share of the layers, and
    # of the embedding and head, split over the vocabulary)
    assert sum(split["plan"]["stage_param_bytes"]) == pytest.approx(0.5 * sum(whole["plan"]["stage_param_bytes"]))


@pytest.mark.multiprocess
def test_plan_command_from_a_saved_profile_and_bad_profiles(tmp_path):
    from lightning_pipe.profiling import Profile

    good = Profile.synthetic([1e-3] * 10, activation_bytes=1e5).save(tmp_path / "profile.json")
    proc = plan_cli(["partition=dp", f"pipeline.profile={good}", f"hydra.run.dir={tmp_path / 'p'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dp plan, 1f1b, 2 stages" in proc.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"model": "m", "microbatch_size": 1, "dtype": "f", "device": "cpu", "forward": [-1.0], '
        '"backward": [1.0], "activation_bytes": [0], "param_bytes": [0]}'
    )
    proc = plan_cli([f"pipeline.profile={bad}", f"hydra.run.dir={tmp_path / 'q'}"], tmp_path)
    assert proc.returncode == 2 and "error: profile: forward must hold finite numbers >= 0" in proc.stderr


@pytest.mark.multiprocess
def test_plan_command_chooses_a_schedule(tmp_path):
    import json

    proc = plan_cli(
        ["recipe=gpt2-345m", "pipeline.stages=4", "pipeline.microbatches=8", "pipeline.schedule=auto", f"hydra.run.dir={tmp_path / 'p'}"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "p" / "plan.json").read_text())
    candidates = summary["schedule_choice"]["candidates"]
    # 1f1b, interleaved v=2/4, wave W=1/2/4 (ours), hanayo W=1/2/4 (the paper's order), zb-h1, zb-v and zb-auto
    # (skipped: the analytic profile has no measured weight-gradient times)
    assert len(candidates) == 12
    assert {c["schedule"] for c in candidates if c["verdict"].startswith("skipped")} == {"zb-h1", "zb-v", "zb-auto"}
    chosen = next(c for c in candidates if c["verdict"] == "chosen")
    assert chosen["iteration_time"] == min(c["iteration_time"] for c in candidates)
    assert summary["plan"]["schedule"] == chosen["schedule"] and summary["plan"]["bounds"] == chosen["bounds"]
    assert "schedule=auto" in proc.stdout and "is the fastest simulated schedule" in proc.stdout


@pytest.mark.multiprocess
def test_waves_that_do_not_fit_name_the_setting(tmp_path):
    line = bad(tmp_path, "pipeline.schedule=wave", "pipeline.waves=3")  # gpt-tiny: 10 blocks < 2 x 2 x 3 chunks
    assert line.startswith("error: schedule='wave' with waves=3 on 2 ranks") and "use waves <= 2" in line
    assert "pipeline.waves" in line


@pytest.mark.multiprocess
def test_plan_command_dumps_the_schedule_it_planned(tmp_path):
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.schedules.text import load

    proc = plan_cli(
        [
            "recipe=gpt-tiny-cpu",
            "partition=dp",
            "schedule=wave",
            "pipeline.microbatches=4",
            "--dump-schedule",
            f"hydra.run.dir={tmp_path / 'p'}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = (tmp_path / "p" / "schedule.txt").read_text()
    assert saved in proc.stdout
    assert load(saved) == build_schedule("wave", 2, 4, waves=1)
    # a CPU recipe is planned on its blocks measured here, as its training run measures them (not on FLOPs at an
    # accelerator's rate, which put 1 of its 10 blocks on one stage and 9 on the other)
    assert "costs: the 10 blocks of gpt-tiny profiled on this machine's CPU" in proc.stdout
    profile = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert len(profile["forward"]) == 10 and min(profile["forward"]) > 0


@pytest.mark.multiprocess
def test_the_default_plan_of_the_cpu_recipe_is_balanced_on_measured_costs(tmp_path):
    proc = plan_cli([f"hydra.run.dir={tmp_path / 'p'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert summary["costs"].startswith("the 10 blocks of gpt-tiny profiled on this machine's CPU")
    # the embedding and the head are measured, not charged a kernel overhead: no stage holds a single block
    assert min(summary["plan"]["sizes"]) >= 3, summary["plan"]["sizes"]


class _WorseEveryTime(L.LightningModule):
    """val_loss rises with every validation: ModelCheckpoint(monitor=val_loss) keeps the first."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", float(self.global_step))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_last_ckpt_is_the_newest_state_when_validation_does_not_improve(tmp_path):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["callbacks=default"], return_hydra_config=False)
    entries = {k: v for k, v in cfg.callbacks.items() if k in ("checkpoint", "last")}
    assert set(entries) == {"checkpoint", "last"}
    callbacks = [instantiate(v, dirpath=str(tmp_path)) for v in entries.values()]
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=1)
    trainer = L.Trainer(
        max_steps=7, val_check_interval=3, limit_val_batches=1, callbacks=callbacks, logger=False, enable_progress_bar=False
    )
    trainer.fit(_WorseEveryTime(), data, data)
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 7  # after the last step, not the best one
    (best,) = [p for p in tmp_path.glob("*.ckpt") if p.name != "last.ckpt"]
    assert torch.load(best, weights_only=False)["global_step"] == 3


def _checkpoints(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"model.0.weight": torch.zeros(2)}}, good)  # another model's
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:100])
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all")
    return {
        "missing": (tmp_path / "nowhere.ckpt", "no such file"),
        "other": (good, "does not fit this model"),
        "truncated": (truncated, "not a readable checkpoint"),
        "garbage": (garbage, "not a readable checkpoint"),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", ["missing", "other", "truncated", "garbage"])
def test_bad_ckpt_path_is_one_line(tmp_path, which):
    path, words = _checkpoints(tmp_path)[which]
    line = bad(tmp_path, f"ckpt_path='{path}'", "trainer.max_steps=1")
    assert line.startswith("error: ckpt_path=") and words in line


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "override,words",
    [
        ("trainer.devices=0", "trainer: `Trainer(devices=0)`"),
        ("trainer.devices=-1", "should be an int > 0"),
        ("trainer.num_nodes=0", "`num_nodes` must be a positive integer"),
        ("trainer.accumulate_grad_batches=0", "accumulate_grad_batches=0: must be an integer >= 1"),
        ("pipeline.latency=abc", "pipeline.latency=abc"),
        ("pipeline.timeout=0", "(pipeline.timeout)"),
        ("pipeline.profile=/nowhere/profile.json", "profile='/nowhere/profile.json'"),
        ("recipe=gpt2-345m", "trainer.accelerator=gpu"),  # a paper-size recipe on a machine without GPUs
        ("recipe=gpt-tiny-2bw trainer.accumulate_grad_batches=2", "schedule='2bw' applies one update per batch"),
        ("recipe=gpt-tiny-2bw pipeline.microbatches=1", "PipeDream-2BW needs m >= stages"),
    ],
)
def test_late_errors_are_one_line_exit_2(tmp_path, override, words):
    assert words in bad(tmp_path, *override.split(), "trainer.max_steps=1")
