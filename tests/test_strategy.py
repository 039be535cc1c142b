"""Trainer(strategy="autopipe") on real processes (spawn, gloo, CPU) against single-process Lightning."""

from __future__ import annotations

import glob
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import START, EpochPerm, LitSeq, dataset, loader, max_rel_diff, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader

import lightning_pipe  # noqa: F401  (registers "autopipe")
from lightning_pipe import AutoPipeStrategy

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


class RecordMetrics(Callback):
    """Each rank writes the metrics it sees (what its progress bar, loggers and monitors would read)."""

    def __init__(self, folder):
        self.folder = folder

    def _dump(self, trainer, name):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save(metrics, os.path.join(self.folder, f"{name}-rank{trainer.global_rank}.pt"))

    def on_train_end(self, trainer, pl_module):
        self._dump(trainer, "fit")

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._dump(trainer, "val")


def rank_metrics(folder, name, world):
    return [torch.load(os.path.join(folder, f"{name}-rank{r}.pt")) for r in range(world)]


def single(model, steps=4, train=None, val=None, **kw):
    trainer = L.Trainer(devices=1, **trainer_kwargs(max_steps=steps, **kw))
    trainer.fit(model, train or loader(), val)
    return trainer


def pipelined(model, devices, steps=4, train=None, val=None, callbacks=(), strategy=None, **kw):
    strategy = strategy or AutoPipeStrategy(start_method=START)
    trainer = L.Trainer(devices=devices, strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(max_steps=steps, **kw))
    trainer.fit(model, train or loader(), val)
    return trainer


CASES = [
    ("gpipe", 2, "uniform", 3, "float64"),
    ("1f1b", 2, [2, 4], 4, "float64"),
    ("1f1b", 4, "uniform", 3, "float64"),
    ("gpipe", 4, [3, 1, 1, 1], 4, "float64"),
    ("1f1b", 2, "uniform", 3, "float32"),
]


@pytest.mark.parametrize("schedule,devices,partition,m,dtype", CASES)
def test_fit_equals_single_process(tmp_path, schedule, devices, partition, m, dtype):
    # 46 samples in batches of 10: the 5th batch is short (6), and 6 steps cross into a second epoch.
    tdtype = getattr(torch, dtype)
    ref = LitSeq(dtype=dtype)
    single(ref, steps=6, train=loader(dtype=tdtype), val=loader(dtype=tdtype))
    model = LitSeq(dtype=dtype)
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=m, partition=partition, start_method=START)
    pipelined(
        model,
        devices,
        steps=6,
        train=loader(dtype=tdtype),
        val=loader(dtype=tdtype),
        callbacks=[RecordMetrics(tmp_path)],
        strategy=strategy,
    )
    assert isinstance(model.seq, nn.Sequential), "the trained full model comes back to the launching process"
    tol = 1e-10 if dtype == "float64" else 1e-5
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= tol
    # the loss and val loss of the last step are on every rank, equal to single-process values
    ref_trainer_metrics = single(LitSeq(dtype=dtype), steps=6, train=loader(dtype=tdtype), val=loader(dtype=tdtype)).callback_metrics
    for metrics in rank_metrics(tmp_path, "fit", devices):
        assert metrics["train_loss"] == pytest.approx(float(ref_trainer_metrics["train_loss"]), rel=1e-5)
        assert metrics["val_loss"] == pytest.approx(float(ref_trainer_metrics["val_loss"]), rel=1e-5)


def test_gradient_accumulation_and_global_norm_clipping(tmp_path):
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    ref = LitSeq()
    single(ref, steps=3, **kw)
    model = LitSeq()
    pipelined(model, 2, steps=3, strategy=AutoPipeStrategy(microbatches=3, partition=[4, 2], start_method=START), **kw)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    # the clip was active: without it the weights differ
    unclipped = LitSeq()
    single(unclipped, steps=3, accumulate_grad_batches=2)
    assert max_rel_diff(ref.state_dict(), unclipped.state_dict()) > 1e-3


def test_width_2_depth_2_equals_single_process_on_the_global_batch():
    # DistributedSampler (shuffle, seed 0) gives replica r the indices perm[r::2]; batch k of each replica
    # holds 5 of them, so together a step sees perm[10k : 10k + 10]: the single-process global batch.
    n, per_replica = 40, 5
    ds = dataset(n=n)
    ref = LitSeq()
    single(ref, steps=6, train=DataLoader(ds, batch_size=2 * per_replica, sampler=EpochPerm(n)))
    model = LitSeq()
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=2, width=2, start_method=START)
    pipelined(model, 4, steps=6, train=DataLoader(ds, batch_size=per_replica), strategy=strategy)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


def test_tuple_activation_with_integer_mask():
    kw = dict(masked=True)
    ref = LitSeq(**kw)
    single(ref, train=loader(masked=True))
    model = LitSeq(**kw)
    pipelined(model, 2, train=loader(masked=True), strategy=AutoPipeStrategy(partition=[2, 3], microbatches=3, start_method=START))
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


@pytest.mark.parametrize("devices,partition", [(2, [2, 3]), (3, [1, 3, 1])])
def test_tied_embedding_across_first_and_last_stage(tmp_path, devices, partition):
    kw = dict(gradient_clip_val=0.05)  # active clipping: the tied gradient must count once in the global norm
    ref = LitSeq(tied=True)
    assert ref.seq[0].emb.weight is ref.seq[-1].weight
    single(ref, train=loader(tied=True), **kw)
    model = LitSeq(tied=True)
    pipelined(
        model,
        devices,
        train=loader(tied=True),
        strategy=AutoPipeStrategy(partition=partition, microbatches=3, start_method=START),
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4)],
        **kw,
    )
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    # both stages' copies took the same update: the checkpoint's two keys hold one value
    ckpt = torch.load(glob.glob(str(tmp_path / "*.ckpt"))[0], weights_only=False)["state_dict"]
    assert torch.equal(ckpt["seq.0.emb.weight"], ckpt[f"seq.{len(ref.seq) - 1}.weight"])


def test_checkpoint_loads_in_single_process_and_resume_is_bit_exact(tmp_path):
    ckpts = tmp_path / "ckpt"
    # 4 batches an epoch, a checkpoint every 4 steps: Lightning resumes a plain DataLoader exactly there
    data = dict(n=40)
    model = LitSeq()
    trainer = pipelined(
        model,
        2,
        steps=8,
        train=loader(**data),
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=4, save_top_k=-1)],
        strategy=AutoPipeStrategy(microbatches=3, start_method=START),
    )
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")  # from the launching process, after the fit
    after = LitSeq.load_from_checkpoint(tmp_path / "after_fit.ckpt")
    assert max_rel_diff(model.state_dict(), after.state_dict()) == 0.0
    files = sorted(glob.glob(str(ckpts / "*.ckpt")))
    assert [os.path.basename(f) for f in files] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    # a plain single-process load of the last checkpoint holds the trained full model
    loaded = LitSeq.load_from_checkpoint(files[-1])
    assert isinstance(loaded.seq, nn.Sequential)
    assert max_rel_diff(model.state_dict(), loaded.state_dict()) == 0.0
    # ... which is also the single-process result
    ref = LitSeq()
    single(ref, steps=8, train=loader(**data))
    assert max_rel_diff(ref.state_dict(), loaded.state_dict()) <= 1e-10
    # resuming from step 4 with the same topology continues bit for bit (weights, AdamW state, LR schedule)
    resumed = LitSeq(seed=123)  # other initial weights: everything must come from the checkpoint
    trainer = L.Trainer(devices=2, strategy=AutoPipeStrategy(microbatches=3, start_method=START), **trainer_kwargs(max_steps=8))
    trainer.fit(resumed, loader(**data), ckpt_path=files[0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


class RecordPredictions(Callback):
    """Each rank writes the predict_step outputs it sees (spawned workers cannot return them)."""

    def __init__(self, folder):
        self.folder, self.outputs = folder, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        torch.save(self.outputs, os.path.join(self.folder, f"pred-rank{trainer.global_rank}.pt"))


def test_validate_test_and_predict_run_forward_only_pipelines(tmp_path):
    ref, model = LitSeq(), LitSeq()
    val_ref = L.Trainer(devices=1, **trainer_kwargs()).validate(ref, loader(batch_size=7), verbose=False)
    trainer = L.Trainer(
        devices=2,
        strategy=AutoPipeStrategy(microbatches=3, start_method=START),
        callbacks=[RecordPredictions(tmp_path)],
        **trainer_kwargs(),
    )
    # batches of 7 and a last one of 4: micro-batch sizes 3/2/2 and 2/1/1
    val = trainer.validate(model, loader(batch_size=7), verbose=False)
    assert val[0]["val_loss"] == pytest.approx(val_ref[0]["val_loss"], rel=1e-12)
    test = trainer.test(model, loader(batch_size=7), verbose=False)
    assert test[0]["test_loss"] == pytest.approx(val_ref[0]["val_loss"], rel=1e-12)
    trainer.predict(model, loader(batch_size=7), return_predictions=False)
    ref_preds = L.Trainer(devices=1, **trainer_kwargs()).predict(ref, loader(batch_size=7))
    for rank in range(2):  # the predictions of the last stage reach every rank
        preds = torch.load(tmp_path / f"pred-rank{rank}.pt")
        assert len(preds) == len(ref_preds)
        for p, r in zip(preds, ref_preds):
            assert torch.allclose(p, r, rtol=1e-12, atol=0)


class RecordDtype(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        dtype = str(next(pl_module.parameters()).dtype)
        torch.save(dtype, os.path.join(self.folder, f"dtype-rank{trainer.global_rank}.pt"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "64-true"])
def test_precision_plugins_apply_inside_the_schedule(tmp_path, precision):
    ref = LitSeq(dtype="float32")
    single(ref, train=loader(dtype=torch.float32), precision=precision)
    model = LitSeq(dtype="float32")
    pipelined(
        model,
        2,
        train=loader(dtype=torch.float32),
        precision=precision,
        callbacks=[RecordDtype(tmp_path)],
        strategy=AutoPipeStrategy(microbatches=2, start_method=START),
    )
    dtypes = [torch.load(tmp_path / f"dtype-rank{r}.pt") for r in range(2)]
    err = max_rel_diff(ref.state_dict(), model.state_dict())
    if precision == "64-true":
        assert dtypes == ["torch.float64"] * 2
        assert err <= 1e-7  # trained in float64; the launching process's module keeps float32 storage
        return
    assert dtypes == ["torch.float32"] * 2
    # bf16 autocast: the pipeline must land near the single-process bf16 run and clearly away from
    # a float32 run (which it would match if autocast were not applied inside the schedule)
    full = LitSeq(dtype="float32")
    single(full, train=loader(dtype=torch.float32))
    assert err < 0.2 * max_rel_diff(ref.state_dict(), full.state_dict()), err


@pytest.mark.parametrize("devices,sliced,method", [(2, 1, "algorithm2"), (4, 2, "algorithm2"), (4, 2, "sweep")])
def test_slicer_equals_single_process_and_writes_the_plan(tmp_path, devices, sliced, method):
    ref = LitSeq()
    single(ref, steps=4)
    model = LitSeq()
    # planned on the link model alone: with measured message terms a receive's fixed thread time can cover
    # the whole start-up (CI measured 447 us per receive once, start-up 0.45 -> 0.45 ms), so whether halves
    # shorten it would depend on the machine's noise; test_slicer_algorithm2 checks the slicer weighs those terms
    strategy = AutoPipeStrategy(
        partition="autopipe", slicer=sliced, slicer_method=method, microbatches=4, trace=True, message_costs=False, start_method=START
    )
    pipelined(model, devices, steps=4, strategy=strategy, default_root_dir=tmp_path)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    import json

    summary = json.loads((tmp_path / "plan.json").read_text())
    assert summary["slicer"]["startup"] < summary["slicer"]["baseline_startup"]
    assert sum(b - a for a, b in summary["bounds"]) == len(ref.seq) and len(summary["bounds"]) == devices
    assert summary["plan"]["method"] == "autopipe"
    # the memory model's prediction per rank, the process's measured runtime included (a real process holds > 50 MiB)
    memory = summary["predicted_memory_bytes"]
    assert len(memory["per_rank"]) == devices and memory["runtime_bytes"] > 50 * 2**20
    assert all(m > memory["runtime_bytes"] for m in memory["per_rank"])
    assert (tmp_path / "plan_timeline.png").exists() and (tmp_path / "profile.json").exists()
    # the run really executed the halves: (4 + sliced) forwards and backwards per rank, and the plan
    # written says as many halves as the ranks ran (one more forward for each halved micro-batch)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    computes = [e for e in events if e.get("cat") == "compute"]
    assert len(computes) == devices * (4 + sliced) * 2
    forwards = [e for e in computes if e["pid"] == 0 and e["name"].startswith("F")]
    assert len(forwards) - 4 == summary["slicer"]["sliced"]
    assert summary["slicer"]["method"] == method
    # the form that ran, on the last rank's first step: AutoPipe's sliced 1F1B runs micro-batch 0's halves
    # back to back (F F B B); the sweep (ours) runs them as 1F1B's micro-batches (F B F B)
    last = sorted((e for e in computes if e["pid"] == devices - 1), key=lambda e: e["ts"])
    assert [e["name"][0] for e in last[:4]] == (list("FFBB") if method == "algorithm2" else list("FBFB"))
    if devices == 4:  # the paper's merge on stage p - 1 - q = 2 for q = 1: half 2's send waits and leaves with half 3's
        rank2 = [e["name"] for e in sorted((e for e in events if e.get("pid") == 2 and e.get("ph") == "X"), key=lambda e: e["ts"])]
        after_f2 = rank2[rank2.index("F2") + 1 : rank2.index("F2") + 4]
        assert after_f2 == ["F3", "SEND_F2", "SEND_F3"] if method == "algorithm2" else after_f2[0] == "SEND_F2", rank2[:12]


def test_trace_writes_a_measured_timeline(tmp_path):
    model = LitSeq()
    strategy = AutoPipeStrategy(partition="uniform", microbatches=3, trace=True, start_method=START)
    pipelined(model, 2, steps=2, strategy=strategy, default_root_dir=tmp_path)
    import json

    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    computes = [e for e in events if e.get("cat") == "compute"]
    assert len(computes) == 2 * 3 * 2 and {e["pid"] for e in computes} == {0, 1}
    assert (tmp_path / "trace_timeline.png").exists()


def test_resume_reuses_the_checkpoints_partition(tmp_path):
    # a checkpoint written with an explicit uneven partition resumes under partition="autopipe":
    # the stored partition wins over a new plan, so the optimizer states fit
    ckpts = tmp_path / "ckpt"
    pipelined(
        LitSeq(),
        2,
        steps=4,
        train=loader(n=40),
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=4)],
        strategy=AutoPipeStrategy(partition=[1, 5], microbatches=3, start_method=START),
    )
    ckpt = glob.glob(str(ckpts / "*.ckpt"))[0]
    assert torch.load(ckpt, weights_only=False)["optimizer_states"][0]["autopipe_bounds"] == [[0, 1], [1, 6]]
    resumed = LitSeq()
    trainer = L.Trainer(devices=2, strategy=AutoPipeStrategy(microbatches=3, start_method=START), **trainer_kwargs(max_steps=8))
    trainer.fit(resumed, loader(n=40), ckpt_path=ckpt)
    ref = LitSeq()
    single(ref, steps=8, train=loader(n=40))
    assert max_rel_diff(ref.state_dict(), resumed.state_dict()) <= 1e-10


def test_auto_resume_keeps_the_checkpoints_schedule(tmp_path):
    # equal blocks: "auto" picks interleaved v=2 on 2 ranks x 4 micro-batches; the resumed run is
    # given a memory limit that only 1F1B would meet, and must still continue the checkpoint's
    # interleaved schedule and partition, exactly
    from lightning_pipe.profiling import Profile

    profile = str(Profile.synthetic([1e-3] * 6, activation_bytes=1e6).save(tmp_path / "profile.json"))
    ckpts = tmp_path / "ckpt"
    first = AutoPipeStrategy(schedule="auto", microbatches=4, profile=profile, start_method=START)
    pipelined(
        LitSeq(),
        2,
        steps=4,
        train=loader(n=40),
        enable_checkpointing=True,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=4)],
        strategy=first,
    )
    ckpt = glob.glob(str(ckpts / "*.ckpt"))[0]
    state = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert state["autopipe_schedule"] == ["interleaved", {"chunks": 2}] and len(state["autopipe_bounds"]) == 4
    resumed = LitSeq()
    again = AutoPipeStrategy(schedule="auto", microbatches=4, profile=profile, memory_limit=6.2 * 2**20, start_method=START)
    trainer = L.Trainer(devices=2, strategy=again, **trainer_kwargs(max_steps=8))
    trainer.fit(resumed, loader(n=40), ckpt_path=ckpt)
    ref = LitSeq()
    single(ref, steps=8, train=loader(n=40))
    assert max_rel_diff(ref.state_dict(), resumed.state_dict()) <= 1e-10


def test_fit_freezes_setups_objects_out_of_the_collector_and_releases_them_after():
    # a full collection over setup's objects took 0.2-0.3 s mid-step: fit runs with them frozen
    import gc

    from lightning.pytorch.callbacks import Callback

    seen = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(gc.get_freeze_count())

    strategy = AutoPipeStrategy(microbatches=2, partition="uniform")
    L.Trainer(devices=1, strategy=strategy, callbacks=[Probe()], **trainer_kwargs(max_steps=2)).fit(LitSeq(), loader())
    assert len(seen) == 2 and min(seen) > 1000 and gc.get_freeze_count() == 0
    # one process in the user's own: its group is closed at teardown (a later fork would inherit it)
    assert not torch.distributed.is_initialized()
