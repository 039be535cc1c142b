"""A user's torch.profiler trace shows the schedule: every pipeline action is a labelled range."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.schedules import build_schedule


def test_every_action_is_a_labelled_range_under_the_profiler():
    torch.manual_seed(0)
    chunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    host = SequentialHost({0: chunk}, 0, nn.functional.cross_entropy)
    schedule = build_schedule("1f1b", 1, 3)
    pipe = SequentialPipeline(schedule, 0, host, Transport(lambda r: r, torch.device("cpu")))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    pipe.step(x, y)  # not profiled: no labels needed, none made
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(x, y)
    labels = [e.name for e in prof.events() if e.name.startswith("lightning_pipe/")]
    expected = [f"lightning_pipe/{a.op.value} chunk={a.chunk} mb={a.microbatch}" for a in schedule.actions[0]]
    assert sorted(labels) == sorted(expected) and len(expected) >= 6  # 3 forwards, 3 backwards, the REDUCE
