"""Trainer(strategy=AutoPipeStrategy(schedule="2bw")) on real processes against PipeDream-2BW's rule
written out here on one process: batch b's gradient is taken at W(max(b - 1, 0)) and applied to
W(b) by the module's own optimizer and LR scheduler (LitSeq: AdamW, StepLR every 2 steps)."""

from __future__ import annotations

import copy
import glob
import multiprocessing
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from models import START, LitSeq, loader, max_rel_diff, trainer_kwargs
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.lightning.compose import choose_layers
from lightning_pipe.modes.two_bw.lightning import DoubleBufferLayer

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def batches_of(steps, dtype, **kw):
    out = []
    while len(out) < steps:
        out += list(loader(dtype=dtype, **kw))  # no shuffling: every epoch in the same order
    return out[:steps]


def reference_2bw(steps, dtype="float64", clip=None, batches=None):
    """(the module after `steps` 2BW updates, the loss of each batch at the version it ran on); `batches`: the
    (global) batches to train on, else `batches_of`."""
    ref = LitSeq(dtype=dtype)
    conf = ref.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    previous, losses = copy.deepcopy(ref.seq), []
    for b, (x, y) in enumerate(batches[:steps] if batches is not None else batches_of(steps, getattr(torch, dtype))):
        at = previous if b >= 1 else copy.deepcopy(ref.seq)  # W(max(b - 1, 0))
        at.zero_grad()
        loss = nn.functional.cross_entropy(at(x), y)
        loss.backward()
        losses.append(loss.item())
        previous = copy.deepcopy(ref.seq)  # W(b), which batch b + 1 reads
        for p, q in zip(ref.seq.parameters(), at.parameters()):
            p.grad = q.grad.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.seq.parameters(), clip)
        opt.step()
        sched.step()
    return ref, losses


class RecordLoss(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        path = os.path.join(self.folder, f"loss-rank{trainer.global_rank}-step{trainer.global_step}.pt")
        torch.save(float(trainer.callback_metrics["train_loss"]), path)


def fit(model, devices, steps, m, callbacks=(), ckpt_path=None, val=None, train=None, checkpoint="full", **kw):
    strategy = AutoPipeStrategy(schedule="2bw", microbatches=m, partition="uniform", start_method=START, checkpoint=checkpoint)
    trainer = L.Trainer(devices=devices, strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(max_steps=steps, **kw))
    trainer.fit(model, train or loader(dtype=next(model.parameters()).dtype), val, ckpt_path=ckpt_path)
    return trainer


def resumable():
    """The test data in a loader that resumes mid-epoch (Lightning saves and restores its state)."""
    return StatefulDataLoader(loader().dataset, batch_size=10)


# 46 samples in batches of 10: the 5th batch holds 6 (not divisible by m = 4), 7 steps cross an epoch
@pytest.mark.parametrize("devices,m,dtype", [(2, 2, "float64"), (4, 4, "float64"), (2, 4, "float32")])
def test_fit_follows_the_2bw_rule(tmp_path, devices, m, dtype):
    model = LitSeq(dtype=dtype)
    fit(model, devices, 7, m, callbacks=[RecordLoss(tmp_path)])
    ref, losses = reference_2bw(7, dtype)
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= tol
    # the logged train_loss of step b is batch b's loss at the version it ran on, on every rank
    for rank in range(devices):
        logged = [torch.load(os.path.join(tmp_path, f"loss-rank{rank}-step{b + 1}.pt")) for b in range(7)]
        assert logged == pytest.approx(losses, rel=1e-5)


def test_validation_drains_and_clipping_uses_the_global_norm():
    # validation every 3 steps drains the pipeline (applies the batch in flight); the rule is unchanged
    model = LitSeq()
    fit(model, 2, 7, 2, val=loader(), val_check_interval=3, limit_val_batches=2, gradient_clip_val=0.05)
    ref, _ = reference_2bw(7, clip=0.05)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    unclipped, _ = reference_2bw(7)
    assert max_rel_diff(unclipped.state_dict(), model.state_dict()) > 1e-6  # the clipping took effect


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_resume_continues_the_same_trajectory(tmp_path, layout):
    """7 steps in one go equal 3 steps, a checkpoint, and a resume to 7 (bit for bit): the checkpoint
    holds the stashed W(2) that batch 3 reads (a full file, or every rank's stage with DCP)."""
    whole = LitSeq()
    fit(whole, 2, 7, 2, train=resumable())
    first = LitSeq()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    fit(first, 2, 3, 2, callbacks=[saver], enable_checkpointing=True, train=resumable(), checkpoint=layout)
    (path,) = glob.glob(os.path.join(tmp_path, "*step=3.ckpt"))
    if layout == "full":
        state = torch.load(path, weights_only=False)["optimizer_states"][0]
        assert state["autopipe_2bw_applied"] == 3
        assert all("autopipe_2bw_previous" in s for s in state["state"].values())
    resumed = LitSeq(seed=5)
    fit(resumed, 2, 7, 2, ckpt_path=path, train=resumable(), checkpoint=layout)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    ref, _ = reference_2bw(7)
    assert max_rel_diff(ref.state_dict(), resumed.state_dict()) <= 1e-10


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_width_2_follows_the_rule_on_the_global_batch(shard):
    """Two replicas of a 2-stage pipeline (4 ranks), each stage all-reducing its gradients (shard="optimizer":
    each parameter stepped by one replica, ZeRO-1). Lightning's
    DistributedSampler (shuffle, seed 0) gives replica r the indices perm[r::2]; batch k of each replica
    holds 5 of them, so together a step sees perm[10k : 10k + 10]: the single-process global batch."""
    n = 40
    ds = loader(n=n).dataset

    class Perm(torch.utils.data.Sampler):
        def __init__(self):
            self.epoch = 0

        def __iter__(self):
            g = torch.Generator().manual_seed(self.epoch)
            self.epoch += 1
            return iter(torch.randperm(n, generator=g).tolist())

        def __len__(self):
            return n

    model = LitSeq()
    strategy = AutoPipeStrategy(schedule="2bw", microbatches=2, width=2, shard=shard, partition="uniform", start_method=START)
    trainer = L.Trainer(devices=4, strategy=strategy, **trainer_kwargs(max_steps=6))
    trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=5))
    ref = LitSeq()
    conf = ref.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    sampler, global_batches = Perm(), []
    while len(global_batches) < 6:
        global_batches += list(torch.utils.data.DataLoader(ds, batch_size=10, sampler=sampler))
    previous = copy.deepcopy(ref.seq)
    for b, (x, y) in enumerate(global_batches[:6]):
        at = previous if b >= 1 else copy.deepcopy(ref.seq)
        at.zero_grad()
        nn.functional.cross_entropy(at(x), y).backward()  # the replicas' mean of their 5-sample means
        previous = copy.deepcopy(ref.seq)
        for p, q in zip(ref.seq.parameters(), at.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        sched.step()
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


@pytest.mark.parametrize(
    "strategy_kwargs,trainer_kw,match",
    [
        (dict(microbatches=2), dict(accumulate_grad_batches=2), r"accumulate_grad_batches=2: schedule='2bw' applies one update"),
        (dict(microbatches=2, precision_plugin=MixedPrecision("16-mixed", "cpu")), {}, r"precision='16-mixed': schedule='2bw'"),
        (dict(microbatches=1), {}, r"microbatches=1 is fewer than the 2 stages: PipeDream-2BW needs m >= stages"),
        (dict(microbatches=2, slicer=True), {}, r"slicer=True works with schedule='gpipe' or '1f1b', not '2bw'"),
    ],
)
def test_what_2bw_cannot_honour_fails_before_spawning(strategy_kwargs, trainer_kw, match):
    def attempt():
        strategy = AutoPipeStrategy(schedule="2bw", start_method=START, **strategy_kwargs)
        trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(**trainer_kw))
        trainer.fit(LitSeq(), loader())

    with pytest.raises(ValueError, match=match):
        attempt()
    assert not multiprocessing.active_children()


def test_flush_is_1f1b():
    assert AutoPipeStrategy(schedule="flush").config.schedule == "1f1b"
    assert choose_layers(AutoPipeStrategy(schedule="2bw").config).versions is DoubleBufferLayer
