"""schedule="zb-auto" through the Trainer: the zero-bubble paper's automatic scheduler (its heuristic on the
profiled F / BI / W times) trains exactly like one process, an uneven last batch included, and each
rank runs the order built from global rank 0's profile."""

from __future__ import annotations

import json

import pytest
from models import START, LitSeq, dataset, max_rel_diff
from test_strategy import pipelined, single
from torch.utils.data import DataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.planning.entry import link_model
from lightning_pipe.planning.zero_bubble import CostedSchedule
from lightning_pipe.profiling.blocks import Profile
from lightning_pipe.schedules.zero_bubble_auto import zb_auto

pytestmark = [pytest.mark.timeout(240)]


def uneven_profile(path) -> str:
    """6 blocks whose BI / W split differs by stage: the heuristic's order then differs from its form on
    equal times (what the schedule's name builds without costs)."""
    profile = Profile.synthetic([1e-3] * 6, [2e-3] * 6)
    profile.backward_input = [1e-3, 1e-3, 0.2e-3, 0.2e-3, 1e-3, 1e-3]
    profile.weight = [1e-3, 1e-3, 3e-3, 3e-3, 0.2e-3, 0.2e-3]
    profile.backward = [a + b for a, b in zip(profile.backward_input, profile.weight)]
    return str(profile.save(path))


def computes(schedule, rank: int) -> list[str]:
    return [f"{a.op.value}{a.microbatch}" for a in schedule.actions[rank] if a.op.is_compute]


@pytest.mark.multiprocess
@pytest.mark.parametrize("devices,partition,uneven", [(2, "autopipe", False), (3, "uniform", True)])
def test_zb_auto_trains_like_one_process_and_runs_the_order_built_from_the_profile(tmp_path, devices, partition, uneven):
    # 46 samples in batches of 10: the 5th step's batch of 6 splits into micro-batches of 2, 2, 1, 1
    train = DataLoader(dataset(n=46), batch_size=10)
    ref = LitSeq()
    single(ref, steps=5, train=train)
    model = LitSeq()
    profile = uneven_profile(tmp_path / "uneven.json") if uneven else None  # else measured on the ranks
    strategy = AutoPipeStrategy(
        schedule="zb-auto", microbatches=4, partition=partition, profile=profile, trace=True, message_costs=False, start_method=START
    )
    pipelined(model, devices, steps=5, train=train, strategy=strategy, default_root_dir=tmp_path)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10

    summary = json.loads((tmp_path / "plan.json").read_text())
    assert summary["schedule"] == "zb-auto"
    bounds = tuple(tuple(b) for b in summary["bounds"])
    costs = Profile.load(tmp_path / "profile.json").costs(*link_model(PipelineConfig(), "cpu"))
    built = CostedSchedule(costs, bounds)
    # the traced step ran, on every rank, the order the heuristic builds from (rank 0's) profile
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    ran = sorted((e for e in events if e.get("cat") == "compute"), key=lambda e: (e["pid"], e["ts"]))
    for rank in range(devices):
        assert [e["name"] for e in ran if e["pid"] == rank] == computes(built(4), rank)
    if uneven:  # and that order is the costs' own, not the one the name builds on equal times
        assert any(computes(built(4), r) != computes(zb_auto(devices, 4), r) for r in range(devices))


def test_zb_auto_is_refused_where_it_cannot_run_before_spawning():
    with pytest.raises(SettingError, match=r"pipelines=2: schedule='zb-auto' is built from one pipeline's profile") as error:
        PipelineConfig(schedule="zb-auto", pipelines=2)
    assert error.value.setting == "schedule"
    with pytest.raises(SettingError, match=r"slicer=True works with schedule='gpipe' or '1f1b', not 'zb-auto'"):
        PipelineConfig(schedule="zb-auto", slicer=True)
    assert PipelineConfig(schedule="zb-auto").needs_profile  # its order comes from measured costs
