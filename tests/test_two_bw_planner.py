"""PipeDream-2BW's planner (planning/two_bw.py): MEMORY by hand, in-flight counts against the simulator,
Algorithm 1's discards and SEARCH's choices on hand-built profiles, errors, the plan CLI, and
planner=2bw choosing and running a configuration in a real Trainer against one process."""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import replace

import lightning as L
import pytest
from _cli import run_module
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from models import START, EpochPerm, LitSeq, dataset, loader, max_rel_diff, trainer_kwargs
from torch.utils.data import DataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.planning.replay import cached_schedule
from lightning_pipe.planning.sized import BlockCosts, SizedProfile
from lightning_pipe.planning.two_bw import NoConfiguration, check_reachable, plan_2bw
from lightning_pipe.planning.two_bw_costs import Hardware, in_flight, memory, step_time
from lightning_pipe.simulation import CostModel, simulate

HW = Hardware(devices=2, devices_per_node=2, memory_limit=None, intra_bandwidth=1e12, inter_bandwidth=1e12, latency=0.0)


def costs(saved=(10, 20, 30, 40), inputs=(1, 2, 3, 4), params=(100, 100, 100, 100)) -> BlockCosts:
    n = len(saved)
    return BlockCosts(1.0, (1.0,) * n, (2.0,) * n, (3.0,) * n, tuple(saved), tuple(inputs), tuple(inputs), tuple(params))


def profile(
    n: int = 4, sizes=(1, 2), time_per_sample=(1.0, 1.0), saved: float = 10.0, params: float = 100.0, recompute_extra: float = 1.0
) -> SizedProfile:
    """n equal blocks; forward time per sample at each size (backward twice it); bytes linear in b."""
    rows = lambda f: [[f(s, t)] * n for s, t in zip(sizes, time_per_sample)]  # noqa: E731
    return SizedProfile(
        "hand",
        list(sizes),
        forward=rows(lambda s, t: s * t),
        backward=rows(lambda s, t: 2 * s * t),
        recompute_backward=rows(lambda s, t: (2 + recompute_extra) * s * t),
        saved_bytes=rows(lambda s, t: saved * s),
        input_bytes=rows(lambda s, t: saved * s / 10),
        output_bytes=rows(lambda s, t: saved * s / 10),
        param_bytes=[params] * n,
    )


# ---- MEMORY ----------------------------------------------------------------------------------------
def test_memory_by_hand():
    c, bounds = costs(), ((0, 2), (2, 4))
    hw = HW  # optimizer state 2 x parameters
    # 1F1B, m = 4, d = 2: stage 0 holds 2 micro-batches, stage 1 one; states (1 version + grads + 2) x 200 = 800
    assert memory(c, bounds, (False, False), "1f1b", 4, hw) == (800 + 2 * 30, 800 + 1 * 70)
    # 2BW: two weight versions, (2 + 1 + 2) x 200 = 1000
    assert memory(c, bounds, (False, False), "2bw", 4, hw) == (1000 + 2 * 30, 1000 + 70)
    # GPipe keeps all 4
    assert memory(c, bounds, (False, False), "gpipe", 4, hw) == (800 + 4 * 30, 800 + 4 * 70)
    # recomputation on stage 0: 2 x its blocks' inputs (1 + 2) + the larger block's activations while recomputed
    assert memory(c, bounds, (True, False), "1f1b", 4, hw) == (800 + 2 * 3 + 20, 800 + 70)
    # shard="optimizer" (ZeRO-1) over 4 replicas: Adam's 2 x 200 divided by 4, (1 + 1 + 0.5) x 200 = 500
    zero = replace(hw, shard_optimizer=True)
    assert memory(c, bounds, (False, False), "1f1b", 4, zero, width=4) == (500 + 2 * 30, 500 + 1 * 70)
    assert memory(c, bounds, (False, False), "1f1b", 4, zero, width=1) == memory(c, bounds, (False, False), "1f1b", 4, hw)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["1f1b", "gpipe", "2bw"]), st.integers(1, 5), st.integers(1, 12))
def test_in_flight_matches_the_simulator(schedule, depth, m):
    if schedule == "2bw" and m < depth:
        m = depth
    n = depth
    model = CostModel((1.0,) * n, (2.0,) * n, (1.0,) * n, (1.0,) * n)
    bounds = tuple((i, i + 1) for i in range(n))
    timeline = simulate(cached_schedule(schedule, depth, m), model, bounds)
    assert in_flight(schedule, depth, m) == tuple(timeline.peak_activations)


# ---- Algorithm 1 and SEARCH ------------------------------------------------------------------------
def test_over_the_cap_is_discarded_and_the_fastest_that_fits_wins():
    p = profile(n=4, sizes=(1, 2, 4), time_per_sample=(1.0, 0.8, 0.7))
    free = plan_2bw(p, HW, 8, schedules=("1f1b",), recompute=("off",))
    assert (free.chosen.width, free.chosen.depth) == (2, 1)  # data parallel: no bubble, free all-reduce
    cap = free.chosen.memory - 1
    capped = plan_2bw(p, Hardware(**{**HW.__dict__, "memory_limit": cap}), 8, schedules=("1f1b",), recompute=("off",))
    assert capped.chosen.memory <= cap
    assert (capped.chosen.width, capped.chosen.depth, capped.chosen.microbatch_size) != (2, 1, free.chosen.microbatch_size)
    for c in capped.candidates:
        if math.isfinite(c.memory) and c.memory > cap:
            assert c.verdict == "over memory_limit"
    runs = [c for c in capped.candidates if c.feasible]
    assert capped.chosen.throughput == max(c.throughput for c in runs)


def test_recomputation_only_when_it_lets_b_grow():
    # b = 2 halves the time per sample; without recomputation only b = 1 fits (one stage, 1F1B holds 1 in flight)
    fast = profile(n=2, sizes=(1, 2), time_per_sample=(1.0, 0.5), saved=100.0, params=1.0, recompute_extra=1.0)
    hw = Hardware(1, 1, memory_limit=2 * 100 + 50, intra_bandwidth=1e12, inter_bandwidth=1e12, latency=0.0)
    chosen = plan_2bw(fast, hw, 2, schedules=("1f1b",)).chosen
    assert (chosen.microbatch_size, chosen.recompute) == (2, "on")
    # a larger b gains little: recomputation's extra forward is not worth it
    slow = profile(n=2, sizes=(1, 2), time_per_sample=(1.0, 0.95), saved=100.0, params=1.0, recompute_extra=1.0)
    chosen = plan_2bw(slow, hw, 2, schedules=("1f1b",)).chosen
    assert (chosen.microbatch_size, chosen.recompute) == (1, "off")


def test_recompute_per_stage_beats_recomputing_everywhere():
    # 1F1B on 2 stages: stage 0 holds 2 micro-batches, stage 1 one; a cap between the two
    p = profile(n=2, sizes=(1, 2), saved=100.0, params=1.0, recompute_extra=1.0)
    hw = Hardware(2, 2, memory_limit=4 * 1 + 150, intra_bandwidth=1e12, inter_bandwidth=1e12, latency=0.0)
    result = plan_2bw(p, hw, 2, schedules=("1f1b",))
    rows = {c.recompute: c for c in result.candidates if c.depth == 2 and c.microbatch_size == 1}
    assert rows["off"].verdict == "over memory_limit"
    assert rows["stages"].stage_recompute == (True, False) and rows["stages"].feasible
    assert rows["stages"].throughput > rows["on"].throughput
    deep = [c for c in result.candidates if c.depth == 2 and c.feasible]
    assert max(deep, key=lambda c: c.throughput).stage_recompute == (True, False)


def test_the_chosen_configuration_is_simulated_exactly():
    p = profile(n=8, sizes=(1, 2, 4), time_per_sample=(1.0, 0.9, 0.85))
    hw = Hardware(4, 4, None, 1e9, 1e9, latency=1e-4)
    result = plan_2bw(p, hw, 256, schedules=("2bw", "1f1b"))
    c = result.chosen
    assert c.exact and c.verdict == "chosen"
    exact = step_time(p.at(c.microbatch_size), c.bounds, c.stage_recompute, c.schedule, c.microbatches, hw, width=c.width)
    assert c.step_time == pytest.approx(exact, rel=1e-12)
    assert "chosen:" in result.table() and "over memory_limit" not in result.table()


# ---- bad input -------------------------------------------------------------------------------------
def test_nothing_fits_names_memory_limit_and_the_smallest_footprint():
    p = profile(n=2)
    with pytest.raises(NoConfiguration, match=r"memory_limit=.*smallest footprint found is") as err:
        plan_2bw(p, Hardware(2, 2, 10.0, 1e9, 1e9), 4)
    assert err.value.setting == "memory_limit"


def test_unreachable_global_batch_and_devices():
    with pytest.raises(ValueError, match="global_batch=4 is reachable by no"):
        check_reachable(3, 2, 4, ("1f1b",))  # only (3, 1): 4 is not a multiple of 3
    with pytest.raises(ValueError, match="g >= d"):
        check_reachable(2, 2, 1, ("2bw",))  # (2, 1): 1 % 2; (1, 2): g = 1 < d = 2
    with pytest.raises(ValueError, match="no \\(width, depth\\)"):
        check_reachable(2, 0, 4)
    config = PipelineConfig(planner="2bw", global_batch=4, schedule="1f1b")
    with pytest.raises(SettingError) as err:
        config.check_model(3, 2)
    assert err.value.setting == "global_batch"


@pytest.mark.parametrize(
    "kwargs,setting",
    [
        ({"planner": "pipedream"}, "planner"),
        ({"global_batch": 8}, "global_batch"),
        ({"planner": "2bw", "global_batch": 0}, "global_batch"),
        ({"planner": "2bw", "schedule": "wave"}, "schedule"),
        ({"planner": "2bw", "pipelines": 2}, "planner"),
        ({"planner": "2bw", "partition": [2, 2]}, "partition"),
        ({"memory_limit": "lots"}, "memory_limit"),
        ({"recompute": [True, "no"]}, "recompute"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, setting):
    with pytest.raises(SettingError) as err:
        PipelineConfig(**kwargs)
    assert err.value.setting == setting


def test_memory_limit_sizes_and_recompute_per_stage():
    assert PipelineConfig(memory_limit="16GB").memory_limit == 16 * 2**30
    assert PipelineConfig(memory_limit="512 MiB").memory_limit == 512 * 2**20
    config = PipelineConfig(recompute=[True, False])
    assert config.recompute_stages(2) == [True, False]
    with pytest.raises(SettingError, match="2 entries for 3 stages"):
        config.check_world(3)


# ---- the plan CLI ----------------------------------------------------------------------------------
def plan_cli(tmp_path, *overrides):
    tmp_path.mkdir(exist_ok=True)
    # the plan command starts no processes: forked from the tests' fork server (tests/_cli.py)
    return run_module("lightning_pipe.plan", ["recipe=gpt2-1.3b", f"hydra.run.dir={tmp_path}", *overrides], tmp_path, timeout=120)


@pytest.mark.timeout(200)
def test_plan_cli_prints_the_candidate_table(tmp_path):
    run = plan_cli(tmp_path, "trainer.devices=16", "pipeline.planner=2bw", "pipeline.memory_limit=16GB")
    assert run.returncode == 0, run.stderr
    assert "w | d | b | g | schedule | r | samples/s" in run.stdout and "chosen: w=" in run.stdout
    result = json.loads((tmp_path / "plan_2bw.json").read_text())
    chosen = result["chosen"]
    assert chosen["memory"] <= 16 * 2**30 and chosen["width"] * chosen["depth"] == 16
    assert chosen["width"] * chosen["microbatch_size"] * chosen["microbatches"] == 512  # the recipe's batch
    feasible = [c for c in result["candidates"] if c["verdict"] in ("runs", "chosen") and c["exact"]]
    assert chosen["throughput"] == max(c["throughput"] for c in feasible)
    small = plan_cli(tmp_path / "small", "trainer.devices=16", "pipeline.planner=2bw", "pipeline.memory_limit=1GB")
    assert small.returncode == 2
    assert "pipeline.memory_limit" in small.stderr and "smallest footprint" in small.stderr


@pytest.mark.multiprocess
def test_plan_cli_runs_either_cost_model_and_prints_the_other_beside(tmp_path):
    settings = ("trainer.devices=16", "pipeline.planner=2bw", "pipeline.memory_limit=16GB")
    ours = plan_cli(tmp_path / "ours", *settings)
    paper = plan_cli(tmp_path / "paper", *settings, "pipeline.planner_2bw_cost=paper")
    assert ours.returncode == 0 and paper.returncode == 0, ours.stderr + paper.stderr
    mine, theirs = (json.loads((tmp_path / name / "plan_2bw.json").read_text()) for name in ("ours", "paper"))
    assert "even (the paper's B/d) partition" in paper.stdout and "min-max" in ours.stdout
    # each run's choice is the other's "beside" line: the same two answers, from either side
    assert mine["beside"]["planner_2bw_cost"] == "paper" and theirs["beside"]["planner_2bw_cost"] == "simulated"
    assert mine["beside"]["chosen"] == theirs["chosen"] and theirs["beside"]["chosen"] == mine["chosen"]
    assert "planner_2bw_cost=paper chooses w=" in ours.stdout and "planner_2bw_cost=simulated chooses w=" in paper.stdout
    bad = plan_cli(tmp_path / "bad", *settings, "pipeline.planner_2bw_cost=closed")
    assert bad.returncode == 2 and "pipeline.planner_2bw_cost" in bad.stderr and "'paper'" in bad.stderr


# ---- planner=2bw in a real Trainer -----------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_planner_picks_and_runs_a_configuration_equal_to_one_process_and_resumes_on_it(tmp_path):
    """The DataLoader says 5 rows; global_batch=8 makes every step 8 samples over the replicas,
    whichever (w, d, b, g) the planner picks for 1F1B. A resume keeps the chosen shape (no new plan)."""

    def run(root, steps, ckpt_path=None):
        model = LitSeq()
        strategy = AutoPipeStrategy(planner="2bw", schedule="1f1b", global_batch=8, start_method=START)
        saving = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1)
        kw = trainer_kwargs(max_steps=steps, enable_checkpointing=True, callbacks=[saving])
        L.Trainer(devices=2, strategy=strategy, default_root_dir=str(root), **kw).fit(
            model, loader(batch_size=5, n=32), ckpt_path=ckpt_path
        )
        return model

    run(tmp_path / "first", 4)
    (path,) = glob.glob(os.path.join(tmp_path, "first", "**", "plan_2bw.json"), recursive=True)
    chosen = json.loads(open(path).read())["chosen"]
    assert chosen["width"] * chosen["microbatch_size"] * chosen["microbatches"] == 8
    assert chosen["width"] * chosen["depth"] == 2
    assert glob.glob(os.path.join(tmp_path, "first", "**", "sized_profile.json"), recursive=True)
    model = run(tmp_path / "second", 6, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"))
    # one process on the global batch: 32 samples, 4 steps an epoch (Lightning resumes a plain DataLoader
    # exactly at step 4); replicas read through Lightning's shuffling DistributedSampler
    ref = LitSeq()
    order = {"sampler": EpochPerm(32)} if chosen["width"] > 1 else {}
    L.Trainer(devices=1, **trainer_kwargs(max_steps=6)).fit(ref, DataLoader(dataset(n=32), batch_size=8, **order))
    assert max_rel_diff(ref.state_dict(), model.state_dict()) < 1e-10
    assert not glob.glob(os.path.join(tmp_path, "second", "**", "plan_2bw.json"), recursive=True)  # not planned again


def test_rebatched_keeps_the_loader_and_refuses_what_it_cannot_rebuild():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_pipe.lightning.plan_2bw import rebatched

    data = dataset(n=12)
    for cls in (DataLoader, StatefulDataLoader):
        original = cls(data, batch_size=5, drop_last=True)
        again = rebatched(original, 4)
        assert type(again) is cls and again.dataset is data and again.drop_last
        assert [len(x) for x, _ in again] == [4, 4, 4]
        assert rebatched(again, 4) is again  # already right: untouched
    custom = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(SettingError, match="cannot be rebuilt with another batch size") as err:
        rebatched(custom, 4)
    assert err.value.setting == "planner"


# ---- the paper's closed forms (the baseline) -------------------------------------------------------
def test_closed_forms_by_hand():
    from lightning_pipe.planning.two_bw_closed import closed_memory, closed_step

    c = costs(saved=(10, 20, 30, 40), inputs=(1, 2, 3, 4), params=(100, 100, 100, 100))  # forward 1, backward 2, recompute 3
    hw = Hardware(4, 4, None, intra_bandwidth=2.0, inter_bandwidth=2.0, latency=0.0)
    # 2 stages of 2 blocks: compute 2 x (1 + 2) = 6; stage 0 sends block 1's output (2 bytes) and gets its
    # gradient back: 2 x 2 / 2 = 2 s; stage 1 receives the same: 2 s
    assert closed_step(c, 2, 1, 4, False, hw) == 6.0
    # recomputation measured: 2 x (1 + 3) = 8 > 6
    assert closed_step(c, 2, 1, 4, True, hw) == 8.0
    # not measured (a profile whose recomputed backward is the plain one): the paper's c_extra = 4/3 of 6
    unmeasured = replace(c, recompute_backward=c.backward)
    assert closed_step(unmeasured, 2, 1, 4, True, hw) == pytest.approx(4 / 3 * 6.0)
    assert closed_step(unmeasured, 2, 1, 4, False, hw) == 6.0
    # two replicas: ring all-reduce of 200 bytes, 2 (2 - 1) / 2 x 200 / 2 = 100 s per step, over g = 4 micro-batches
    assert closed_step(c, 2, 2, 4, False, hw) == 25.0
    # MEMORY: 2BW 2 |W| / d + |A| = 2 x 400 / 2 + 100; with recomputation |A| / d
    assert closed_memory(c, 2, "2bw", 4, False) == 400 + 100
    assert closed_memory(c, 2, "2bw", 4, True) == 400 + 50
    assert closed_memory(c, 2, "gpipe", 4, True) == (400 + 4 * 10 + (100 - 10)) / 2


def test_closed_cost_model_plans_with_the_papers_forms():
    p = profile(n=4, sizes=(1, 2, 4), time_per_sample=(1.0, 0.8, 0.7))
    closed = plan_2bw(p, HW, 8, schedules=("2bw",), cost_model="closed")
    assert {c.recompute for c in closed.candidates if c.feasible} <= {"off", "on"}  # no per-stage option
    assert all(c.exact for c in closed.candidates if c.feasible) and "closed cost functions" in closed.source
    with pytest.raises(ValueError, match="cost_model"):
        plan_2bw(p, HW, 8, cost_model="guess")
