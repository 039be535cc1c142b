"""The metrics people read (issue 33 item 3): TensorBoard / W&B (offline) / MLflow (file store) logger groups,
throughput and MFU counted once per pipeline, each stage's peak memory and bubble share."""

from __future__ import annotations

import csv
import glob
import json
import struct
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from models import START, LitSeq, dataset, trainer_kwargs
from torch.utils.data import DataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.cli import errors, loggers
from lightning_pipe.cli.paths import CONFIG_DIR
from lightning_pipe.cli.train import _instantiate_all
from lightning_pipe.lightning.metrics import PipelineMetrics, pipeline_rates, stage_summary, tokens
from lightning_pipe.simulation import CostModel, simulate


def csv_rows(path):
    return list(csv.DictReader(open(path)))


def last(rows, key):
    values = [float(r[key]) for r in rows if r.get(key)]
    assert values, f"{key} was never logged"
    return values[-1]


# ---- reading what the loggers wrote ----------------------------------------------------------------------
def wandb_history(path):
    """key -> logged values, read from an offline run's .wandb file (a LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, partial = Path(path).read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):  # full, or the last piece of a record
            records.append(partial)
    history: dict[str, list] = {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                history.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
    return history


def test_a_missing_logger_package_is_one_line_naming_the_setting_and_the_pip_command(monkeypatch):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["logger=[tensorboard,mlflow]"])
    monkeypatch.setattr(loggers, "installed", lambda module: module != "mlflow")
    with pytest.raises(ValueError) as err:
        _instantiate_all(cfg.logger, "logger")  # before anything is resolved or instantiated
    assert errors.describe(err.value) == (
        "logger=mlflow needs the mlflow package: pip install 'lightning-pipe[loggers]' (or pip install mlflow-skinny)"
    )
    # the default group writes TensorBoard logs only when the package happens to be there: no error without it
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config")
    monkeypatch.setattr(loggers, "installed", lambda module: False)
    loggers.check_required(cfg.logger, "logger")
    assert cfg.logger.tensorboard._if_installed_ == "tensorboard"


# ---- throughput, MFU, memory and bubble on a real 2-process pipeline --------------------------------------
class BatchEnds(Callback):
    """Rank 0 notes when each training batch ended (what the throughput is measured against)."""

    def __init__(self, path):
        self.path, self.ends = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.ends))


BATCH, WIDTH, STEPS, WINDOW, PEAK = 128, 1024, 10, 4, 1e9
KEYS = ["train_loss", "train/samples_per_sec", "train/flops_per_sec", "stage0/peak_memory_mb", "stage1/bubble", "bubble"]


def group_loggers(choice, run):
    """The CLI's loggers for `logger=<choice>` (conf/logger), writing under the run folder `run`."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"logger={choice}"], return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(run)
    HydraConfig.instance().set_config(cfg)
    try:
        return _instantiate_all(cfg.logger, "logger")
    finally:
        HydraConfig.instance().cfg = None


def fit(run, microbatches, loggers, start="spawn"):
    model = LitSeq(blocks=8, width=WIDTH, dtype="float32")
    train = DataLoader(dataset(n=BATCH * STEPS, width=WIDTH, dtype=torch.float32), batch_size=BATCH)
    # spawn: wandb's run state must not be inherited by a forked rank 0 (its history then lacks the metrics);
    # a run without wandb forks its ranks from the tests' fork server (START): no fresh interpreters to start
    strategy = AutoPipeStrategy(schedule="gpipe", microbatches=microbatches, partition="uniform", start_method=start, timeout=60)
    callbacks = [BatchEnds(run / "ends.json"), PipelineMetrics(window_size=WINDOW, peak_flops=PEAK)]
    kw = trainer_kwargs(max_steps=STEPS, log_every_n_steps=5, logger=loggers)
    L.Trainer(devices=2, strategy=strategy, callbacks=callbacks, **kw).fit(model, train)
    return csv_rows(run / "logs" / "version_0" / "metrics.csv"), json.loads((run / "ends.json").read_text())


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_flops_are_counted_under_a_split_backward(tmp_path):
    # zero bubble's BI asks autograd for the input gradients only; FlopCounterMode's module hooks made
    # that fail (a leaf passed to the engine inside autograd.grad) in the step the FLOPs were counted
    width = 64
    model = LitSeq(blocks=4, width=width, dtype="float32")
    train = DataLoader(dataset(n=16 * 4, width=width, dtype=torch.float32), batch_size=16)
    strategy = AutoPipeStrategy(schedule="zb-h1", microbatches=4, partition="uniform", start_method=START)
    kw = trainer_kwargs(max_steps=4, log_every_n_steps=2, logger=CSVLogger(tmp_path, name="logs"))
    L.Trainer(devices=2, strategy=strategy, callbacks=[PipelineMetrics(window_size=2, peak_flops=PEAK)], **kw).fit(model, train)
    rows = csv_rows(tmp_path / "logs" / "version_0" / "metrics.csv")
    with torch.device("meta"):
        whole = LitSeq(blocks=4, width=width, dtype="float32")
        x, y = torch.empty(16, width), torch.zeros(16, dtype=torch.long)
    reference = measure_flops(whole, lambda: whole.seq(x), lambda out: torch.nn.functional.cross_entropy(out, y))
    per_batch = last(rows, "train/flops_per_sec") / last(rows, "train/batches_per_sec")
    assert per_batch == pytest.approx(reference, rel=1e-6)  # BI and W together: one backward's matmuls


@pytest.mark.timeout(180)
@pytest.mark.multiprocess
def test_loggers_throughput_memory_and_bubble_on_a_2_stage_pipeline(tmp_path, monkeypatch):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(name, value)  # what the loggers set in this process is undone after the test
    run = tmp_path / "m1"
    group = group_loggers("[tensorboard,wandb,mlflow]", run)  # and csv: the CLI's groups, as `logger=...` builds them
    assert [type(x).__name__ for x in group] == ["CSVLogger", "TensorBoardLogger", "WandbLogger", "MLFlowLogger"]
    try:
        results = {1: fit(run, 1, group)}
    finally:
        wandb.finish()  # the launching process holds the run the spawned rank 0 wrote to
    results[4] = fit(tmp_path / "m4", 4, CSVLogger(tmp_path / "m4", name="logs"), start=START)  # CSV only: no wandb

    # every logger has the metrics, logged once (by global rank 0, from the gathered per-rank numbers)
    rows = results[1][0]
    for key in KEYS:
        steps = [r["step"] for r in rows if r.get(key)]
        assert steps and len(steps) == len(set(steps)), (key, steps)  # at steps 4 and 9 (0-based); once each, not per rank
    (events,) = glob.glob(str(run / "tb" / "*" / "events.out.tfevents.*"))  # one writer
    tb = EventAccumulator(events)
    tb.Reload()
    assert set(KEYS) <= set(tb.Tags()["scalars"])
    assert [e.value for e in tb.Scalars("stage1/bubble")] == pytest.approx(
        [float(r["stage1/bubble"]) for r in rows if r.get("stage1/bubble")]
    )
    (offline,) = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))  # one run, offline, in the run folder
    history = wandb_history(offline)
    assert history["stage0/peak_memory_mb"] == pytest.approx(
        [float(r["stage0/peak_memory_mb"]) for r in rows if r.get("stage0/peak_memory_mb")]
    )
    assert set(KEYS) <= set(history)
    (mlrun,) = [p.parent for p in (run / "mlruns").glob("*/*/meta.yaml")]  # one run, in the file store
    for key in KEYS:
        values = [float(line.split()[1]) for line in (mlrun / "metrics" / key).read_text().splitlines()]  # "<time> <value> <step>"
        assert values == pytest.approx([float(r[key]) for r in rows if r.get(key)]), key

    with torch.device("meta"):
        whole = LitSeq(blocks=8, width=WIDTH, dtype="float32")
        x, y = torch.empty(BATCH, WIDTH), torch.zeros(BATCH, dtype=torch.long)
    reference = measure_flops(whole, lambda: whole.seq(x), lambda out: torch.nn.functional.cross_entropy(out, y))
    for m, (rows, ends) in results.items():
        # samples/s over Lightning's window (the last WINDOW batch ends): batches x batch size / time, not x 2 ranks
        expected = (WINDOW - 1) * BATCH / (ends[-1] - ends[-WINDOW])
        assert last(rows, "train/samples_per_sec") == pytest.approx(expected, rel=0.15), m
        assert last(rows, "train/batches_per_sec") == pytest.approx(expected / BATCH, rel=0.15), m
        # FLOPs per batch: the whole model's (both stages, counted in step 2), as measure_flops counts it in one process
        per_batch = last(rows, "train/flops_per_sec") / last(rows, "train/batches_per_sec")
        assert per_batch == pytest.approx(reference, rel=1e-6), m  # the same matmuls, cut in two
        # MFU: over the world's 2 devices of the given peak
        assert last(rows, "train/device/mfu") == pytest.approx(last(rows, "train/flops_per_sec") / (2 * PEAK), rel=1e-6)
        for stage in (0, 1):
            assert last(rows, f"stage{stage}/peak_memory_mb") > 100  # MB of a process running torch
            assert 0 <= last(rows, f"stage{stage}/bubble") < 1
    # one micro-batch: each rank idles while the other works (the simulator: 1/2); four: (P-1)/(M+P-1) = 1/5 plus
    # what a CPU adds (messages, the host's work between computes, 2 processes sharing 2 cores)
    predicted = {m: simulate_bubble(m) for m in (1, 4)}
    assert predicted == pytest.approx({1: 0.5, 4: 0.2})
    measured = {m: last(rows, "bubble") for m, (rows, _) in results.items()}
    assert measured[1] == pytest.approx(predicted[1], abs=0.15), measured
    assert measured[4] < measured[1] - 0.05, measured


def simulate_bubble(microbatches):
    from lightning_pipe.schedules import build_schedule

    schedule = build_schedule("gpipe", 2, microbatches)
    costs = CostModel.uniform(blocks=2, forward=1.0, backward=2.0)
    return simulate(schedule, costs, [(0, 1), (1, 2)]).bubble_ratio


# ---- the arithmetic, without processes ---------------------------------------------------------------------
def test_rates_are_multiplied_by_the_replicas_not_the_world_size():
    # Throughput(world_size=replicas) of 2 pipelines x 4 stages; Lightning's "device" is one pipeline
    lightning = {"time": 3.0, "batches": 9, "samples": 90, "lengths": 900, "device/batches_per_sec": 2.0, "device/samples_per_sec": 20.0}
    lightning |= {"batches_per_sec": 4.0, "samples_per_sec": 40.0, "device/items_per_sec": 200.0, "items_per_sec": 400.0}
    lightning |= {"flops_per_sec": 8e9, "device/flops_per_sec": 4e9, "device/mfu": 0.1}
    out = pipeline_rates(lightning, replicas=2, depth=4)
    assert out == {
        "time": 3.0,
        "batches": 9,
        "samples": 90,
        "tokens": 900,
        "batches_per_sec": 4.0,
        "samples_per_sec": 40.0,
        "tokens_per_sec": 400.0,
        "flops_per_sec": 8e9,
        "device/flops_per_sec": 1e9,  # 8e9 over the 8 devices
        "device/mfu": 0.1,
    }
    # one pipeline: Lightning leaves out the global rates (world size 1); they are the pipeline's
    one = pipeline_rates({"time": 1.0, "batches": 5, "samples": 50, "device/batches_per_sec": 2.0, "device/samples_per_sec": 20.0}, 1, 2)
    assert one["samples_per_sec"] == 20.0 and one["batches_per_sec"] == 2.0 and "tokens_per_sec" not in one


def test_stage_summary_takes_the_largest_memory_and_the_mean_bubble_over_replicas():
    # [stage, replica, memory, busy, span from the first compute to the last, flops]: a pipeline's step is its longest span
    rows = [[0, 0, 100.0, 3.0, 4.0, -1], [1, 0, 80.0, 1.0, 2.0, -1], [0, 1, 120.0, 2.0, 4.0, -1], [1, 1, 90.0, 1.0, 3.0, -1]]
    out = stage_summary(rows)
    assert out == {
        "stage0/peak_memory_mb": 120.0,
        "stage0/bubble": pytest.approx(0.375),
        "stage1/peak_memory_mb": 90.0,
        "stage1/bubble": pytest.approx(0.75),
        "bubble": pytest.approx(0.5625),
    }


def test_tokens_of_token_id_batches_only():
    assert tokens((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))) == 64
    assert tokens({"input_ids": torch.zeros(2, 8, dtype=torch.int32)}) == 16
    assert tokens((torch.zeros(4, 16), torch.zeros(4))) is None  # features, not tokens
    assert tokens(torch.zeros(4, dtype=torch.long)) is None
