"""`pipeline.tune=true`: AvgPipe's tuner of M (micro-batches) and N (parallel pipelines), §5.2.

The profile is one real training run of the job itself — same recipe, model, data and schedule —
at the paper's profiled setting (the largest M of the grid, N = 1) for `tune_batches` steps (plus
one warm-up step not counted), started as a child `python -m lightning_pipe.train` whose ranks
record their steps (`lightning_pipe.lightning.tune_record`). From it every (M, N) of the grid is
predicted (`lightning_pipe.tuning.predict`, Eq. 1-8, with `tune_model=paper`; by default ours,
`tune_model=calibrated`, runs a second profile at the grid's smallest M on the first run's partition
and predicts with `lightning_pipe.tuning.calibrated`), and the fastest within memory_limit is
chosen. `tune.json` in the run folder lists every candidate; `train` then runs N x K processes
with it (its own workers, started by Lightning, read the choice from that file instead of tuning
again); `plan` only prints the table.

The depth K of a pipeline stays as configured (devices x nodes / pipelines, or `pipeline.stages`);
the chosen job runs N x K worker processes (plus AvgPipe's K reference processes).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from ..config import PipelineConfig
from ..errors import SettingError
from ..lightning.tune_record import RECORD_ENV
from ..tuning import TuneProfile, TuneResult, choose, default_grid, predict_calibrated

TUNED_ENV = "LIGHTNING_PIPE_TUNED"  # the tune.json a job's own workers apply instead of tuning again
_PROFILE_TIMEOUT = 3600.0
# settings of the profiled run that the tuner fixes itself (a user's value for them is replaced)
_OWN = ("pipeline.tune", "pipeline.pipelines", "pipeline.microbatches", "trainer.devices", "trainer.num_nodes", "trainer.max_steps")
_OWN += ("trainer.limit_val_batches", "logger", "callbacks", "ckpt_path", "test_after_fit", "hydra.run.dir", "pipeline.trace")


def depth(cfg: DictConfig, config: PipelineConfig) -> int:
    """K, the depth of one pipeline, as configured: devices x nodes (/ pipelines with share_devices=false;
    or pipeline.stages)."""
    world = config.world(int(cfg.trainer.devices), int(cfg.trainer.get("num_nodes", 1)))
    return config.stages or config.topology(world).depth


def check(cfg: DictConfig, config: PipelineConfig) -> tuple[list[int], list[int]]:
    """The grid, checked before anything runs."""
    if config.pipelines is None:
        raise SettingError("tune=true is AvgPipe's tuner of micro-batches and pipelines: use pipeline=avgpipe", "tune")
    if int(cfg.trainer.get("num_nodes", 1)) != 1:
        raise SettingError("tune=true profiles on one node: set trainer.num_nodes=1 (multi-node tuning is not built)", "tune")
    ms, ns = default_grid(int(cfg.data.batch_size), config.tune_microbatches, config.tune_pipelines)
    stages = depth(cfg, config)
    for m in ms:
        try:
            config.schedule_spec.placement(stages, m)
        except ValueError as err:
            raise SettingError(f"tune_microbatches={ms}: M={m} does not run on {stages} stages: {err}", "tune_microbatches") from None
    return ms, ns


def run_profile(
    cfg: DictConfig, config: PipelineConfig, folder: Path, microbatches: int, stages: int, partition: Optional[list[int]] = None
) -> list[dict]:
    """The profiled run as a child training job (on `partition` where given); returns every rank's record."""
    own = _OWN + (("pipeline.partition",) if partition else ())
    given = [o for o in HydraConfig.get().overrides.task if o.lstrip("+~").split("=", 1)[0] not in own]
    ranks = folder / "ranks"
    cmd = [sys.executable, "-m", "lightning_pipe.train", *given]
    if partition:
        cmd.append(f"pipeline.partition=[{','.join(map(str, partition))}]")
    cmd += ["pipeline.tune=false", "pipeline.pipelines=1", f"pipeline.microbatches={microbatches}", "pipeline.trace=false"]
    cmd += [f"trainer.devices={stages}", "trainer.num_nodes=1", f"trainer.max_steps={config.tune_batches + 1}"]
    cmd += ["trainer.limit_val_batches=0", "logger=none", "callbacks=none", "ckpt_path=null", "test_after_fit=false"]
    cmd += [f"hydra.run.dir={folder}"]
    env = {k: v for k, v in os.environ.items() if k not in (TUNED_ENV, "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    env[RECORD_ENV] = str(ranks)
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=_PROFILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"tuner: the profile run did not finish in {_PROFILE_TIMEOUT:.0f} s (lower pipeline.tune_batches)") from None
    (folder / "profile_run.log").parent.mkdir(parents=True, exist_ok=True)
    (folder / "profile_run.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        why = said[-1].removeprefix("error: ") if said else (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"tuner: the profile run (M={microbatches}, N=1) failed with exit code {done.returncode}: {why}")
    files = sorted(ranks.glob("rank*.json"))
    if len(files) != stages:
        raise RuntimeError(f"tuner: the profile run wrote {len(files)} of {stages} rank records in {ranks}")
    return [json.loads(f.read_text()) for f in files]


def tune(cfg: DictConfig, config: PipelineConfig, out: Path) -> TuneResult:
    """Profile, predict, choose; writes out/tune.json (and the profile runs' folders out/tune_profile,
    with tune_model=calibrated also out/tune_profile_lo)."""
    ms, ns = check(cfg, config)
    stages = depth(cfg, config)
    started = time.perf_counter()
    ranks = run_profile(cfg, config, out / "tune_profile", max(ms), stages)
    profiled = time.perf_counter() - started
    batch = int(cfg.data.batch_size)
    profile = TuneProfile.from_ranks(max(ms), 1, batch, ranks)
    planned = out / "tune_profile" / "plan.json"  # the profiled run's partition: the prediction assumed it
    partition = [stop - start for start, stop in json.loads(planned.read_text())["bounds"]] if planned.exists() else None
    seconds = {"profile_run": profiled}
    profile_lo, predictor = None, None
    if config.tune_model == "calibrated" and min(ms) < max(ms):  # ours: a second point, on the same partition
        started = time.perf_counter()
        ranks = run_profile(cfg, config, out / "tune_profile_lo", min(ms), stages, partition)
        seconds["profile_run_lo"] = time.perf_counter() - started
        profile_lo = TuneProfile.from_ranks(min(ms), 1, batch, ranks)
        predictor = functools.partial(predict_calibrated, profile, profile_lo)
    t0 = time.perf_counter()
    result = choose(profile, ms, ns, config.memory_limit, predictor)
    result.seconds = {**seconds, "predict": time.perf_counter() - t0}
    # the model that predicted: one M in the grid leaves no second point, so Eq. 1-8 predicted it
    result.partition, result.model, result.profile_lo = partition, "calibrated" if profile_lo else "paper", profile_lo
    result.write(out / "tune.json")
    return result


def apply(cfg: DictConfig, stages: int, microbatches: int, pipelines: int, partition: Optional[list[int]] = None) -> None:
    """The job's config with the tuner's choice: K devices shared by N pipelines (N x K with
    share_devices=false), M micro-batches, and the profiled run's partition (what the prediction
    assumed; not planned again)."""
    with open_dict(cfg):
        if partition:
            cfg.pipeline.partition = list(partition)
        cfg.pipeline.tune = False
        cfg.pipeline.microbatches = microbatches
        cfg.pipeline.pipelines = pipelines
        cfg.pipeline.stages = None
        cfg.trainer.devices = stages if cfg.pipeline.get("share_devices", True) else pipelines * stages


def tuned_before(cfg: DictConfig, config: PipelineConfig) -> Optional[tuple[int, int, Optional[list[int]]]]:
    """In a worker the launcher started: the (M, N, partition) its launching process chose (no second tuning)."""
    path = os.environ.get(TUNED_ENV)
    if not path:
        return None
    saved = json.loads(Path(path).read_text())
    return int(saved["chosen"]["microbatches"]), int(saved["chosen"]["pipelines"]), saved.get("partition")
