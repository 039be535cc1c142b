"""The simulator replays the runtime's own action lists; closed forms and AutoPipe's definitions hold."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import Op, build_schedule, forward_only
from lightning_pipe.simulator import CostModel, simulate


def one_block_per_stage(p):
    return [(i, i + 1) for i in range(p)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (3, 5), (4, 8), (8, 3)])
def test_closed_form_uniform_stages_no_communication(name, p, m):
    f, b = 1.5, 2.5
    t = simulate(build_schedule(name, p, m), CostModel.uniform(p, f, b), one_block_per_stage(p))
    assert t.iteration_time == pytest.approx((m + p - 1) * (f + b))
    assert t.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert t.startup == pytest.approx((p - 1) * f)
    assert t.busy == pytest.approx([m * (f + b)] * p)


def test_memory_1f1b_stashes_depth_minus_rank_gpipe_all():
    p, m = 4, 8
    costs = CostModel.uniform(p, 1, 2, activation_bytes=(10.0,) * p, param_bytes=(5.0,) * p)
    one = simulate(build_schedule("1f1b", p, m), costs, one_block_per_stage(p))
    gp = simulate(build_schedule("gpipe", p, m), costs, one_block_per_stage(p))
    assert one.peak_activations == [4, 3, 2, 1] and gp.peak_activations == [8] * 4
    assert one.peak_activation_bytes == [40.0, 30.0, 20.0, 10.0] and one.weight_bytes == [5.0] * 4


def test_communication_adds_latency_and_transfer_time_per_hop():
    p, m, f, b = 2, 1, 1.0, 2.0
    costs = CostModel.uniform(p, f, b, activation_bytes=(100.0,) * p, bandwidth=50.0, latency=0.5)
    t = simulate(build_schedule("1f1b", p, m), costs, one_block_per_stage(p))
    hop = 0.5 + 100.0 / 50.0
    assert t.iteration_time == pytest.approx(2 * (f + b) + 2 * hop)


def test_slowdown_scales_a_ranks_compute():
    t = simulate(build_schedule("gpipe", 2, 1), CostModel.uniform(2, 1.0, 1.0, slowdown=(1.0, 3.0)), one_block_per_stage(2))
    assert t.busy == pytest.approx([2.0, 6.0]) and t.iteration_time == pytest.approx(8.0)


def test_master_stage_is_the_heaviest_stage_in_1f1b_phase():
    # stage 1 of 4 is twice as heavy: it drives the 1F1B phase
    costs = CostModel((1, 2, 1, 1), (2, 4, 2, 2))
    t = simulate(build_schedule("1f1b", 4, 8), costs, one_block_per_stage(4))
    assert t.master_stage == 1
    # the critical path is a chain of computes that ends at the last compute
    path = t.critical_path
    assert path[-1].end == pytest.approx(t.iteration_time)
    assert all(e.action.op.is_compute for e in path)
    assert all(prev.end <= nxt.start + 1e-12 for prev, nxt in zip(path, path[1:]))


def test_uniform_master_stage_is_the_last_stage():
    t = simulate(build_schedule("1f1b", 4, 8), CostModel.uniform(4, 1, 2), one_block_per_stage(4))
    assert t.master_stage == 3


def test_forward_only_schedule():
    t = simulate(forward_only(3, 4), CostModel.uniform(3, 1.0, 9.0), one_block_per_stage(3))
    assert t.iteration_time == pytest.approx(4 + 2)
    assert not any(e.action.op is Op.BACKWARD for e in t.events)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(forward=(1.0, -1.0), backward=(1.0, 1.0)), "forward must hold finite numbers >= 0"),
        (dict(forward=(1.0, float("nan")), backward=(1.0, 1.0)), "forward must hold finite numbers >= 0"),
        (dict(forward=(1.0,), backward=(1.0, 1.0)), "one time per block"),
        (dict(forward=(1.0, 1.0), backward=(1.0, 1.0), activation_bytes=(1.0,)), "activation_bytes has 1 entries for 2 blocks"),
    ],
)
def test_bad_costs_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)


def test_partition_must_cover_the_costed_blocks():
    with pytest.raises(ValueError, match="covers blocks 0..2 but the costs have 4 blocks"):
        simulate(build_schedule("1f1b", 2, 2), CostModel.uniform(4, 1, 1), [(0, 1), (1, 3)])


@pytest.mark.parametrize("bounds", [[(0, 3), (2, 4)], [(0, 1), (2, 4)], [(0, 0), (0, 4)]])
def test_partition_must_be_contiguous_and_non_empty(bounds):
    with pytest.raises(ValueError, match="contiguous, non-empty block ranges"):
        simulate(build_schedule("1f1b", 2, 2), CostModel.uniform(4, 1, 1), bounds)
