"""The last stage's logs reach every rank of the pipeline: one broadcast per step in the steady state,
the schema re-sent when it changes (real gloo process groups)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

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
            recorder = LogRecorder()
            recorder.active, recorder.weight = rank == src, 1.0
            for name, value in values.items():
                recorder(name, torch.tensor(value, dtype=torch.float32), prog_bar=name == "acc")
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
