"""AvgPipe (elastic averaging of parallel pipelines, with reference processes) on real processes.

The single-process simulation here is written from the paper's §3.2, not from the code: N models
with their own optimizers and LR schedulers, pipeline n reading shard n of the data (torch's
DistributedSampler, as Lightning shards it), and after each step t

    Δ_n = the optimizer's change,  W_n <- (1 - α) W_n(t) + α W_ref(max(t - s, 0)) + Δ_n,
    W_ref(t + 1) = W_ref(t) + mean_n Δ_n.
"""

from __future__ import annotations

import copy
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import START, LitSeq, dataset, max_rel_diff, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.errors import SettingError

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]
JOB = Path(__file__).resolve().parent / "avgpipe_fault_job.py"


def shard_batches(n, pipelines, steps, dtype):
    """Pipeline n's batches: Lightning shards a training loader over the pipelines with torch's
    DistributedSampler (shuffled with PL_GLOBAL_SEED, re-seeded per epoch), as for DDP."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    sampler = DistributedSampler(dataset(dtype=dtype), num_replicas=pipelines, rank=n, shuffle=True, seed=seed)
    out, epoch = [], 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        out += list(DataLoader(dataset(dtype=dtype), batch_size=10, sampler=sampler))
        epoch += 1
    return out[:steps]


def simulate(steps, pipelines, alpha, staleness, dtype="float64", versions="flush"):
    """(parallel models' state dicts, the reference's state dict) after `steps` iterations.
    versions="2bw": AvgPipe(2BW) from the two papers: pipeline n's gradient of iteration t is taken at
    its own W_n(max(t - 1, 0)) (PipeDream-2BW, §3.1) and its optimizer applies it to W_n(t), giving
    Δ_n(t); the pull and the reference update are AvgPipe's (§3.2), unchanged."""
    models = [LitSeq(dtype=dtype) for _ in range(pipelines)]  # one seed: the same start
    confs = [m.configure_optimizers() for m in models]
    data = [shard_batches(n, pipelines, steps, getattr(torch, dtype)) for n in range(pipelines)]
    previous = [copy.deepcopy(m.seq) for m in models]  # 2BW: W_n(t - 1), which batch t reads
    names = [k for k, _ in models[0].named_parameters()]
    refs = [{k: v.detach().clone() for k, v in models[0].named_parameters()}]  # refs[j] = W_ref(j)
    for t in range(steps):
        deltas = []
        for n, (model, conf) in enumerate(zip(models, confs)):
            at = previous[n] if versions == "2bw" and t >= 1 else model.seq
            x, y = data[n][t]
            at.zero_grad()
            nn.functional.cross_entropy(at(x), y).backward()
            if versions == "2bw":
                previous[n] = copy.deepcopy(model.seq)  # W_n(t), after iteration t - 1's pull
                for p, q in zip(model.seq.parameters(), at.parameters()):
                    p.grad = q.grad.clone()
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            conf["optimizer"].step()
            conf["lr_scheduler"]["scheduler"].step()
            delta = {k: v.detach() - before[k] for k, v in model.named_parameters()}
            pull = refs[max(t - staleness, 0)]
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_((1 - alpha) * before[k] + alpha * pull[k] + delta[k])
            deltas.append(delta)
        refs.append({k: refs[t][k] + sum(d[k] for d in deltas) / pipelines for k in names})
    return [m.state_dict() for m in models], {k: v for k, v in refs[steps].items()}


def fit(
    model,
    steps,
    pipelines=2,
    devices=2,  # shared by the pipelines (the paper's layout): 2 pipelines x 2 stages
    alpha=None,
    staleness=0,
    ckpt_path=None,
    callbacks=(),
    train=None,
    val=None,
    checkpoint="full",
    schedule="1f1b",
    advance_num=None,
    **kw,
):
    strategy = AutoPipeStrategy(
        schedule=schedule,
        advance_num=advance_num,
        microbatches=2,
        partition="uniform",
        start_method=START,
        pipelines=pipelines,
        alpha=alpha,
        staleness=staleness,
        checkpoint=checkpoint,
    )
    trainer = L.Trainer(devices=devices, strategy=strategy, callbacks=list(callbacks), **trainer_kwargs(max_steps=steps, **kw))
    trainer.fit(model, train or DataLoader(dataset(dtype=next(model.parameters()).dtype), batch_size=10), val, ckpt_path=ckpt_path)
    return trainer


def saved(tmp_path, steps):
    return ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=steps, save_top_k=-1)


def parallel_models(path):
    """Each pipeline's weights from a checkpoint (the entries AvgPipe adds per parameter)."""
    state = torch.load(path, weights_only=False)
    named = state["optimizer_states"][0]
    aliases = named["autopipe_aliases"]
    out = None
    for key in state["state_dict"]:
        name = aliases.get(key, key)
        pipelines = named["state"][name]["autopipe_avg_pipelines"]
        out = out or [{} for _ in pipelines]
        for n, entry in enumerate(pipelines):
            out[n][key] = entry["weight"]
    return state["state_dict"], out


def rule_run(folder, alpha, staleness, schedule):
    """2 pipelines x 2 stages, 7 iterations over 23-sample shards (batches 10, 10, 3: not divisible by
    m), validation every 3 steps, a checkpoint after every step in `folder`; the model fit hands back."""
    model = LitSeq()
    val = DataLoader(dataset(seed=3), batch_size=10)
    fit(
        model,
        7,
        alpha=alpha,
        staleness=staleness,
        callbacks=[saved(folder, 1)],
        enable_checkpointing=True,
        val=val,
        val_check_interval=3,
        schedule=schedule,
    )
    return model


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """AvgPipe(1F1B) with the default α = 0.5, s = 0 (`rule_run`), run once for the tests that read it:
    the rule at step 7, the mean of the parallel models at step 5, the plain module loading step 3
    (each was a run of its own; the rule test shows that validation leaves every trajectory as it is)."""
    folder = tmp_path_factory.mktemp("avgpipe_default")
    here = os.getcwd()
    os.chdir(folder)  # what the per-test working directory is for (tests/conftest.py)
    try:
        return rule_run(folder, None, 0, "1f1b"), folder
    finally:
        os.chdir(here)


@pytest.mark.parametrize("alpha,staleness,schedule", [(None, 0, "1f1b"), (0.3, 1, "advance")])
def test_parallel_and_reference_weights_follow_the_rule(request, tmp_path, alpha, staleness, schedule):
    # 2 pipelines x 2 stages, 7 iterations over 23-sample shards (batches 10, 10, 3: not divisible by m)
    # validation every 3 steps evaluates the reference and must leave every trajectory unchanged;
    # "advance": AvgPipe's advance forward propagation with its adaptive rule inside the pipelines
    if alpha is None:  # the defaults: the module's run of them
        model, tmp_path = request.getfixturevalue("default_run")
    else:
        model = rule_run(tmp_path, alpha, staleness, schedule)
    want_parallel, want_ref = simulate(7, 2, 0.5 if alpha is None else alpha, staleness)
    (path,) = glob.glob(os.path.join(tmp_path, "*step=7.ckpt"))
    reference, parallel = parallel_models(path)
    assert max_rel_diff(want_ref, reference) <= 1e-10
    assert max_rel_diff(want_ref, model.state_dict()) <= 1e-10  # fit hands back the reference model
    for n in range(2):
        assert max_rel_diff(want_parallel[n], parallel[n]) <= 1e-10
    assert max_rel_diff(parallel[0], parallel[1]) > 1e-4  # the pipelines trained on different data
    if schedule == "advance":  # the rule's state is in the checkpoint, the same for every pipeline (one list)
        rule = torch.load(path, weights_only=False)["optimizer_states"][0]["autopipe_advance"]
        # K = 2, M = 2: after the 3 warm-up steps the first measured step raises 1F1B's 1 to M = 2 (no
        # step before it to be slower than) and the next settles there (nothing above M), whatever the times
        assert [a for a, _ in rule["history"]] == [1, 2] and (rule["advance_num"], rule["settled"]) == (2, True)


@pytest.mark.parametrize("alpha,staleness,advance_num", [(None, 0, None), (0.3, 1, 2)])
def test_avgpipe_2bw_follows_both_papers_rules(tmp_path, alpha, staleness, advance_num):
    # AvgPipe(2BW): each pipeline runs 2BW (no flush, 1-stale gradients); validation every 3 steps
    # drains the batch in flight, and the drain's update must get its elastic pull like any other.
    # advance_num=2 on 2 stages: every forward of a batch before its backwards, still without a flush
    model = LitSeq()
    val = DataLoader(dataset(seed=3), batch_size=10)
    fit(
        model,
        7,
        alpha=alpha,
        staleness=staleness,
        callbacks=[saved(tmp_path, 7)],
        enable_checkpointing=True,
        val=val,
        val_check_interval=3,
        schedule="2bw",
        advance_num=advance_num,
    )
    alpha = 0.5 if alpha is None else alpha
    want_parallel, want_ref = simulate(7, 2, alpha, staleness, versions="2bw")
    (path,) = glob.glob(os.path.join(tmp_path, "*step=7.ckpt"))
    reference, parallel = parallel_models(path)
    assert max_rel_diff(want_ref, reference) <= 1e-10
    assert max_rel_diff(want_ref, model.state_dict()) <= 1e-10
    for n in range(2):
        assert max_rel_diff(want_parallel[n], parallel[n]) <= 1e-10
    flush_parallel, _ = simulate(7, 2, alpha, staleness)
    assert max_rel_diff(flush_parallel[0], parallel[0]) > 1e-6  # 2BW's stale gradients are not AvgPipe(1F1B)'s


def test_the_reference_stays_the_mean_of_the_parallel_models(default_run):
    # s = 0 and a common start: the pull keeps the mean, the Δ's move mean and reference alike
    _, folder = default_run
    reference, parallel = parallel_models(glob.glob(os.path.join(folder, "*step=5.ckpt"))[0])
    mean = {k: (parallel[0][k] + parallel[1][k]) / 2 for k in reference}
    assert max_rel_diff(mean, reference) <= 1e-12
    assert max_rel_diff(parallel[0], reference) > 1e-4


def test_one_pipeline_without_pull_is_plain_pipeline_training(tmp_path):
    plain = LitSeq()
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=2, partition="uniform", start_method=START)
    L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=6)).fit(plain, DataLoader(dataset(), batch_size=10))
    elastic = LitSeq()
    fit(elastic, 6, pipelines=1, devices=2, alpha=0.0, callbacks=[saved(tmp_path, 6)], enable_checkpointing=True)
    reference, (parallel,) = parallel_models(glob.glob(os.path.join(tmp_path, "*step=6.ckpt"))[0])
    for k, v in plain.state_dict().items():
        assert torch.equal(v, parallel[k]), k  # the one parallel model is the plain pipeline's, bit for bit
    # the reference sums the same updates (W_ref + Δ), so it equals them up to rounding
    assert max_rel_diff(plain.state_dict(), reference) <= 1e-12
    assert max_rel_diff(plain.state_dict(), elastic.state_dict()) <= 1e-12


def resumable():
    return StatefulDataLoader(dataset(), batch_size=10)


@pytest.fixture(scope="module")
def whole_runs(tmp_path_factory):
    """schedule -> (the state dict after 7 uninterrupted steps, s = 1, the folder of its full-layout
    checkpoint after every step): one run per schedule for the module, which both 1f1b layouts read."""
    runs = {}

    def whole(schedule):
        if schedule not in runs:
            folder = tmp_path_factory.mktemp(f"avgpipe_whole_{schedule}")
            here = os.getcwd()
            os.chdir(folder)
            try:
                model = LitSeq()
                fit(model, 7, callbacks=[saved(folder, 1)], train=resumable(), staleness=1, schedule=schedule, enable_checkpointing=True)
            finally:
                os.chdir(here)
            runs[schedule] = model.state_dict(), folder
        return runs[schedule]

    return whole


# 2bw: AvgPipe(2BW), each pipeline's own stash W_n(t - 1) in the checkpoint comes back to its pipeline
@pytest.mark.parametrize("layout,schedule", [("full", "1f1b"), ("sharded", "1f1b"), ("full", "2bw")])
def test_resume_continues_every_parallel_model(tmp_path, whole_runs, layout, schedule):
    common = dict(staleness=1, schedule=schedule, enable_checkpointing=True)
    whole_state, whole_folder = whole_runs(schedule)
    # step 2 is mid-epoch (3 batches per pipeline and epoch): Lightning resumes the shard where it stopped.
    # The full layout's step-2 checkpoint is the whole run's own (written after step 2 as a run stopping
    # there writes it, before the next step); the sharded one comes from a 2-step run in that layout
    if layout == "full":
        (path,) = glob.glob(os.path.join(whole_folder, "*step=2.ckpt"))
    else:
        fit(LitSeq(), 2, callbacks=[saved(tmp_path / "first", 2)], train=resumable(), checkpoint=layout, **common)
        (path,) = glob.glob(os.path.join(tmp_path, "first", "*step=2.ckpt"))
    resumed = LitSeq(seed=5)
    fit(resumed, 7, ckpt_path=path, callbacks=[saved(tmp_path / "resumed", 7)], train=resumable(), **common)  # reads either layout
    for k, v in whole_state.items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    (a,) = glob.glob(os.path.join(whole_folder, "*step=7.ckpt"))
    (b,) = glob.glob(os.path.join(tmp_path, "resumed", "*step=7.ckpt"))
    for x, y in zip(parallel_models(a)[1], parallel_models(b)[1]):
        for k in x:
            assert torch.equal(x[k], y[k]), k
    _, want = simulate(7, 2, 0.5, 1, versions="2bw" if schedule == "2bw" else "flush")
    assert max_rel_diff(want, resumed.state_dict()) <= 1e-10


def test_the_checkpoint_loads_into_the_plain_module(default_run):
    _, folder = default_run
    (path,) = glob.glob(os.path.join(folder, "*step=3.ckpt"))
    plain = LitSeq.load_from_checkpoint(path)
    _, want = simulate(3, 2, 0.5, 0)
    assert max_rel_diff(want, {k: v for k, v in plain.state_dict().items()}) <= 1e-10


@pytest.mark.parametrize(
    "settings,name",
    [
        (dict(pipelines=0), "pipelines"),
        (dict(pipelines=2, width=2), "width"),
        (dict(pipelines=2, alpha=1.5), "alpha"),
        (dict(pipelines=2, staleness=-1), "staleness"),
        (dict(pipelines=2, schedule="auto"), "schedule"),
        (dict(pipelines=2, schedule="1f1b", advance_num=1), "advance_num"),
        (dict(alpha=0.5), "alpha"),
    ],
)
def test_bad_settings_are_named(settings, name):
    with pytest.raises(SettingError) as info:
        AutoPipeStrategy(**settings)
    assert info.value.setting == name and name in str(info.value)


def test_pipelines_must_divide_the_devices_before_anything_starts():
    start = time.monotonic()
    with pytest.raises(SettingError, match=r"pipelines=3 does not divide the world size 4 .*allowed values: \[1, 2, 4\]"):
        strategy = AutoPipeStrategy(pipelines=3, share_devices=False, start_method=START)  # a device per process
        trainer = L.Trainer(devices=4, strategy=strategy, **trainer_kwargs(max_steps=1))
        trainer.fit(LitSeq(), DataLoader(dataset(), batch_size=10))
    assert time.monotonic() - start < 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,schedule", [(0, "1f1b"), (1, "1f1b"), (1, "2bw")])
def test_a_killed_reference_process_ends_the_job_with_its_name(tmp_path, stage, schedule):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(JOB.parents[1]))
    env.pop("LOCAL_RANK", None)
    start = time.monotonic()
    command = [sys.executable, str(JOB), str(stage), str(tmp_path), schedule]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]  # 1: a lost peer (docs/guide/faults.md)
    # the owner sees its child exit (code -9); the other pipeline's worker sees the connection fail
    assert f"ReferenceLost: the AvgPipe reference process of stage {stage}" in errors[0], errors
    assert time.monotonic() - start < 90
    assert "finished" not in proc.stdout


def test_validation_reports_the_reference_over_all_pipelines_shards():
    # each pipeline validates its shard (20 of 40 samples, batches of 10) on the reference; the logged
    # val_loss is the mean over the pipelines, i.e. the reference's loss on the whole set
    model = LitSeq()
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=2, partition="uniform", start_method=START, pipelines=2)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs())  # 2 pipelines x 2 stages
    val = DataLoader(dataset(n=40, seed=3), batch_size=10)
    (metrics,) = trainer.validate(model, val)
    x, y = dataset(n=40, seed=3).tensors
    want = nn.functional.cross_entropy(LitSeq().seq(x), y).item()
    assert metrics["val_loss"] == pytest.approx(want, rel=1e-12)
