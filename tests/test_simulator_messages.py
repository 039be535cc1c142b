"""The simulator's message terms (`CostModel.send_overhead`, `recv_overhead`, `handoff_delay`) on
cases worked by hand, and their effect on what the planners see."""

from __future__ import annotations

import pytest

from lightning_pipe.planning.auto import choose_schedule
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, simulate

MESSAGES = dict(send_overhead=0.1, recv_overhead=0.05, handoff_delay=0.2)


def test_one_f_one_b_two_ranks_by_hand():
    # 1F1B, 2 ranks, 2 micro-batches, F = 1, B = 2 per stage, no latency. By hand:
    # rank 0: F0 0-1, send (thread to 1.1, arrives 1.3), F1 1.1-2.1, send (2.2, arrives 2.4)
    # rank 1: recv; F0 starts max(0.05, 1.3) = 1.3, ends 2.3; B0 2.3-4.3; send grad (4.4, arrives 4.6);
    #         recv; F1 starts max(4.3 + 0.1 + 0.05, 2.4) = 4.45, ends 5.45; B1 5.45-7.45; send (7.55, 7.75)
    # rank 0: B0 starts max(2.1 + 0.1 + 0.05, 4.6) = 4.6, ends 6.6; B1 starts max(6.65, 7.75) = 7.75, ends 9.75
    costs = CostModel.uniform(2, 1.0, 2.0, **MESSAGES)
    timeline = simulate(build_schedule("1f1b", 2, 2), costs, [(0, 1), (1, 2)])
    assert timeline.iteration_time == pytest.approx(9.75, abs=1e-12)
    starts = {(e.rank, e.action.op.name, e.action.microbatch): e.start for e in timeline.computes()}
    assert starts[(1, "FORWARD", 1)] == pytest.approx(4.45, abs=1e-12)  # the thread's time on messages delays the compute
    assert starts[(0, "BACKWARD", 0)] == pytest.approx(4.6, abs=1e-12)  # the hand-off delay delays the receiver
    assert timeline.busy == pytest.approx([6.0, 6.0])  # message time is not compute


@pytest.mark.parametrize("term", sorted(MESSAGES))
def test_each_term_counts(term):
    plain = CostModel.uniform(4, 1.0, 2.0)
    schedule = build_schedule("1f1b", 2, 4)
    with_term = CostModel.uniform(4, 1.0, 2.0, **{term: MESSAGES[term]})
    base = simulate(schedule, plain, [(0, 2), (2, 4)]).iteration_time
    assert simulate(schedule, with_term, [(0, 2), (2, 4)]).iteration_time > base


def test_a_schedule_with_more_messages_pays_more():
    # interleaved v = 2 sends twice the messages of 1F1B on the same ranks: with no message costs it
    # is faster (a smaller bubble), with costs large enough it must lose its lead
    plain = CostModel.uniform(8, 1.0, 2.0)
    heavy = CostModel.uniform(8, 1.0, 2.0, send_overhead=0.5, recv_overhead=0.5, handoff_delay=1.0)
    one = [(0, 4), (4, 8)]
    two = [(0, 2), (2, 4), (4, 6), (6, 8)]
    schedules = build_schedule("1f1b", 2, 2), build_schedule("interleaved", 2, 2, chunks=2)
    assert simulate(schedules[1], plain, two).iteration_time < simulate(schedules[0], plain, one).iteration_time
    assert simulate(schedules[1], heavy, two).iteration_time > simulate(schedules[0], heavy, one).iteration_time
    # and `auto`, which asks the same simulator, changes its pick accordingly
    candidates = [("1f1b", {}), ("interleaved", {"chunks": 2})]
    assert choose_schedule(plain, 2, 2, method="uniform", candidates=candidates).chosen.schedule == "interleaved"
    assert choose_schedule(heavy, 2, 2, method="uniform", candidates=candidates).chosen.schedule == "1f1b"


@pytest.mark.parametrize("field", sorted(MESSAGES))
@pytest.mark.parametrize("value", [-1e-6, float("nan"), float("inf")])
def test_bad_message_costs_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        CostModel.uniform(2, 1.0, 2.0, **{field: value})


def test_delays_drawn_per_message():
    # a constant draw is the mean hand-off delay by another road; a draw that alternates 0 and 0.4
    # (mean 0.2) lands every other message late, and the replay sees each message's own delay
    import itertools

    schedule = build_schedule("1f1b", 2, 2)
    bounds = [(0, 1), (1, 2)]
    plain = CostModel.uniform(2, 1.0, 2.0, send_overhead=0.1, recv_overhead=0.05)
    mean = simulate(schedule, CostModel.uniform(2, 1.0, 2.0, **MESSAGES), bounds)
    assert simulate(schedule, plain, bounds, delays=lambda: 0.2).iteration_time == pytest.approx(mean.iteration_time, abs=1e-12)
    draws = itertools.cycle([0.0, 0.4])
    alternating = simulate(schedule, plain, bounds, delays=lambda: next(draws))
    sends = sorted((e for e in alternating.events if e.action.op.is_send), key=lambda e: e.start)
    assert [round(e.end - e.start, 12) for e in sends] == [0.0, 0.4, 0.0, 0.4]  # rank order of issue: F0, F1 (rank 0), then rank 1's
    # rank 1's first forward: rank 0's F0 ends at 1, its send leaves at 1.1 (thread time) and, drawn 0,
    # arrives at once (the mean's 0.2 made it 1.3, as in the hand-worked case above)
    starts = {(e.rank, e.action.op.name, e.action.microbatch): e.start for e in alternating.computes()}
    assert starts[(1, "FORWARD", 0)] == pytest.approx(1.1, abs=1e-12)


def test_handoff_sampler_follows_the_measured_quantiles():
    import random
    import statistics

    from lightning_pipe.profiling.messages import MessageCosts

    # hand-offs 100..300 us evenly (quantiles 0, 5, ..., 100%); the model already charges 50 us
    # (send overhead 40 us + latency 10 us) of each, so draws are the rest: 50..250 us, mean 150 us
    quantiles = tuple(100e-6 + 200e-6 * k / 20 for k in range(21))
    measured = MessageCosts(40e-6, 0.0, 200e-6, quantiles, 0, 1e-3, 100, 0.1)
    draw = measured.handoff_sampler(CostModel.uniform(2, 1.0, 2.0, latency=10e-6), random.Random(1))
    xs = [draw() for _ in range(20000)]
    assert min(xs) >= 50e-6 - 1e-12 and max(xs) <= 250e-6 + 1e-12
    assert statistics.fmean(xs) == pytest.approx(150e-6, rel=0.02)
    assert statistics.quantiles(xs, n=4)[0] == pytest.approx(100e-6, rel=0.05)  # uniform: the first quartile at 25%
