"""Multi-chunk partitions and schedule="auto": the planners on P·v / 2PW chunks, the choice of the
simulator's fastest candidate that fits in memory, and clear errors."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_pipe.planning import PARTITIONERS, plan, transformer_costs
from lightning_pipe.planning.auto import CANDIDATES, choose_schedule
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulator import CostModel, simulate

MULTI = [("interleaved", {"chunks": 2}), ("wave", {"waves": 1}), ("wave", {"waves": 2})]


def random_costs(rng: random.Random, n: int) -> CostModel:
    f = [rng.uniform(0.1, 1.0) for _ in range(n)]
    return CostModel(
        tuple(f),
        tuple(x * rng.uniform(1.5, 3.0) for x in f),
        activation_bytes=(1.0,) * n,
        param_bytes=tuple(rng.uniform(1, 10) for _ in range(n)),
        bandwidth=10.0,
        latency=0.01,
    )


def simulated(costs, schedule, options, ranks, m, bounds):
    return simulate(build_schedule(schedule, ranks, m, **options), costs, bounds).iteration_time


def all_splits(n: int, pieces: int):
    for cuts in itertools.combinations(range(1, n), pieces - 1):
        edges = (0, *cuts, n)
        yield tuple(zip(edges, edges[1:]))


@pytest.mark.parametrize("schedule,options", MULTI)
def test_multichunk_partitions_cover_the_model_in_the_schedules_chunk_count(schedule, options):
    costs = random_costs(random.Random(0), 12)
    pieces = len(build_schedule(schedule, 2, 4, **options).chunk_rank)
    for method in PARTITIONERS:
        bounds = PARTITIONERS[method](costs, 2, 4, schedule, options=options)
        assert len(bounds) == pieces and bounds[0][0] == 0 and bounds[-1][1] == 12
        assert all(a < b for a, b in bounds) and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("schedule,options", MULTI)
def test_multichunk_autopipe_never_worse_than_dp_and_near_the_true_optimum(seed, schedule, options):
    rng = random.Random(seed)
    costs = random_costs(rng, 10)
    pieces = len(build_schedule(schedule, 2, 4, **options).chunk_rank)
    # the optimum by brute force over every split, each simulated by the general simulator
    best = min(simulated(costs, schedule, options, 2, 4, b) for b in all_splits(10, pieces))
    auto = simulated(costs, schedule, options, 2, 4, PARTITIONERS["autopipe"](costs, 2, 4, schedule, options=options))
    dp = simulated(costs, schedule, options, 2, 4, PARTITIONERS["dp"](costs, 2, 4, schedule, options=options))
    exhaustive = simulated(costs, schedule, options, 2, 4, PARTITIONERS["exhaustive"](costs, 2, 4, schedule, options=options))
    assert exhaustive == pytest.approx(best, rel=1e-12)
    assert auto <= dp * (1 + 1e-12)
    assert auto <= best * 1.03  # a local search: near, not always at, the optimum


def test_plan_of_a_wave_reports_chunks_and_their_ranks():
    costs, kinds = transformer_costs("gpt2-345m", 4)
    p = plan(costs, 4, 8, schedule="wave", kinds=kinds, options={"waves": 1})
    assert p.stages == 8 and p.chunk_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert p.schedule_options == {"waves": 1} and p.to_dict()["options"] == {"waves": 1}
    table = p.table()
    assert "wave waves=1, 8 chunks on 4 ranks" in table and table.splitlines()[1].split()[:2] == ["chunk", "rank"]
    assert p.iteration_time == pytest.approx(simulated(costs, "wave", {"waves": 1}, 4, 8, p.bounds), rel=1e-12)


@pytest.mark.parametrize("ranks,m", [(2, 4), (4, 4), (4, 8), (8, 8)])
def test_auto_picks_the_simulators_fastest_candidate(ranks, m):
    costs, kinds = transformer_costs("gpt2-345m", 4)
    choice = choose_schedule(costs, ranks, m, kinds=kinds)
    # independently: plan each candidate, simulate it with the general simulator, take the fastest
    times = {}
    for schedule, options in CANDIDATES:
        try:
            bounds = plan(costs, ranks, m, schedule=schedule, kinds=kinds, options=options).bounds
        except ValueError:
            continue
        times[(schedule, tuple(sorted(options.items())))] = simulated(costs, schedule, options, ranks, m, bounds)
    fastest = min(times, key=times.get)
    assert (choice.chosen.schedule, choice.chosen.options) == fastest
    assert choice.chosen.iteration_time == pytest.approx(times[fastest], rel=1e-12)
    assert len(choice.candidates) == len(CANDIDATES)
    assert sum(c.verdict == "chosen" for c in choice.candidates) == 1
    assert choice.chosen.name in choice.table() and "chosen" in choice.table()


def test_auto_skips_candidates_over_the_memory_limit():
    costs, kinds = transformer_costs("gpt2-345m", 4)
    free = choose_schedule(costs, 4, 8, kinds=kinds)
    limit = free.chosen.peak_memory * 0.999  # the unconstrained winner no longer fits
    bounded = choose_schedule(costs, 4, 8, kinds=kinds, memory_limit=limit)
    assert bounded.chosen.name != free.chosen.name and bounded.chosen.peak_memory <= limit
    fits = [c for c in free.candidates if c.plan is not None and c.peak_memory <= limit]
    assert bounded.chosen.iteration_time == min(c.iteration_time for c in fits)
    over = [c for c in bounded.candidates if c.verdict == "over the memory limit"]
    assert free.chosen.name in [c.name for c in over]
    assert bounded.to_dict()["memory_limit"] == limit


def test_auto_names_candidates_that_cannot_run():
    costs = CostModel.uniform(10, 1.0, 2.0)
    choice = choose_schedule(costs, 4, 6)  # 6 micro-batches: interleaved needs a multiple of 4
    verdicts = {c.name: c.verdict for c in choice.candidates}
    assert "microbatches=6: interleaved 1F1B needs a multiple of the 4 stages" in verdicts["interleaved chunks=2"]
    assert "more than its 10 blocks" in verdicts["wave waves=2"]  # 16 chunks
    assert choice.chosen.plan is not None


def test_auto_bad_settings_are_clear_errors():
    costs = CostModel.uniform(8, 1.0, 2.0, param_bytes=(1e9,) * 8)
    with pytest.raises(ValueError, match=r"found no candidate that runs within memory_limit=1000.*1f1b: over the memory limit"):
        choose_schedule(costs, 2, 4, memory_limit=1000)
    with pytest.raises(ValueError, match=r"memory_limit=-1: a number of bytes > 0"):
        choose_schedule(costs, 2, 4, memory_limit=-1)
    with pytest.raises(
        ValueError,
        match=r"schedule='wave' with waves=4 on 2 ranks cuts the model into 2 x 2 x 4 = 16 chunks, "
        r"more than its 8 blocks: use waves <= 2",
    ):
        plan(costs, 2, 4, schedule="wave", options={"waves": 4})
    with pytest.raises(ValueError, match=r"schedule='1f1b' takes no option \['chunks'\]"):
        plan(costs, 2, 4, schedule="1f1b", options={"chunks": 2})
