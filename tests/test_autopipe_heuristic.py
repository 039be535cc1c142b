"""AutoPipe's heuristic (paper §III-B 2)) on hand-worked cases: Algorithm 1's split alone is not the
fastest, and rule (1) or the master-stage moves (or both) find the faster split.

No communication, backward = 2 x forward unless said, 1F1B; weights are f + b per block. Each case
was checked to fail with rule (1)'s adjustment removed (`rule_one_steps` yielding nothing) or with
the master-stage moves removed (`master_moves` returning []), as the comments say.
"""

from __future__ import annotations

import pytest

from lightning_pipe.planning import PARTITIONERS, plan
from lightning_pipe.planning.heuristic import autopipe_search, master_moves, rule_one, rule_one_steps
from lightning_pipe.planning.minmax import MinMaxTable, min_max_bounds
from lightning_pipe.planning.replay import Evaluator
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, simulate


def costs_of(forward, backward=None) -> CostModel:
    backward = backward or [2 * f for f in forward]
    return CostModel(tuple(map(float, forward)), tuple(map(float, backward)))


def simulated(costs: CostModel, stages: int, microbatches: int, bounds):
    timeline = simulate(build_schedule("1f1b", stages, microbatches), costs, bounds)
    return timeline.iteration_time, timeline.master_stage


# ---- the steps on their own ---------------------------------------------------------------------


def test_rule_one_hands_the_excess_of_a_stage_after_the_master_to_the_next_stage():
    # master stage 0 with b_0 = 6; stage 1 holds 7 blocks of f + b = 1 > 1 x 6, so its last block
    # goes to stage 2; the rule then holds for s = 1 (6 <= 6) and the last stage is left as it is
    weights = [9.0] + [1.0] * 8
    backward = [6.0] + [0.5] * 8
    assert rule_one(((0, 1), (1, 8), (8, 9)), 0, weights, backward) == ((0, 1), (1, 7), (7, 9))
    # a split that satisfies rule (1) is not touched (the adjustment changes only what violates it)
    assert rule_one(((0, 1), (1, 3), (3, 9)), 0, weights, backward) == ((0, 1), (1, 3), (3, 9))


def test_rule_one_goes_stage_by_stage_so_the_search_can_stop_when_the_master_changes():
    # master 0, b_0 = 4; stages 1 and 2 each exceed the running limit: two steps, one per stage
    weights = [6.0, 3.0, 3.0, 3.0, 3.0, 1.0, 1.0]
    backward = [4.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.5]
    steps = list(rule_one_steps(((0, 1), (1, 3), (3, 5), (5, 7)), 0, weights, backward))
    # stage 1: 6 > 1 x 4 -> block 1 alone (3); stage 2: 3 + 9 = 12 > 2 x 4 -> block 2 alone (3 + 3 <= 8)
    assert steps == [((0, 1), (1, 2), (2, 5), (5, 7)), ((0, 1), (1, 2), (2, 3), (3, 7))]


def test_master_moves_are_the_papers_four_candidates():
    weights = [1.0, 3.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0]
    table = MinMaxTable(weights, 4)
    bounds = ((0, 1), (1, 2), (2, 7), (7, 8))  # master stage 2 holds blocks 2..6
    assert master_moves(bounds, 2, table) == [
        ((0, 1), (1, 3), (3, 7), (7, 8)),  # its first block (2) to stage 1, as is
        ((0, 2), (2, 3), (3, 7), (7, 8)),  # ... with Algorithm 1 over stages 0..1 on blocks 0..2 (max 4 -> 3)
        ((0, 1), (1, 2), (2, 6), (6, 8)),  # its last block (6) to stage 3, as is
        ((0, 2), (2, 5), (5, 6), (6, 8)),  # ... with Algorithm 1 over stages 0..2 on blocks 0..5
    ]
    # one stage before the master: Algorithm 1 over it changes nothing, so no duplicate candidate
    assert master_moves(((0, 2), (2, 5), (5, 7)), 1, MinMaxTable(weights[:7], 3))[:1] == [((0, 3), (3, 5), (5, 7))]
    assert master_moves(bounds, 0, table) == []  # at i == 0 the paper stops


# ---- hand-worked cases where Algorithm 1 alone is not the fastest --------------------------------


def test_rule_one_makes_the_stage_after_the_master_light():
    # weights f + b = 12 12 9 12 6 12; Algorithm 1 (4 stages, V = 21, filled from the front):
    # [12] [12 9] [12 6] [12]; stage 1 (f + b = 21, b = 14) is the master. Rule (1) at s = 2:
    # 18 > 14, so stage 2 hands its last block (6) to stage 3: [12] [12 9] [12] [6 12], 2 ms faster.
    # Without rule (1) the search stays at Algorithm 1's 200.
    costs = costs_of([4, 4, 3, 4, 2, 4])
    start = min_max_bounds([f + b for f, b in zip(costs.forward, costs.backward)], 4)
    assert start == ((0, 1), (1, 3), (3, 5), (5, 6))
    assert simulated(costs, 4, 8, start) == (200.0, 1)
    found = PARTITIONERS["autopipe"](costs, 4, 8)
    assert found == ((0, 1), (1, 3), (3, 4), (4, 6))
    assert simulated(costs, 4, 8, found)[0] == 198.0


def test_moving_the_masters_last_block_forward_beats_algorithm_1():
    # weights 12 6 12 6 3; Algorithm 1 (3 stages, V = 18): [12 6] [12 6] [3], master stage 1.
    # Rule (1) holds already (3 <= b_1 = 12). Step 3 moves stage 1's last block to stage 2:
    # [12 6] [12] [6 3] -> 81 instead of 90. Without the master moves the search returns 90.
    costs = costs_of([4, 2, 4, 2, 1])
    start = PARTITIONERS["dp"](costs, 3, 4)
    assert start == ((0, 2), (2, 4), (4, 5))
    assert simulated(costs, 3, 4, start) == (90.0, 1)
    found = PARTITIONERS["autopipe"](costs, 3, 4)
    assert found == ((0, 2), (2, 3), (3, 5))
    assert simulated(costs, 3, 4, found)[0] == 81.0


def test_rule_one_and_the_master_moves_together():
    # weights 9 12 9 6 6 3; Algorithm 1 (3 stages, V = 21): [9 12] [9 6 6] [3], 210. The fastest the
    # heuristic reaches, 199, needs both steps: without rule (1) it stops at 200, without the
    # master-stage moves at 210 (Algorithm 1's split).
    costs = costs_of([3, 4, 3, 2, 2, 1])
    assert PARTITIONERS["dp"](costs, 3, 9) == ((0, 2), (2, 5), (5, 6))
    assert simulated(costs, 3, 9, ((0, 2), (2, 5), (5, 6)))[0] == 210.0
    found = PARTITIONERS["autopipe"](costs, 3, 9)
    assert found == ((0, 2), (2, 3), (3, 6))
    assert simulated(costs, 3, 9, found)[0] == 199.0


def test_autopipe_returns_the_fastest_split_it_simulated_never_worse_than_algorithm_1():
    for forward, p, m in (([4, 4, 3, 4, 2, 4], 4, 8), ([4, 2, 4, 2, 1], 3, 4), ([3, 4, 3, 2, 2, 1], 3, 9)):
        costs = costs_of(forward)
        ev = Evaluator(costs, "1f1b", p, m)
        found = autopipe_search(ev, p)
        assert ev.time(found) == min(ev._time.values())  # step 4): the minimum over every split simulated
        assert ev.time(found) < ev.time(PARTITIONERS["dp"](costs, p, m))


# ---- ours beside the paper's ----------------------------------------------------------------------


def test_autopipe_refine_starts_from_the_papers_result_and_is_never_slower():
    for forward, p, m in (([4, 4, 3, 4, 2, 4], 4, 8), ([4, 2, 4, 2, 1], 3, 4), ([3, 4, 3, 2, 2, 1], 3, 9)):
        costs = costs_of(forward)
        paper, ours = plan(costs, p, m, "autopipe"), plan(costs, p, m, "autopipe+refine")
        assert ours.method == "autopipe+refine"
        assert ours.iteration_time <= paper.iteration_time


@pytest.mark.parametrize("method", ["autopipe", "autopipe+refine"])
def test_both_methods_plan_multichunk_schedules(method):
    costs = costs_of([3, 4, 3, 2, 2, 1, 2, 3])
    p = plan(costs, 2, 4, method, schedule="interleaved", options={"chunks": 2})
    assert p.stages == 4 and p.iteration_time <= plan(costs, 2, 4, "dp", schedule="interleaved", options={"chunks": 2}).iteration_time
