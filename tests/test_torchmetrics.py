"""torchmetrics Metric objects logged through the pipeline: step and epoch values as in one process.

The metric is updated where the loss is computed (the last stage, once per micro-batch); every rank
must read the same values a one-process run logs: the step value of the whole batch, the epoch's
accumulation, and with replicas or AvgPipe pipelines the state synced over all of them.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from models import START, EpochPerm, LitSeq, dataset, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MaxMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import SpearmanCorrCoef

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.errors import SettingError

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


class LitMetrics(LitSeq):
    """Metrics of each kind of state: summed (accuracy's counts, a sum), max, and concatenated (Spearman)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.train_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="macro")
        self.val_rho = SpearmanCorrCoef()
        self.val_worst = MaxMetric()
        self.val_seen = SumMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.seq(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.seq(x)
        self.val_acc(logits, y)
        self.val_rho(logits[:, 0], y.to(logits.dtype))
        self.val_worst(nn.functional.cross_entropy(logits, y, reduction="none"))
        self.val_seen(torch.full((len(y),), 1.0, dtype=logits.dtype))
        for name in ("val_acc", "val_rho", "val_worst", "val_seen"):
            self.log(name, getattr(self, name))


class Record(Callback):
    """Every rank writes what its loggers and monitors would read: after each step, after validation."""

    def __init__(self, folder):
        self.folder, self.seen = folder, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train_acc")})

    def on_train_epoch_end(self, trainer, pl_module):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k == "train_acc_epoch"})

    def on_validation_end(self, trainer, pl_module):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")})

    def on_fit_end(self, trainer, pl_module):
        torch.save(self.seen, os.path.join(self.folder, f"rank{trainer.global_rank}.pt"))


def run(folder, model, train, val, devices=1, strategy=None, steps=6):
    folder.mkdir(exist_ok=True)
    record = Record(folder)
    kw = dict(devices=devices, callbacks=[record], **trainer_kwargs(max_steps=steps, val_check_interval=2))
    trainer = L.Trainer(strategy=strategy, **kw) if strategy else L.Trainer(**kw)
    trainer.fit(model, train, val)
    return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(devices)]


def assert_same(seen, want, keys=None):
    """Every record holds the reference's values (only `keys`, where given: the others are per replica)."""
    assert len(seen) == len(want)
    compared = 0
    for got, ref in zip(seen, want):
        keys_here = [k for k in ref if keys is None or k in keys]
        assert set(got) >= set(keys_here), (got, ref)
        compared += len(keys_here)
        for k in keys_here:
            assert got[k] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), (k, got, ref)
    assert compared >= 5


@pytest.mark.parametrize("devices,m", [(2, 3), (3, 4)])
def test_metric_objects_log_the_one_process_step_and_epoch_values_on_every_rank(tmp_path, devices, m):
    # batches of 10 in 3 micro-batches (4, 3, 3): the step value is the batch's, not a micro-batch's
    train, val = DataLoader(dataset(n=40), batch_size=10), DataLoader(dataset(n=30, seed=3), batch_size=10)
    (want,) = run(tmp_path / "one", LitMetrics(), train, val)
    assert {"train_acc_step", "train_acc_epoch", "val_acc", "val_rho", "val_worst", "val_seen"} <= {k for s in want for k in s}
    assert [s["val_seen"] for s in want if "val_seen" in s] == [30.0, 30.0, 30.0]  # reset at each validation's end
    strategy = AutoPipeStrategy(microbatches=m, partition="uniform", start_method=START)
    for seen in run(tmp_path, LitMetrics(), train, val, devices, strategy):
        assert_same(seen, want)


def test_metric_state_syncs_over_replicas_like_data_parallel(tmp_path):
    # width 2: each replica updates its shard; the epoch value (compute over both replicas' states) is the
    # one-process value on the global batches, read alike on all 4 ranks
    n, per_replica = 40, 5
    ds = dataset(n=n)
    val = DataLoader(dataset(n=20, seed=3), batch_size=10)
    (want,) = run(tmp_path / "one", LitMetrics(), DataLoader(ds, batch_size=2 * per_replica, sampler=EpochPerm(n)), val)
    strategy = AutoPipeStrategy(microbatches=2, width=2, start_method=START)
    epoch_keys = {"train_acc_epoch", "val_acc", "val_rho", "val_worst", "val_seen"}
    runs = run(tmp_path, LitMetrics(), DataLoader(ds, batch_size=per_replica), DataLoader(dataset(n=20, seed=3), batch_size=5), 4, strategy)
    for seen in runs:
        assert_same(seen, want, epoch_keys)


def test_validation_metrics_over_avgpipe_pipelines_are_the_reference_on_the_whole_set(tmp_path):
    # AvgPipe validates the reference model, each pipeline on its half of the set: the synced metric
    # is the one-process metric of the same weights on all 40 samples
    val = DataLoader(dataset(n=40, seed=3), batch_size=10)
    want = L.Trainer(devices=1, **trainer_kwargs()).validate(LitMetrics(), val)[0]
    strategy = AutoPipeStrategy(microbatches=2, partition="uniform", start_method=START, pipelines=2)
    (got,) = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs()).validate(LitMetrics(), val)  # 2 x 2 processes
    assert want["val_seen"] == 40.0
    for key in ("val_acc", "val_rho", "val_worst", "val_seen"):
        assert got[key] == pytest.approx(want[key], rel=1e-9), key


class Stray(LitSeq):
    """Logs a metric it made in the step (workers unpickle it by name: a module-level class)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        metric = SumMetric()
        metric(self.seq(x).sum())
        self.log("stray", metric)


def test_a_metric_that_is_not_a_module_attribute_is_named():
    strategy = AutoPipeStrategy(microbatches=2, start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs())
    with pytest.raises(Exception, match="must be an attribute of the LightningModule"):
        trainer.validate(Stray(), DataLoader(dataset(n=10), batch_size=10))


def test_a_metric_created_on_the_meta_device_is_named_with_the_fix():
    strategy = AutoPipeStrategy(microbatches=2, partition="uniform", start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs())
    with trainer.init_module(empty_init=True):
        model = LitMetrics()
    with pytest.raises(SettingError, match=r"'train_acc' was created on the meta device.*torch.device\('cpu'\)"):
        trainer.validate(model, DataLoader(dataset(n=10), batch_size=10))
