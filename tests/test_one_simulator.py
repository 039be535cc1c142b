"""One simulator: the planners' compiled replay (`planning/replay.py`) gives `simulate`'s iteration
time and master stage exactly, on every schedule in SCHEDULES, for random costs and partitions.

The replay takes its chunk costs, input dependencies, critical path and master-stage rule from
`simulator.py`; only its loops are its own, and this checks them float for float (==, no
tolerance: both do the same float operations in the same order)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pipe.planning.replay import Evaluator, cached_schedule, compiled
from lightning_pipe.schedules import SCHEDULES, chunk_count
from lightning_pipe.simulation import CostModel, simulate

# zeros and repeated values make ties, which exercise the tie rules of the critical path
times = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False))


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    p = draw(st.integers(1, 4))
    options: dict[str, int] = {}
    if name == "interleaved":
        options["chunks"] = draw(st.integers(1, 3))
        m = p * draw(st.integers(1, 3))  # interleaved 1F1B needs a multiple of the stages
    elif name == "wave":
        options["waves"] = draw(st.integers(1, 2))
        m = draw(st.integers(1, 6))
    elif name == "2bw":
        m = draw(st.integers(p, 8))  # PipeDream-2BW needs m >= stages
    else:
        m = draw(st.integers(1, 8))
    chunks = chunk_count(name, p, **options)
    n = chunks + draw(st.integers(0, 4))
    forward = tuple(draw(st.lists(times, min_size=n, max_size=n)))
    backward = tuple(draw(st.lists(times, min_size=n, max_size=n)))
    kwargs = {}
    if draw(st.booleans()):
        kwargs.update(
            activation_bytes=tuple(draw(st.lists(times, min_size=n, max_size=n))),
            bandwidth=draw(st.floats(0.1, 100.0)),
            latency=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
        )
    if draw(st.booleans()):
        kwargs["slowdown"] = tuple(draw(st.lists(st.floats(0.25, 4.0), min_size=p, max_size=p)))
    if draw(st.booleans()):  # messages take the ranks' threads' time, and a hand-off delay
        kwargs.update(
            send_overhead=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5))),
            recv_overhead=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5))),
            handoff_delay=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
        )
    if p > 1 and draw(st.integers(0, 9)) == 0:
        kwargs["cores"] = draw(st.integers(1, p))  # shared cores: the replay hands over to `simulate`
    costs = CostModel(forward, backward, **kwargs)
    partitions = []
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(draw(st.lists(st.integers(1, max(1, n - 1)), min_size=chunks - 1, max_size=chunks - 1, unique=True)))
        partitions.append(tuple(zip([0, *cuts], [*cuts, n])))
    return name, p, m, tuple(sorted(options.items())), costs, partitions


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_replay_is_simulate_on_every_schedule(case):
    name, p, m, options, costs, partitions = case
    schedule = cached_schedule(name, p, m, options)
    replay = compiled(name, p, m, options)
    evaluator = Evaluator(costs, name, p, m, dict(options))
    timelines = [simulate(schedule, costs, bounds) for bounds in partitions]
    batch = replay.iteration_times(costs, partitions)  # the numpy path, one column per partition
    assert batch == evaluator.times(partitions) == [t.iteration_time for t in timelines]
    for bounds, timeline in zip(partitions, timelines):
        assert replay.iteration_time(costs, bounds) == timeline.iteration_time
        assert replay.run(costs, bounds) == (timeline.iteration_time, timeline.master_stage)
        assert evaluator.master(bounds) == timeline.master_stage
        assert timeline.critical_path[-1].end == timeline.iteration_time
        assert replay.busy_bound(costs, bounds) <= timeline.iteration_time * (1 + 1e-12)
        assert replay.lower_bound(costs, bounds) <= timeline.iteration_time * (1 + 1e-12)
