"""PipeDream-2BW's schedule (no processes): the unrolled run validates, the runtime's per-step slices
are exactly that run cut at step boundaries, and the simulator sees no flush between steps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.planning.auto import adam_weight_copies, stage_memory, version_share
from lightning_pipe.schedules import Op, ScheduleSpec, build_schedule, validate
from lightning_pipe.schedules.two_bw import drain_actions, leads, pipedream_2bw, step_actions
from lightning_pipe.simulation import CostModel, simulate

QUICK = dict(deadline=None, database=None, max_examples=80)


@st.composite
def shapes(draw):
    d = draw(st.integers(1, 6))
    m = draw(st.integers(d, 3 * d))
    return d, m, draw(st.integers(1, 5))


@st.composite
def advanced_shapes(draw):
    """A 2BW shape with advance_num: 0 (1F1B's leads) or any of [d - 1, m] (AvgPipe(2BW)'s order)."""
    d, m, k = draw(shapes())
    return d, m, k, draw(st.sampled_from([0, *range(max(d - 1, 1), m + 1)]))


def computes(actions, shift=0):
    return [(a.op, a.microbatch + shift) for a in actions if a.op.is_compute]


@settings(**QUICK)
@given(advanced_shapes())
def test_steps_cut_the_unrolled_run(shape):
    d, m, k, a = shape
    whole = pipedream_2bw(d, m, batches=k, advance_num=a)
    validate(whole)
    assert whole.weight_versions == 2 and whole.num_microbatches == k * m
    ahead = leads(d, m, a)
    if a:  # advance forward propagation: the first stage keeps advance_num forwards ahead, the last none
        assert ahead[0] == a and (d == 1 or ahead[-1] == 0 or a == m)
    slices = [step_actions(d, m, None, ahead)] + [step_actions(d, m, m, ahead)] * (k - 1) + [drain_actions(d, m, ahead)]
    for rank in range(d):
        joined = []
        for t, s in enumerate(slices):
            joined += computes(s.actions[rank], shift=t * m)  # slices number relative to their batch
        assert joined == computes(whole.actions[rank])
        # every rank runs a forward in each step only of that step's batch, and its step ends
        # with the REDUCE of the batch before (none in the fill)
        for t, s in enumerate(slices[:-1]):
            assert all(0 <= a.microbatch < m for a in s.actions[rank] if a.op is Op.FORWARD)
            reduces = [a for a in s.actions[rank] if a.op is Op.REDUCE_GRAD]
            assert reduces == ([] if t == 0 else [s.actions[rank][-1]])
        assert slices[-1].actions[rank][-1].op is Op.REDUCE_GRAD


@settings(**QUICK)
@given(shapes())
def test_only_the_last_gradient_of_a_step_crosses_into_the_next(shape):
    d, m, _ = shape
    steady = step_actions(d, m, m)
    for rank in range(1, d):
        sends = [a for a in steady.actions[rank] if a.op is Op.SEND_GRAD]
        received = {a.microbatch for a in steady.actions[rank - 1] if a.op is Op.RECV_GRAD}
        crossing = [a for a in sends if a.microbatch not in received]
        assert crossing == [sends[-1]]
        # ... and the neighbour takes it first thing in its next step (as the previous batch's)
        first = next(a for a in steady.actions[rank - 1] if a.op is Op.RECV_GRAD)
        assert first.microbatch == sends[-1].microbatch - m


@pytest.mark.parametrize("d,m", [(2, 2), (4, 4), (4, 8), (8, 8)])
def test_the_steady_step_has_no_flush(d, m):
    """Uniform stages, no communication: a steady 2BW step takes m (f + b), where a flushing 1F1B
    step takes (m + d - 1)(f + b) (PipeDream-2BW §3.2 / the closed form of DESIGN.md)."""
    costs = CostModel.uniform(d, 1.0, 2.0)
    bounds = [(i, i + 1) for i in range(d)]
    steady = (
        simulate(pipedream_2bw(d, m, batches=6), costs, bounds).iteration_time
        - simulate(pipedream_2bw(d, m, batches=5), costs, bounds).iteration_time
    )
    flush = simulate(build_schedule("1f1b", d, m), costs, bounds).iteration_time
    assert steady == pytest.approx(m * 3.0)
    assert flush == pytest.approx((m + d - 1) * 3.0)


def test_2bw_holds_two_weight_versions_in_the_memory_model():
    costs = CostModel.uniform(4, 1.0, 2.0, param_bytes=(10.0,) * 4)
    bounds = [(i, i + 1) for i in range(4)]
    two_bw = simulate(ScheduleSpec.of("2bw").build(4, 4), costs, bounds)
    flush = simulate(build_schedule("1f1b", 4, 4), costs, bounds)
    assert two_bw.weight_bytes == [20.0] * 4 and flush.weight_bytes == [10.0] * 4
    assert two_bw.peak_activations == flush.peak_activations == [4, 3, 2, 1]
    # a rank's peak: the second version adds its weights (a shard of them under FSDP2), not gradients or Adam's state
    acts = [a for a in two_bw.peak_activation_bytes]
    assert stage_memory(two_bw, 4.0) == [10.0 * 5 + a for a in acts]
    assert stage_memory(flush, 4.0) == [10.0 * 4 + a for a in flush.peak_activation_bytes]
    full = adam_weight_copies("full", 2)
    assert stage_memory(two_bw, full, 0.0, version_share("full", 2)) == [10.0 * (full + 0.5) + a for a in acts]


def test_fewer_microbatches_than_stages_is_refused():
    with pytest.raises(ValueError, match=r"microbatches=3 is fewer than the 4 stages"):
        ScheduleSpec.of("2bw").build(4, 3)
