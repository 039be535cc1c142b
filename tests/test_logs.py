"""The last stage's logs reach every rank of the pipeline: one frame per step in the steady state,
the schema re-sent when it changes (real gloo process groups); in a training step the first stage
logs them while it waits for its last gradients (a real Trainer)."""

from __future__ import annotations

import os
import time

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from lightning.pytorch.callbacks import Callback
from models import START, LitSeq, loader, trainer_kwargs

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.lightning.logs import LogBroadcaster, LogRecorder

pytestmark = pytest.mark.multiprocess

# what the last stage logs at each step: "acc" joins at step 2 and leaves at step 4; nothing but the loss at step 5
STEPS = [
    {"loss_a": 1.5},
    {"loss_a": 2.5},
    {"loss_a": 3.5, "acc": 0.25},
    {"loss_a": 4.5, "acc": 0.5},
    {"loss_a": 5.5},
    {},
]


def _recorder(active: bool, values: dict, dtype: torch.dtype, **options: dict) -> LogRecorder:
    """What a last stage recorded in one step (`options`: self.log's keywords per name)."""
    recorder = LogRecorder()
    recorder.active, recorder.weight = active, 1.0
    for name, value in values.items():
        recorder(name, torch.tensor(value, dtype=dtype), **options.get(name, {}))
    return recorder


def _exchange(rank: int, world: int) -> list:
    src = world - 1
    logs = LogBroadcaster(dist.group.WORLD, src, torch.device("cpu"), rank == src)
    calls, out = [], []
    real = dist.broadcast

    def counting(*args, **kwargs):
        calls[-1] += 1
        return real(*args, **kwargs)

    dist.broadcast = counting  # count the tensor broadcasts each exchange makes (broadcast_object_list is not one)
    try:
        for step, values in enumerate(STEPS):
            recorder = _recorder(rank == src, values, torch.float32, loss_a={"prog_bar": False}, acc={"prog_bar": True})
            calls.append(0)
            out.append(logs.exchange(recorder, 10.0 + step))
    finally:
        dist.broadcast = real
    return [out, calls]


def test_every_rank_gets_the_last_stage_logs_with_one_broadcast_in_the_steady_state():
    results = run_distributed(_exchange, 3, timeout=60.0)
    for rank, (out, _) in enumerate(results):
        for step, (loss, entries) in enumerate(out):
            assert loss == 10.0 + step, (rank, step)
            expected = [(n, v, {"prog_bar": n == "acc"}, torch.float32) for n, v in STEPS[step].items()]
            assert entries == expected, (rank, step)
    calls = [c for _, c in results]
    assert calls[0] == calls[1] == calls[2]
    # first step and each change of keys (steps 2, 4, 5): the changed flag, then the values;
    # a step with the last step's keys: one broadcast
    assert calls[0] == [1, 1, 2, 1, 2, 2]


# training and evaluation steps interleaved: each kind keeps its own schema
KINDS = [
    ("train", {"loss_a": 1.5}),
    ("eval", {"val": 0.5}),
    ("train", {"loss_a": 2.5}),
    ("eval", {"val": 0.75}),
    ("train", {"loss_a": 3.5, "acc": 0.25}),
    ("train", {"loss_a": 4.5, "acc": 0.5}),
    ("eval", {}),
]


def _exchange_frames(rank: int, world: int) -> list:
    from lightning_pipe.topology import ProcessGroups, Topology

    src = world - 1
    frames = ProcessGroups(Topology(world, 1), rank).own_pipeline_group()
    logs = LogBroadcaster(dist.group.WORLD, src, torch.device("cpu"), rank == src, frames)
    calls, out = [], []
    real = dist.broadcast

    def counting(*args, **kwargs):
        calls[-1] += 1
        return real(*args, **kwargs)

    dist.broadcast = counting
    try:
        for step, (kind, values) in enumerate(KINDS):
            calls.append(0)
            if step != 3:  # step 3: no receive posted ahead; the exchange receives the frame itself
                logs.post(kind)
            recorder = _recorder(rank == src, values, torch.float32)
            out.append(logs.exchange(recorder, 10.0 + step, kind))
    finally:
        dist.broadcast = real
    return [out, calls]


def test_the_steady_state_frame_goes_point_to_point_with_a_schema_per_kind_of_step():
    results = run_distributed(_exchange_frames, 3, timeout=60.0)
    for rank, (out, _) in enumerate(results):
        for step, (loss, entries) in enumerate(out):
            assert loss == 10.0 + step, (rank, step)
            assert entries == [(n, v, {}, torch.float32) for n, v in KINDS[step][1].items()], (rank, step)
    # a kind's first step and each change of its keys broadcast the values after the schema; a step
    # with its kind's last keys broadcasts nothing (its frame is sent point to point)
    assert [c for _, c in results] == [[1, 1, 0, 0, 1, 0, 1]] * 3


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.02)
        return grad


class _SlowBackwardBlock(torch.nn.Module):
    """Identity whose backward takes 20 ms."""

    def forward(self, x):
        return _SlowBackward.apply(x)


class _LitSlow(LitSeq):
    """Each stage of [4, 4] ends with a 20 ms backward: while the first stage runs its second-to-last
    backward, the last stage runs its last forward (and sends its logs), so they have landed when the
    first stage waits for its last gradient."""

    def __init__(self):
        super().__init__()
        blocks = list(self.seq)
        self.seq = torch.nn.Sequential(*blocks[:3], _SlowBackwardBlock(), *blocks[3:], _SlowBackwardBlock())


class _Record(Callback):
    def __init__(self, folder):
        self.folder, self.rows = folder, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        steps = trainer.strategy.layers.steps if trainer.world_size > 1 else None
        self.rows.append((float(trainer.callback_metrics["train_loss"]), steps is not None and steps.logged_early is not None))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.rows, os.path.join(self.folder, f"rows-{trainer.global_rank}-{trainer.world_size}.pt"))


@pytest.mark.timeout(240)
def test_the_first_stage_logs_the_step_while_it_waits_for_the_last_gradients(tmp_path):
    kw = trainer_kwargs(max_steps=4)
    L.Trainer(devices=1, callbacks=[_Record(tmp_path)], **kw).fit(_LitSlow(), loader())
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=2, partition=[4, 4], start_method=START)
    L.Trainer(devices=2, strategy=strategy, callbacks=[_Record(tmp_path)], **kw).fit(_LitSlow(), loader())
    ref = [loss for loss, _ in torch.load(tmp_path / "rows-0-1.pt")]
    first, last = (torch.load(tmp_path / f"rows-{r}-2.pt") for r in (0, 1))
    for rows in (first, last):  # every rank logs the one-process losses, step by step
        assert [loss for loss, _ in rows] == pytest.approx(ref, rel=1e-12)
    # the first stage logged every step but the first (the schema is not known yet) during the step;
    # the last stage, which computes the values, logs them at the step's end
    assert [early for _, early in first] == [False, True, True, True]
    assert not any(early for _, early in last)


def _changed_while_waiting(rank: int, world: int) -> list:
    from lightning_pipe.topology import ProcessGroups, Topology

    src = world - 1
    frames = ProcessGroups(Topology(world, 1), rank).own_pipeline_group()
    logs = LogBroadcaster(dist.group.WORLD, src, torch.device("cpu"), rank == src, frames)
    out, polls = [], []
    for step, values in enumerate([{"a": 1.5}, {"a": 2.5, "b": 0.5}]):
        logs.post("train")
        recorder = _recorder(rank == src, values, torch.float64)
        if rank != src and step == 1:
            time.sleep(0.5)  # the last stage's changed frame lands while this rank "waits"
            polls = [logs.arrived(recorder, "train") for _ in range(3)]
            polls.append(logs._posted is not None and logs._posted[1] is None)  # it landed and was waited once
        out.append(logs.exchange(recorder, 10.0 + step, "train"))
    return [out, polls]


def test_a_changed_schema_seen_while_waiting_is_left_to_the_exchange():
    # the other ranks see the changed frame land, poll it again and again, then the exchange moves the
    # new schema (a gloo receive waited twice would wait for another message: a hang)
    results = run_distributed(_changed_while_waiting, 2, timeout=60.0)
    for rank, (out, _) in enumerate(results):
        assert out[1] == (11.0, [("a", 2.5, {}, torch.float64), ("b", 0.5, {}, torch.float64)]), rank
    assert results[0][1] == [None, None, None, True]
