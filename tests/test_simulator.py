"""The simulator replays the runtime's own action lists; closed forms and AutoPipe's definitions hold."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import Op, build_schedule, forward_only
from lightning_pipe.simulation import CostModel, simulate


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


# ---- shared cores (CostModel.cores): processor sharing --------------------------------------------


def compute_spans(t):
    return {(e.rank, e.action.chunk, e.action.microbatch, e.action.op.value): (e.start, e.end) for e in t.computes()}


def test_two_ranks_overlapping_on_one_core_take_twice_as_long():
    # forward-only, 2 stages, f = 1 each, no communication. Rank 0's F(mb1) and rank 1's F(mb0)
    # both run in [1, ...): on 1 core each gets half of it, so both end at 1 + 2 * 1 = 3.
    t = simulate(forward_only(2, 2), CostModel.uniform(2, 1.0, 1.0, cores=1), one_block_per_stage(2))
    spans = compute_spans(t)
    assert spans[(0, 0, 0, "F")] == pytest.approx((0.0, 1.0))  # alone: full speed
    assert spans[(0, 0, 1, "F")] == pytest.approx((1.0, 3.0))  # shared: twice as long
    assert spans[(1, 1, 0, "F")] == pytest.approx((1.0, 3.0))
    assert spans[(1, 1, 1, "F")] == pytest.approx((3.0, 4.0))
    assert t.iteration_time == pytest.approx(4.0) and t.busy == pytest.approx([3.0, 3.0])
    # with a core per rank the overlap costs nothing: (m + p - 1) f
    own = simulate(forward_only(2, 2), CostModel.uniform(2, 1.0, 1.0, cores=2), one_block_per_stage(2))
    assert own.iteration_time == pytest.approx(3.0)


def test_three_ranks_on_two_cores_run_at_two_thirds():
    # forward-only, 3 stages, m = 3, f = 1: [0,1] rank 0 alone; [1,2] two ranks on two cores (speed 1);
    # from 2 all three ranks compute: speed 2/3, so 1 s of work takes 1.5 s -> 3.5; then two ranks
    # (speed 1) until 4.5, then the last stage alone until 5.5 (instead of (m + p - 1) f = 5).
    t = simulate(forward_only(3, 3), CostModel.uniform(3, 1.0, 1.0, cores=2), one_block_per_stage(3))
    spans = compute_spans(t)
    assert spans[(0, 0, 2, "F")] == pytest.approx((2.0, 3.5))
    assert spans[(1, 1, 1, "F")] == pytest.approx((2.0, 3.5))
    assert spans[(2, 2, 0, "F")] == pytest.approx((2.0, 3.5))
    assert spans[(2, 2, 2, "F")] == pytest.approx((4.5, 5.5))
    assert t.iteration_time == pytest.approx(5.5)


def test_speed_changes_in_the_middle_of_a_compute():
    # 2 stages on 1 core, f = 1, latency 0.5. Rank 0: F(mb0) [0, 1] alone; F(mb1) from 1, alone
    # until rank 1's input lands at 1.5 (0.5 done), then both at half speed: rank 0's remaining 0.5
    # takes 1 -> ends at 2.5, when rank 1 has done 0.5 of F(mb0); alone again, it ends at 3.0;
    # F(mb1)'s input lands at 2.5 + 0.5 = 3.0, so it runs [3, 4].
    costs = CostModel.uniform(2, 1.0, 1.0, cores=1, latency=0.5)
    spans = compute_spans(t := simulate(forward_only(2, 2), costs, one_block_per_stage(2)))
    assert spans[(0, 0, 1, "F")] == pytest.approx((1.0, 2.5))
    assert spans[(1, 1, 0, "F")] == pytest.approx((1.5, 3.0))
    assert spans[(1, 1, 1, "F")] == pytest.approx((3.0, 4.0))
    assert t.iteration_time == pytest.approx(4.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 8)])
def test_one_core_serialises_the_pipeline(name, p, m):
    # no communication and one core: some compute is always ready and the core is never idle, so
    # the iteration is all the work, m * sum(f + b), whatever the stages' imbalance
    import random

    rng = random.Random(p * 100 + m)
    f = tuple(rng.uniform(0.5, 2) for _ in range(p))
    b = tuple(rng.uniform(0.5, 4) for _ in range(p))
    t = simulate(build_schedule(name, p, m), CostModel(f, b, cores=1), one_block_per_stage(p))
    assert t.iteration_time == pytest.approx(m * (sum(f) + sum(b)))
    path = t.critical_path
    assert path[-1].end == pytest.approx(t.iteration_time)
    assert all(prev.end <= nxt.start + 1e-9 for prev, nxt in zip(path, path[1:]))


def test_enough_cores_is_the_same_as_no_cores_model():
    costs = dict(forward=(1.0, 2.0, 1.5), backward=(2.0, 3.0, 2.5), activation_bytes=(8.0,) * 3, bandwidth=16.0, latency=0.1)
    schedule, bounds = build_schedule("1f1b", 3, 6), one_block_per_stage(3)
    base = simulate(schedule, CostModel(**costs), bounds)
    for cores in (3, 4):
        t = simulate(schedule, CostModel(**costs, cores=cores), bounds)
        assert t.iteration_time == base.iteration_time and t.master_stage == base.master_stage
    shared = simulate(schedule, CostModel(**costs, cores=2), bounds)
    # sharing only slows computes down, and no faster than the machine's floor
    assert shared.iteration_time > base.iteration_time
    assert shared.iteration_time >= 6 * (sum(costs["forward"]) + sum(costs["backward"])) / 2


def test_replay_falls_back_to_simulate_with_shared_cores():
    import random

    from lightning_pipe.planning.replay import compiled

    rng = random.Random(1)
    for _ in range(40):
        name, p, m = rng.choice(["1f1b", "gpipe"]), rng.randint(2, 4), rng.randint(1, 6)
        n = rng.randint(p, 7)
        costs = CostModel(
            tuple(rng.random() for _ in range(n)),
            tuple(2 * rng.random() for _ in range(n)),
            activation_bytes=(1.0,) * n,
            bandwidth=rng.uniform(1, 5),
            latency=rng.uniform(0, 0.1),
            cores=rng.randint(1, p - 1),
        )
        cuts = sorted(rng.sample(range(1, n), p - 1))
        bounds = tuple(zip([0] + cuts, cuts + [n]))
        timeline = simulate(build_schedule(name, p, m), costs, bounds)
        replay = compiled(name, p, m)
        assert replay.run(costs, bounds) == (timeline.iteration_time, timeline.master_stage)
        assert replay.iteration_time(costs, bounds) == replay.iteration_times(costs, [bounds])[0] == timeline.iteration_time
        assert replay.lower_bound(costs, bounds) <= timeline.iteration_time * (1 + 1e-12)


@pytest.mark.parametrize("cores", [0, -1, 1.5])
def test_bad_cores_are_clear_errors(cores):
    with pytest.raises(ValueError, match="cores must be None or an integer >= 1"):
        CostModel.uniform(2, 1.0, 1.0, cores=cores)


# ---- the executor's trace: a compute's clock starts once its input is there ---------------------


class _SlowWork:
    """A receive that completes `delay` seconds after it is waited for (the peer is late)."""

    def __init__(self, delay: float, log: list):
        self.delay, self.log = delay, log

    def wait(self) -> None:
        import time

        time.sleep(self.delay)
        self.log.append(time.perf_counter())  # the moment the data is there


class _LateTransport:
    """Transport stand-in for one rank: sends vanish, every receive arrives late."""

    def __init__(self, delay: float):
        import torch

        self.device, self.delay, self.arrived = torch.device("cpu"), delay, []

    def send_activation(self, peer, chunk, key, value):
        return []

    def send_gradients(self, peer, grads):
        return []

    def needs_header(self, peer, chunk, key):
        return False

    def recv_activation(self, peer, chunk, key):
        import torch

        from lightning_pipe.runtime.p2p import ActivationSpec, PendingRecv

        spec = ActivationSpec.of(torch.zeros(3, requires_grad=True))
        return PendingRecv([torch.ones(3)], spec), ["recv"]

    def recv_gradients(self, peer, like):
        import torch

        from lightning_pipe.runtime.p2p import PendingRecv

        return PendingRecv([torch.ones_like(t) for t in like], None), ["recv"]

    def issue(self, ops):
        return [_SlowWork(self.delay, self.arrived) for _ in ops]

    def release_headers(self):
        pass


class _TinyHost:
    def __init__(self, last_chunk: int):
        import torch

        self.last_chunk, self.w = last_chunk, torch.ones(3, requires_grad=True)

    def forward(self, chunk, microbatch, inputs):
        x = self.w * 2.0 if inputs is None else inputs * self.w
        return x.sum() if chunk == self.last_chunk else x

    def reduce_gradients(self, chunk):
        pass


@pytest.mark.parametrize("rank", [0, 1])
def test_trace_counts_the_wait_for_input_as_idle_not_compute(rank):
    # 1F1B on 2 ranks, run on one rank whose peer is late by `delay` for every message: rank 1 waits
    # before each forward (activation), rank 0 before each backward (gradient). The computes
    # themselves take microseconds, so a traced compute must be far shorter than the wait, and
    # start only once its data arrived.
    from lightning_pipe.runtime.executor import Executor

    delay, m = 0.03, 3
    schedule = build_schedule("1f1b", 2, m)
    transport = _LateTransport(delay)
    executor = Executor(schedule, rank, transport, prefetch=True, trace=True)
    executor.run(_TinyHost(1), keys=list(range(m)))
    computes = [(schedule.actions[rank][i], s, e) for i, s, e in executor.records if schedule.actions[rank][i].op.is_compute]
    waiting = [(a, s, e) for a, s, e in computes if (a.op is Op.FORWARD and a.chunk == 1) or (a.op is Op.BACKWARD and a.chunk == 0)]
    assert len(computes) == 2 * m and len(waiting) == m == len(transport.arrived)
    assert all(e - s < delay / 3 for _, s, e in computes)
    # the k-th receive waited for feeds the k-th compute that consumes one (list order)
    assert all(s >= arrived for (_, s, _), arrived in zip(waiting, transport.arrived))


def test_chunk_costs_sums_each_range_and_a_replaced_model_sums_its_own():
    # chunk_costs keeps a range's sums on the cost model: they must be the plain sums of that
    # model's blocks, and a model made with dataclasses.replace (as MessageCosts.apply does) must
    # not see the sums of the one it was made from
    import dataclasses

    from lightning_pipe.simulation import chunk_costs

    costs = CostModel((1.0, 2.0, 4.0, 8.0), (3.0, 5.0, 7.0, 9.0), activation_bytes=(10.0, 20.0, 30.0, 40.0), bandwidth=10.0)
    for _ in range(2):  # the second call reads what the first kept
        assert chunk_costs(costs, [(0, 1), (1, 3), (3, 4)]) == ([1.0, 6.0, 8.0], [3.0, 12.0, 9.0], [1.0, 3.0, 4.0])
    slower = dataclasses.replace(costs, forward=(2.0, 2.0, 2.0, 2.0), latency=1.0)
    assert chunk_costs(slower, [(0, 1), (1, 3), (3, 4)]) == ([2.0, 4.0, 2.0], [3.0, 12.0, 9.0], [2.0, 4.0, 5.0])
    assert chunk_costs(costs, [(0, 2), (2, 4)])[0] == [3.0, 12.0]
