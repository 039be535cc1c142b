"""The memory model's runtime term: what a process holds besides the model (profiling/runtime.py),
measured, carried by the profile and the costs, and counted by every planner that checks memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_pipe.planning import transformer_costs
from lightning_pipe.planning.auto import choose_schedule
from lightning_pipe.planning.sized import BlockCosts
from lightning_pipe.planning.two_bw_costs import Hardware, memory
from lightning_pipe.planning.zero_bubble import stage_limit
from lightning_pipe.profiling import Profile
from lightning_pipe.profiling.runtime import runtime_bytes
from lightning_pipe.simulation import CostModel

MiB = 2**20


def test_a_host_process_runtime_leaves_out_the_models_own_tensors():
    cpu = torch.device("cpu")
    before = runtime_bytes(cpu)
    assert before > 50 * MiB  # the interpreter, torch and its libraries
    model = nn.Linear(4096, 8192)  # 128 MiB of float32 weights, written so their pages are resident
    with torch.no_grad():
        model.weight.fill_(1.0)
    with_model = runtime_bytes(cpu)
    without = runtime_bytes(cpu, [model])
    assert with_model - before > 100 * MiB  # the weights are in the process's memory ...
    assert abs(without - before) < 32 * MiB  # ... and not in its runtime


def test_the_profile_carries_the_runtime_to_the_costs(tmp_path):
    profile = dataclasses.replace(Profile.synthetic([1e-3] * 4, activation_bytes=1e3, param_bytes=1e6), runtime_bytes=3e8)
    again = Profile.load(profile.save(tmp_path / "profile.json"))
    assert again.runtime_bytes == 3e8 and again.costs().runtime_bytes == 3e8
    with pytest.raises(ValueError, match="runtime_bytes"):
        dataclasses.replace(profile, runtime_bytes=-1.0)
    with pytest.raises(ValueError, match="runtime_bytes"):
        CostModel((1.0,), (2.0,), runtime_bytes=float("nan"))


def test_auto_counts_the_runtime_on_every_rank_and_against_the_limit():
    costs, kinds = transformer_costs("gpt2-345m", 4)
    bare = choose_schedule(costs, 4, 8, kinds=kinds)
    runtime = 0.3 * 2**30
    held = choose_schedule(dataclasses.replace(costs, runtime_bytes=runtime), 4, 8, kinds=kinds)
    for a, b in zip(bare.candidates, held.candidates):
        if a.plan is not None:
            assert b.peak_memory == pytest.approx(a.peak_memory + runtime)
    # a limit the model alone meets but the model and the process do not: the winner is over it
    limit = bare.chosen.peak_memory + runtime / 2
    capped = choose_schedule(dataclasses.replace(costs, runtime_bytes=runtime), 4, 8, kinds=kinds, memory_limit=limit)
    assert bare.chosen.name in [c.name for c in capped.candidates if c.verdict == "over the memory limit"]


def test_zero_bubble_room_is_what_the_runtime_leaves():
    costs = CostModel((1.0,) * 2, (2.0,) * 2, (10.0,) * 2, (100.0,) * 2)
    bounds = ((0, 1), (1, 2))
    assert stage_limit(costs, bounds, 500.0, weight_copies=4) == 10  # (500 - 400) // 10
    assert stage_limit(dataclasses.replace(costs, runtime_bytes=50.0), bounds, 500.0, weight_copies=4) == 5
    with pytest.raises(ValueError, match="runtime"):
        stage_limit(dataclasses.replace(costs, runtime_bytes=95.0), bounds, 500.0, weight_copies=4)


def test_the_2bw_planner_adds_the_runtime_to_every_stage():
    four = lambda v: (float(v),) * 4  # noqa: E731
    c = BlockCosts(1.0, four(1), four(2), four(3), saved_bytes=four(10), input_bytes=four(1), output_bytes=four(1), param_bytes=four(100))
    hw = Hardware(2, 2, None, 1e9, 1e9)
    plain = memory(c, ((0, 2), (2, 4)), (False, False), "2bw", 4, hw)
    held = memory(c, ((0, 2), (2, 4)), (False, False), "2bw", 4, dataclasses.replace(hw, runtime_bytes=7.0))
    assert [b - a for a, b in zip(plain, held)] == [7.0, 7.0]
