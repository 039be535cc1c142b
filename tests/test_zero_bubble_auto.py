"""The zero-bubble paper's automatic scheduling heuristic on our simulator: valid, within the memory
limit, the paper's figures on uniform stages, and what it does on uneven ones."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_pipe.config import PipelineConfig
from lightning_pipe.planning.auto import choose_schedule
from lightning_pipe.planning.entry import plan_run
from lightning_pipe.planning.zero_bubble import zero_bubble_auto
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, simulate


def uniform(p):
    """T_F = T_B = T_W = 1 per stage, one activation unit per micro-batch, no weights."""
    return CostModel.uniform(p, 1.0, 2.0, weight=(1.0,) * p, activation_bytes=(1.0,) * p), [(i, i + 1) for i in range(p)]


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("times", [1, 2, 4])
def test_uniform_stages_reach_the_papers_schedules(p, times):
    m = times * p
    costs, bounds = uniform(p)
    zb_h1 = simulate(build_schedule("zb-h1", p, m), costs, bounds).iteration_time
    # with 1F1B's memory (p micro-batches a stage) the heuristic finds ZB-H1's time (p = 8: within 6%) ...
    _, tight = zero_bubble_auto(costs, bounds, m, memory_limit=p + 0.5, weight_copies=0)
    assert max(tight.peak_activations) <= p
    assert tight.iteration_time == zb_h1 if p <= 4 else tight.iteration_time <= 1.06 * zb_h1
    # ... and with twice that (the paper's ZB-H2 budget) the only idle time left is the start-up
    _, loose = zero_bubble_auto(costs, bounds, m, memory_limit=2 * p + 0.5, weight_copies=0)
    assert loose.iteration_time == 3 * m + (p - 1) and max(loose.peak_activations) <= 2 * p


@st.composite
def profiles(draw):
    p = draw(st.integers(1, 5))
    f = [draw(st.sampled_from([0.5, 1.0, 1.5, 2.0])) for _ in range(p)]
    b = [x * draw(st.sampled_from([1.0, 2.0, 3.0])) for x in f]
    w = [x * draw(st.sampled_from([0.0, 0.3, 0.5, 0.9])) for x in b]
    costs = CostModel(tuple(f), tuple(b), activation_bytes=(1.0,) * p, weight=tuple(w), latency=draw(st.sampled_from([0.0, 0.2, 1.0])))
    return costs, [(i, i + 1) for i in range(p)], draw(st.integers(1, 3 * p + 2)), draw(st.sampled_from([1, 2, p, 2 * p, None]))


@settings(deadline=None, max_examples=80)
@given(case=profiles())
@example(  # CI found it: stages 2 and 3 each waited on the other's op (the fallback now runs the known one)
    case=(
        CostModel((0.5, 2.0, 1.5, 0.5, 0.5), (0.5, 2.0, 1.5, 0.5, 0.5), activation_bytes=(1.0,) * 5, weight=(0.0,) * 5),
        [(i, i + 1) for i in range(5)],
        2,
        2,
    )
)
def test_every_schedule_is_valid_and_keeps_the_memory_limit(case):
    costs, bounds, m, limit = case
    schedule, timeline = zero_bubble_auto(costs, bounds, m, memory_limit=None if limit is None else limit + 0.5, weight_copies=0)
    assert schedule.num_microbatches == m  # validated inside; every F, BI and W once
    if limit is not None:
        assert max(timeline.peak_activations) <= limit
    with_h1, t = zero_bubble_auto(costs, bounds, m, memory_limit=None if limit is None else limit + 0.5, weight_copies=0, handcrafted=True)
    assert t.iteration_time <= timeline.iteration_time + 1e-12


def test_on_uneven_stages_the_heuristic_alone_is_not_always_zb_h1():
    # recorded, not hidden: without the paper's ILP pass the heuristic ranges from 6% faster to 17%
    # slower than ZB-H1 on 40 uneven profiles at 1F1B's memory (median 4% slower; docs/guide/schedules.md);
    # `handcrafted=True` (ours) keeps the better of the two
    rng = random.Random(1)
    ratios = []
    for _ in range(40):
        p = rng.choice([2, 3, 4])
        m = 2 * p
        f = tuple(rng.uniform(0.5, 2) for _ in range(p))
        b = tuple(x * rng.uniform(1.5, 2.5) for x in f)
        costs = CostModel(f, b, activation_bytes=(1.0,) * p, weight=tuple(x * rng.uniform(0.2, 0.8) for x in b))
        bounds = [(i, i + 1) for i in range(p)]
        h1 = simulate(build_schedule("zb-h1", p, m), costs, bounds).iteration_time
        _, t = zero_bubble_auto(costs, bounds, m, memory_limit=p + 0.5, weight_copies=0)
        _, best = zero_bubble_auto(costs, bounds, m, memory_limit=p + 0.5, weight_copies=0, handcrafted=True)
        ratios.append(t.iteration_time / h1)
        assert best.iteration_time == min(h1, t.iteration_time)
    ratios.sort()
    assert ratios[0] < 0.95 and ratios[len(ratios) // 2] < 1.05 and ratios[-1] < 1.2


def test_a_memory_limit_below_one_microbatch_is_refused():
    costs = CostModel.uniform(2, 1.0, 2.0, weight=(1.0,) * 2, activation_bytes=(1.0,) * 2, param_bytes=(1.0,) * 2)
    with pytest.raises(ValueError, match="does not hold stage 0..0's weights and one micro-batch"):
        zero_bubble_auto(costs, [(0, 1), (1, 2)], 4, memory_limit=4.5)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12))
def test_the_name_builds_the_heuristic_on_equal_times_within_1f1b_memory(p, m):
    # schedule="zb-auto" without a profile: valid for every depth and count, and it holds at most p
    # micro-batches a stage (1F1B's activations) on equal F / B / W times
    schedule = build_schedule("zb-auto", p, m)
    costs, bounds = uniform(p)
    assert max(simulate(schedule, costs, bounds).peak_activations) <= min(p, m)


def test_a_run_plans_zb_auto_on_its_costs_and_auto_weighs_it():
    # uneven BI / W split: the run's schedule is the heuristic's on these costs (a short run's m too),
    # and schedule="auto" lists it with that schedule's simulated time
    costs = CostModel(
        forward=(1.0,) * 6,
        backward=(2.0,) * 6,
        activation_bytes=(1.0,) * 6,
        param_bytes=(0.0,) * 6,
        weight=(1.0, 1.0, 3.0, 3.0, 0.2, 0.2),
        backward_input=(1.0, 1.0, 0.2, 0.2, 1.0, 1.0),
    )
    result = plan_run(costs, 3, PipelineConfig(schedule="zb-auto", microbatches=6))
    assert result.spec.name == "zb-auto" and result.costed is not None
    for m in (6, 3):
        want, timeline = zero_bubble_auto(costs, result.bounds, m, max_held=3)
        assert result.costed(m).actions == want.actions
    assert result.timeline(costs).iteration_time == zero_bubble_auto(costs, result.bounds, 6, max_held=3)[1].iteration_time
    choice = choose_schedule(costs, 3, 6, method="uniform")
    (listed,) = [c for c in choice.candidates if c.schedule == "zb-auto"]
    assert listed.verdict in ("runs", "chosen")
    assert listed.iteration_time == zero_bubble_auto(costs, tuple(map(tuple, listed.plan.bounds)), 6, max_held=3)[1].iteration_time
