"""PipeDream-2BW's Algorithm 1 as the paper writes it (§4.3): w = 1..N, d = 1..N/w (grids on fewer
than N devices compete), and §4.2.1's time without pipelining; values worked by hand."""

from __future__ import annotations

import pytest

from lightning_pipe.planning.sized import BlockCosts, SizedProfile
from lightning_pipe.planning.two_bw import grids as algorithm1_grids
from lightning_pipe.planning.two_bw import plan_2bw
from lightning_pipe.planning.two_bw_closed import closed_step
from lightning_pipe.planning.two_bw_costs import Hardware

FAST = dict(intra_bandwidth=1e15, inter_bandwidth=1e15, latency=0.0)


def test_grids_loop_as_algorithm_1():
    # w = 1..4, d = 1..floor(4 / w), written out by hand
    paper = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1)]
    assert algorithm1_grids(4, 10) == paper
    assert algorithm1_grids(4, 2) == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (4, 1)]  # d <= blocks
    assert algorithm1_grids(4, 10, every_device=True) == [(1, 4), (2, 2), (4, 1)]  # what a 4-process run can start


def linear_profile(blocks: int = 2) -> SizedProfile:
    """Equal blocks, forward b s and backward 2b s at micro-batch size b: no gain from larger b."""
    sizes = [1, 2, 4]
    rows = lambda f: [[f(s)] * blocks for s in sizes]  # noqa: E731
    return SizedProfile(
        "hand",
        sizes,
        forward=rows(lambda s: float(s)),
        backward=rows(lambda s: 2.0 * s),
        recompute_backward=rows(lambda s: 3.0 * s),
        saved_bytes=rows(lambda s: 10.0 * s),
        input_bytes=rows(lambda s: 1.0 * s),
        output_bytes=rows(lambda s: 1.0 * s),
        param_bytes=[100.0] * blocks,
    )


def test_a_grid_on_fewer_devices_is_planned_when_no_full_grid_is():
    # 3 devices, 2 blocks, B = 4: the full grids are (3, 1) (4 is no multiple of 3) and (1, 3) (3 > 2
    # blocks), so only Algorithm 1's loop finds a configuration: (1, 2) or (2, 1) on 2 devices
    hw = Hardware(3, 3, None, **FAST)
    found = plan_2bw(linear_profile(), hw, 4, schedules=("1f1b",), recompute=("off",), cost_model="closed")
    assert {(c.width, c.depth) for c in found.candidates} == {(1, 1), (1, 2), (2, 1), (3, 1)}
    # by hand: a stage of one block computes 3b per micro-batch, so (1, 2) with g = 4 / b >= 2 takes
    # g x 3b = 12 s per step for 4 samples; (2, 1) the same 12 s plus its all-reduce; (1, 1) 24 s
    c = found.chosen
    assert (c.width, c.depth) == (1, 2) and c.step_time == pytest.approx(12.0)
    assert c.throughput == pytest.approx(4 / 12)
    assert any("leaves 1 of the 3 devices unused" in n for n in found.notes)
    with pytest.raises(ValueError, match="reaches it"):
        plan_2bw(linear_profile(), hw, 4, schedules=("1f1b",), recompute=("off",), cost_model="closed", every_device=True)


def test_one_microbatch_per_step_uses_the_papers_time_without_pipelining():
    # (1, 2) with b = 4, g = 1: nothing overlaps, t = sum over stages = 2 x (3 x 4) = 24 s (the
    # pipelined expression would say max = 12 s)
    hw = Hardware(2, 2, None, **FAST)
    found = plan_2bw(linear_profile(), hw, 4, schedules=("1f1b",), recompute=("off",), cost_model="closed")
    one = next(c for c in found.candidates if (c.width, c.depth, c.microbatch_size) == (1, 2, 4))
    assert one.microbatches == 1 and one.step_time == pytest.approx(24.0)
    two = next(c for c in found.candidates if (c.width, c.depth, c.microbatch_size) == (1, 2, 2))
    assert two.microbatches == 2 and two.step_time == pytest.approx(2 * 6.0)  # pipelined: g x max_i


def test_time_without_pipelining_by_hand():
    # 4 blocks, forward 1, backward 2, outputs 1, 2, 3, 4 bytes, parameters 100 each; bandwidth 2 B/s
    c = BlockCosts(1.0, (1.0,) * 4, (2.0,) * 4, (3.0,) * 4, (10.0,) * 4, (1.0, 2.0, 3.0, 4.0), (1.0, 2.0, 3.0, 4.0), (100.0,) * 4)
    hw = Hardware(4, 4, None, intra_bandwidth=2.0, inter_bandwidth=2.0, latency=0.0)
    # d = 2: each stage computes 2 x 3 = 6 and moves block 1's output and its gradient, 2 x 2 / 2 = 2 s
    assert closed_step(c, 2, 1, 4, False, hw, pipelined=True) == 6.0  # max_i max(6, 2, 0)
    assert closed_step(c, 2, 1, 4, False, hw, pipelined=False) == 16.0  # sum_i max(6 + 2, 0)
    # w = 2: ring all-reduce of a stage's 200 bytes, 2 (2 - 1) / 2 x 200 / 2 / g = 25 s per micro-batch
    assert closed_step(c, 2, 2, 4, False, hw, pipelined=False) == 50.0  # sum_i max(8, 25)
    # recomputation (measured 1 + 3 per block): 8 per stage, + 2 s of messages
    assert closed_step(c, 2, 1, 4, True, hw, pipelined=False) == 20.0
