"""The 2BW planner's search over tensor and shard (planning/two_bw_mesh.py, ours beside Algorithm 1):
choices known by construction on hand-built profiles, a property over random ones, the collectives
measured on 2 gloo processes (profiling/collectives.py), and the plan command printing the mesh."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _cli import run_module
from _dist import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.modes.two_bw.settings import check_applied
from lightning_pipe.planning.collectives import CollectiveCosts, Fit, fit_samples, ring
from lightning_pipe.planning.sized import SizedProfile
from lightning_pipe.planning.two_bw import NoConfiguration, plan_2bw
from lightning_pipe.planning.two_bw_costs import Hardware, allreduce_time, memory
from lightning_pipe.planning.two_bw_mesh import mesh_costs, options

P = 1e6  # parameter bytes per block


def profile(n: int = 1, params: float = P, out: float = 1e3) -> SizedProfile:
    """n equal blocks: forward 1 s per sample (backward twice it), small activations, `params` bytes each."""
    sizes = [1, 2, 4]
    rows = lambda f: [[f(s)] * n for s in sizes]  # noqa: E731
    return SizedProfile(
        "hand",
        sizes,
        forward=rows(lambda s: 1.0 * s),
        backward=rows(lambda s: 2.0 * s),
        recompute_backward=rows(lambda s: 3.0 * s),
        saved_bytes=rows(lambda s: 10.0 * s),
        input_bytes=rows(lambda s: 1.0 * s),
        output_bytes=rows(lambda s: out * s),
        param_bytes=[params] * n,
    )


def hw(devices: int, per_node: int, limit: float, **kw) -> Hardware:
    return Hardware(devices, per_node, limit, intra_bandwidth=1e12, inter_bandwidth=1e11, latency=0.0, **kw)


# ---- choices known by construction ------------------------------------------------------------------
def test_only_shard_full_fits():
    # 8 devices, 2 blocks, 1F1B: none holds 4P per stage at best; optimizer (2 + 2/4) P = 2.5P (w=4, d=2);
    # full (1 + 1 + 2) x the stage's parameters / w + one gathered block: 4P / 4 + P = 4 x 2P / 8 + P = 2P
    limit = 2.2 * P
    with pytest.raises(NoConfiguration):
        plan_2bw(profile(2), hw(8, 8, limit), 8, ("1f1b",), every_device=True)
    chosen = plan_2bw(profile(2), hw(8, 8, limit), 8, ("1f1b",), every_device=True, mesh=True).chosen
    assert (chosen.shard, chosen.tensor, chosen.width * chosen.depth) == ("full", 1, 8)
    assert chosen.memory <= limit


def test_only_tensor_fits():
    # one layer on 4 devices of a node: T=1 at best 2P (full over 4), T=2 1.5P (full over 2), T=4 holds P
    limit = 1.2 * P
    result = plan_2bw(profile(1), hw(4, 4, limit), 4, ("1f1b",), every_device=True, mesh=True, kinds=["layer"])
    assert (result.chosen.tensor, result.chosen.width, result.chosen.depth) == (4, 1, 1)
    assert "t | shard" in result.table() and "mesh: pp 1 x dp 1 x tp 4, shard=none" in result.table()
    # kinds that tensor parallelism does not split: nothing fits
    with pytest.raises(NoConfiguration):
        plan_2bw(profile(1), hw(4, 4, limit), 4, ("1f1b",), every_device=True, mesh=True, kinds=["embedding"])


def test_zero1_over_split_weights_when_only_sharding_fits_and_gathers_are_slow():
    # 8 devices, 2 layers, 1F1B, a limit of 1.6P: at T = 1 nothing fits (none 4P, optimizer 2.5P, full 2P); at T = 2
    # and d = 2 (P/2 a stage, w = 2) shard none holds 2P, ZeRO-1 (2 + 2/2) x P/2 = 1.5P and full 1.5P, at d = 1
    # (w = 4) only full fits; T = 4 fits every shard but all-reduces over 4 ranks (3 steps of latency each way, twice
    # a layer and direction). With slow collectives (all-gather 0.5 s a step, all-reduce 0.2 s) FSDP2's gathers (2 a
    # block and micro-batch) cost more than ZeRO-1's one broadcast a step: pp2 x dp2 x tp2 with ZeRO-1
    collectives = CollectiveCosts(Fit(0.5, 1e12), Fit(0.5, 1e12), Fit(0.2, 1e12))
    result = plan_2bw(profile(2), hw(8, 8, 1.6 * P, intra_collectives=collectives), 8, ("1f1b",), every_device=True, mesh=True,
                      kinds=["layer"] * 2)  # fmt: skip
    c = result.chosen
    assert (c.tensor, c.shard, c.width, c.depth) == (2, "optimizer", 2, 2), result.table(all_rows=True)
    assert c.memory <= 1.6 * P
    for t, shard in ((2, "full"), (4, "optimizer"), (4, "none")):  # they fit, slower
        assert any(x.tensor == t and x.shard == shard and x.verdict == "runs" for x in result.candidates), (t, shard)
    assert not any(x.tensor == 1 and x.verdict in ("runs", "chosen") for x in result.candidates)


def test_slow_intra_node_all_reduce_keeps_tensor_out():
    # every mesh fits (no limit); tensor parallelism all-reduces activations, FSDP gathers weights
    gather = Fit(1e-3, 1e12)
    fast = CollectiveCosts(gather, gather, Fit(0.0, 1e9))
    slow = CollectiveCosts(gather, gather, Fit(10.0, 1e3))
    args = (profile(1), 4, ("1f1b",))
    quick = plan_2bw(*args[:1], hw(4, 4, None, intra_collectives=fast), *args[1:], every_device=True, mesh=True, kinds=["layer"])
    assert quick.chosen.tensor == 4  # a quarter of the work, nothing to gather
    late = plan_2bw(*args[:1], hw(4, 4, None, intra_collectives=slow), *args[1:], every_device=True, mesh=True, kinds=["layer"])
    assert (late.chosen.tensor, late.chosen.shard) == (1, "full")  # gathers and a reduce-scatter, no all-reduce


def test_the_search_off_is_algorithm_1():
    # mesh=False plans what the planner planned before: T = 1, hw's shard, Algorithm 1's candidates only
    base = plan_2bw(profile(4), hw(4, 4, None), 8, ("2bw", "1f1b"))
    assert {(c.tensor, c.shard) for c in base.candidates} == {(1, "none")} and not base.mesh
    meshed = plan_2bw(profile(4), hw(4, 4, None), 8, ("2bw", "1f1b"), mesh=True, kinds=["layer"] * 4)
    assert {c.tensor for c in meshed.candidates} == {1, 2, 4}
    assert any(c.shard == "full" and c.schedule == "2bw" for c in meshed.candidates)  # 2bw over FSDP2: a sharded stash
    with pytest.raises(ValueError, match="closed forms"):
        plan_2bw(profile(4), hw(4, 4, None), 8, mesh=True, cost_model="closed")


def test_costs_of_a_mesh_by_hand():
    c = profile(2, out=1e6).at(1)
    h = hw(4, 4, None)
    split = mesh_costs(c, ["layer", "embedding"], 2, "none", 1, h)
    reduce = 2 * (2 * 0.5 * 1e6 / 1e12)  # two ring all-reduces of the layer's output over 2 ranks, no latency
    assert split.forward == pytest.approx((0.5 + reduce, 1.0)) and split.param_bytes == (P / 2, P)
    assert split.recompute_backward[0] == pytest.approx(1.5 + 2 * reduce)
    full = mesh_costs(c, None, 1, "full", 4, h)
    assert full.forward[0] == pytest.approx(1.0 + 0.75 * P / 1e12)  # all-gather of the block over 4 replicas
    bounds = ((0, 2),)
    assert memory(c, bounds, (False,), "1f1b", 1, h, 4, "full")[0] == pytest.approx(4 * 2 * P / 4 + P + 20)
    assert allreduce_time(c, bounds, 4, h, "full") == pytest.approx(0.75 * 2 * P / 1e12)  # a reduce-scatter
    # the ring model reproduces Algorithm 1's all-reduce (2 passes; 3 with ZeRO-1's broadcast)
    lat = Hardware(4, 4, None, 1e9, 1e9, latency=1e-5)
    for shard, zero in (("none", False), ("optimizer", True)):
        paper = allreduce_time(c, bounds, 4, Hardware(4, 4, None, 1e9, 1e9, latency=1e-5, shard_optimizer=zero))
        assert allreduce_time(c, bounds, 4, lat, shard) == pytest.approx(paper)
    assert options(h, None, ("2bw",)) == [(1, "none"), (1, "optimizer"), (1, "full")]  # 2bw over FSDP2: a sharded stash


def test_a_fit_recovers_its_ring():
    truth = CollectiveCosts(Fit(1e-4, 1e9), Fit(2e-4, 5e8), Fit(1e-4, 2e9))
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        samples = [(n, truth.time(kind, n, 4)) for n in (0.0, 1e5, 1e6, 1e7)]
        samples[0] = (1.0, truth.time(kind, 1.0, 4))
        fit = fit_samples(kind, 4, samples)
        assert fit.latency == pytest.approx(getattr(truth, kind).latency, rel=1e-2)
        assert fit.bus_bandwidth == pytest.approx(getattr(truth, kind).bus_bandwidth, rel=1e-2)
    assert ring(1e9, 0.0).time("all_reduce", 1e9, 1) == 0.0


# ---- a property over random profiles and machines ----------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(
    blocks=st.integers(1, 4),
    per_node=st.sampled_from([1, 2, 4]),
    nodes=st.integers(1, 2),
    params=st.floats(1e3, 1e6),
    limit=st.one_of(st.none(), st.floats(1e3, 2e7)),
    schedules=st.sampled_from([("2bw",), ("1f1b",), ("2bw", "1f1b", "gpipe")]),
)
def test_every_mesh_candidate_fits_and_fills_the_devices(blocks, per_node, nodes, params, limit, schedules):
    devices = per_node * nodes
    h = Hardware(devices, per_node, limit, 1e10, 1e9, latency=1e-5)
    try:
        result = plan_2bw(profile(blocks, params), h, 8, schedules, every_device=True, mesh=True, kinds=["layer"] * blocks)
    except NoConfiguration:
        return
    cap = math.inf if limit is None else limit
    for c in result.candidates:
        assert c.width * c.depth * c.tensor == devices and per_node % c.tensor == 0
        if c.feasible:
            assert c.memory <= cap and len(c.stage_memory) == c.depth
    assert result.chosen.throughput == max(c.throughput for c in result.candidates if c.feasible and c.exact)


# ---- the settings -------------------------------------------------------------------------------------
def test_plan_mesh_settings():
    assert PipelineConfig(planner="2bw", plan_mesh=True).plan_mesh
    with pytest.raises(SettingError, match="plan_mesh='yes': allowed values are True or False"):
        PipelineConfig(planner="2bw", plan_mesh="yes")
    with pytest.raises(SettingError, match="setting of planner=2bw"):
        PipelineConfig(plan_mesh=True)
    with pytest.raises(SettingError, match="setting of planner=2bw"):
        PipelineConfig(planner="2bw", planner_2bw_cost="paper", plan_mesh=True)
    # a training run (preflight, and the strategy's setup) refuses applying a planned tensor or shard
    check_applied(PipelineConfig(planner="2bw"))
    with pytest.raises(SettingError, match="a training run does not apply them"):
        check_applied(PipelineConfig(planner="2bw", plan_mesh=True))


# ---- the collectives measured on 2 processes ----------------------------------------------------------
def _measure(rank: int, world: int) -> CollectiveCosts:
    from lightning_pipe.profiling.collectives import measure_collectives

    return measure_collectives(sizes=(1 << 12, 1 << 20, 1 << 22), repeats=3)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collectives_measured_on_two_processes():
    first, second = run_distributed(_measure, 2, timeout=90)
    assert first == second and first.ranks == 2 and first.source.startswith("measured on 2 ranks")
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        fit = getattr(first, kind)
        assert fit.latency >= 0 and 0 < fit.bus_bandwidth < math.inf
        assert first.time(kind, 1 << 22, 2) > first.time(kind, 1 << 12, 2) > 0


def _measure_two_nodes(rank: int, world: int) -> tuple:
    from lightning_pipe.lightning.plan_2bw import Where, measured_collectives

    return measured_collectives(Where(world, 2, rank, torch.device("cpu"), None))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_job_on_two_nodes_measures_within_each_node_and_across():
    # 4 processes as 2 nodes of 2 (a training run's planner=2bw with tensor > 1 or shard=full): each node's pair
    # within, the whole job across; every rank of the job has the same cross-node fit
    results = run_distributed(_measure_two_nodes, 4, timeout=90)
    for intra, inter in results:
        assert intra.source == "measured on 2 ranks (cpu)" and inter.source == "measured on 4 ranks (cpu)"
    assert len({inter for _, inter in results}) == 1 and results[0][0] == results[1][0] and results[2][0] == results[3][0]


# ---- the plan command ----------------------------------------------------------------------------------
def plan_2bw_cli(tmp_path, *settings: str):
    """The plan command with planner=2bw for GPT-2 345M on 4 devices, a global batch of 8, and `settings`."""
    common = ["recipe=gpt2-345m", f"hydra.run.dir={tmp_path}", "trainer.devices=4", "pipeline.planner=2bw", "data.batch_size=8"]
    return run_module("lightning_pipe.plan", [*common, *settings], tmp_path, timeout=180)


@pytest.mark.timeout(200)
def test_plan_cli_prints_the_chosen_mesh(tmp_path):
    run = plan_2bw_cli(tmp_path, "pipeline.plan_mesh=true", "pipeline.schedule=1f1b", "pipeline.memory_limit=4GB")
    assert run.returncode == 0, run.stderr
    assert "w | d | t | shard | b" in run.stdout and "mesh: pp " in run.stdout and "predicted memory per rank" in run.stdout
    mesh = json.loads((tmp_path / "plan_2bw.json").read_text())["mesh"]
    assert mesh["searched"] and mesh["pp"] * mesh["dp"] * mesh["tp"] <= 4 and mesh["shard"] in ("none", "optimizer", "full")
    line = next(x for x in run.stdout.splitlines() if x.startswith("mesh: "))
    assert line.startswith(f"mesh: pp {mesh['pp']} x dp {mesh['dp']} x tp {mesh['tp']}, shard={mesh['shard']}")


@pytest.mark.timeout(200)
def test_plan_cli_plans_around_the_runs_shard_as_the_run_does(tmp_path):
    # planner=2bw with shard=full (no search): what a training run plans, widths of at least 2 priced with FSDP2's
    # collectives, the paper's closed forms beside
    run = plan_2bw_cli(tmp_path, "pipeline.shard=full", "pipeline.schedule=2bw")
    assert run.returncode == 0, run.stderr
    plan = json.loads((tmp_path / "plan_2bw.json").read_text())
    assert plan["mesh"]["searched"] is False and plan["mesh"]["shard"] == "full"
    assert plan["candidates"] and all(c["shard"] == "full" and c["width"] >= 2 for c in plan["candidates"])
