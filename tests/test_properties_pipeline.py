"""Property tests: random block stacks, every registered schedule, training equals one process.

Hypothesis draws a `Case` (tests/strategies_pipeline.py): a float64 `nn.Sequential` of random
blocks whose activations are a tensor or a tuple of tensors in any order, with integer and bool
masks and int32 position ids (no gradient), a second float that needs a gradient and a detached
float; a GPT-style tied weight (the head scores against the first block's embedding matrix) and
Linear weights shared by middle blocks, wherever the partition puts them; a random partition into
the schedule's chunks; every schedule in `lightning_pipe.schedules.REGISTRY` with its options
(interleaved chunks=1..3, wave waves=1..2) and every micro-batch count it accepts; 1-4 pipeline
stages, 1 or 2 replicas; 2-3 steps whose batch and sequence length change (headers renegotiated);
SGD with momentum or Adam; prefetch and grouped p2p (batch_isend_irecv) on or off.

Properties:

(a) every schedule a generator accepts validates (`schedules.validate`), survives its text form
    (`dump` / `load`), and a micro-batch count it refuses is refused by `ScheduleSpec.build` (a
    SettingError, not a hang); the schedule of every process case is validated before it runs;
(b) the simulator and the runtime agree on the order of work: on every rank the executor's trace
    of a real run (`viz.traced_timeline`) lists the computes and sends in the order of `simulate`'s
    timeline, which is the action list's; and both respect the same dependencies
    (`simulator.input_source`): no compute starts before the compute it consumes ended (locally,
    or on the peer, on the shared monotonic clock), nor before its message arrived (simulator) or
    was sent (trace; checked where the traced step reads no shape header, see the xfail below);
(c) training (2-3 optimizer steps) on real gloo processes equals one process: every replica's
    weights equal the reference within 1e-12 (relative to each tensor's largest value), and are
    bit-equal (==) when the pipeline does the same float operations in the same order (one
    micro-batch, one replica, no weight used by more than two blocks).

The pool: one set of POOL_WORLD = 4 processes in one gloo group serves every example of the module
(`Pool` in strategies_pipeline.py). One world size is enough: a case runs on depth x replicas <= 4
of the workers (depths 1-4 with one replica, depths 1-2 with two), the others return at once, and
every process group a case can need (replica groups, tied-weight groups: every set of 2+ ranks) is
made once at start-up. Hypothesis draws in this process and ships the picklable `Case` down a pipe
to each worker; the workers build the model from its seed, cut their chunks, train with
`SequentialPipeline` (the runtime without Lightning), sum tied gradients with `allreduce_tied`,
and return their blocks' weights and the executor's trace; the reference is trained here. After
each case the workers exchange a fence message, so a message a case left unreceived fails that
case, not a later one. Every wait is bounded (pool start 120 s, a case 30 s, gloo p2p inside a
worker 10 s); a worker's exception comes back as `WorkerError` with its traceback, a crash (gloo
aborts on a size mismatch) as a RuntimeError naming the case; after a failure the pool is killed
and re-forked (well under a second: workers fork from a fork server that imported everything
once), and after 3 failures `PoolGaveUp` ends the test at once rather than let Hypothesis shrink
into hang after hang.

Timings on 2 cores: pool start ~8 s (one import of torch and lightning in the fork server), a case
10-500 ms; the whole file ~40 s. A runtime broken so that it hangs or crashes fails it in ~40 s;
a numerical failure is shrunk to a minimal case in 1-3 minutes per schedule.
"""

from __future__ import annotations

from typing import Any, Iterable

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from models import max_rel_diff
from strategies_pipeline import (
    POOL_WORLD,
    Block,
    Case,
    Pool,
    ScheduleCase,
    build_model,
    cases,
    partitions,
    schedule_cases,
    train_reference,
    train_stage,
)

from lightning_pipe.errors import SettingError
from lightning_pipe.runtime.microbatch import microbatch_sizes
from lightning_pipe.runtime.tied import find_tied_parameters
from lightning_pipe.schedules import REGISTRY, Action, PipelineSchedule, dump, load, validate
from lightning_pipe.schedules.two_bw import SHOWN_BATCHES
from lightning_pipe.simulation import CostModel, Timeline, done_key, input_source, message_of, produced_by, simulate
from lightning_pipe.simulation.timelines import traced_timeline
from lightning_pipe.topology import Topology

RELATIVE = 1e-12
SYNCHRONOUS = sorted(name for name, kind in REGISTRY.items() if kind.versions == "flush")
QUICK = dict(deadline=None, database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])


# ---- (a) schedules ---------------------------------------------------------------------------------
@settings(max_examples=150, **QUICK)
@given(schedule_cases(most_microbatches=12))
def test_every_accepted_schedule_validates(case: ScheduleCase):
    s = case.build()  # builds and validates
    validate(s)
    # 2BW's schedule is its run unrolled over SHOWN_BATCHES optimizer steps (each of m micro-batches)
    steps = SHOWN_BATCHES if case.spec.kind.versions == "2bw" else 1
    assert s.num_ranks == case.stages and s.num_microbatches == case.microbatches * steps and s.backward
    assert s.num_chunks == case.spec.chunk_count(case.stages)
    assert sorted(set(s.chunk_rank)) == list(range(case.stages))
    back = load(dump(s))
    assert back == s


@settings(max_examples=100, **QUICK)
@given(schedule_cases(most_microbatches=12), st.integers(1, 12))
def test_a_refused_microbatch_count_is_a_setting_error(case: ScheduleCase, m: int):
    try:
        case.spec.kind.generator(case.stages, m, **case.spec.kwargs)
    except ValueError:
        with pytest.raises(SettingError):
            case.spec.build(case.stages, m)
    else:
        validate(case.spec.build(case.stages, m))


# ---- (b) the order of work --------------------------------------------------------------------------
Timed = tuple[int, Action, float, float]  # (rank, action, start, end)


def order_errors(schedule: PipelineSchedule, events: Iterable[Timed], ready_when: str) -> list[str]:
    """What breaks the list order or the dependencies in a timeline of computes and sends.

    A compute may not start before the local compute it consumes ended, nor before its message is
    ready, which is (`ready_when`) "arrival": the end of the send (the simulator's arrival time);
    "issue": the start of the send (a real trace: when the send was issued); "producer": the end of
    the compute on the peer that produced the message (a real trace, without the sends' stamps)."""
    events = list(events)
    errors = []
    for r in range(schedule.num_ranks):
        got = [a for rank, a, _, _ in events if rank == r]
        expected = [a for a in schedule.actions[r] if a.op.is_compute or a.op.is_send]
        if got != expected:
            errors.append(f"rank {r}: computes and sends in the order {list(map(str, got))}, the list has {list(map(str, expected))}")
    ended = {done_key(a): (r, end) for r, a, _, end in events if a.op.is_compute}  # a BI answers to its backward's key
    sent = {message_of(a): (r, end if ready_when == "arrival" else start) for r, a, start, end in events if a.op.is_send}
    for r, a, start, _ in events:
        if not a.op.is_compute:
            continue
        source = input_source(schedule, a, r)
        if source is None:
            continue
        local, key = source
        if local:
            where, ready = ended.get(key, (None, None))
        elif ready_when == "producer":
            where, ready = ended.get(produced_by(key), (None, None))
        else:
            where, ready = sent.get(key, (None, None))
        if ready is None:
            errors.append(f"rank {r}: {a} consumes {key}, which the timeline lacks")
        elif start < ready:
            errors.append(f"rank {r}: {a} starts at {start:.9f}, before its input {key} (rank {where}) is ready at {ready:.9f}")
    return errors


@st.composite
def simulated(draw):
    case = draw(schedule_cases(most_microbatches=8))
    chunks = case.spec.chunk_count(case.stages)
    n = chunks + draw(st.integers(0, 3))
    times = st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=n, max_size=n)
    costs = CostModel(
        tuple(draw(times)), tuple(draw(times)), activation_bytes=tuple(draw(times)), bandwidth=draw(st.sampled_from([1.0, 4.0]))
    )
    return case, costs, draw(partitions(n, chunks))


@settings(max_examples=200, **QUICK)
@given(simulated())
def test_simulator_keeps_list_order_and_dependencies(drawn):
    case, costs, bounds = drawn
    schedule = case.build()
    timeline = simulate(schedule, costs, bounds)
    assert order_errors(schedule, timed(timeline), "arrival") == []


# ---- (c) real processes ------------------------------------------------------------------------------
def timed(timeline: Timeline) -> list[Timed]:
    return [(e.rank, e.action, e.start, e.end) for e in timeline.events]


def check_case(case: Case, schedule: PipelineSchedule, results: list[Any]) -> None:
    topo = Topology(case.world, case.replicas)
    assert all(r is None for r in results[case.world :]), "a worker outside the case returned a result"
    # (b) each replica's trace against the simulator's timeline of the same lists
    simulated = simulate(schedule, CostModel.uniform(len(case.blocks), 1.0, 2.0), case.bounds)
    assert order_errors(schedule, timed(simulated), "arrival") == []
    reference = train_reference(case)
    for w in range(case.replicas):
        parts = [results[topo.global_rank(w, s)] for s in range(case.schedule.stages)]
        real = traced_timeline(schedule, [part["records"] for part in parts])
        for r in range(schedule.num_ranks):
            ran, predicted = ([e.action for e in t.events if e.rank == r] for t in (real, simulated))
            assert ran == predicted, (
                f"replica {w} rank {r}: the executor ran {list(map(str, ran))}, the simulator {list(map(str, predicted))}"
            )
        errors = order_errors(schedule, timed(real), "producer") + order_errors(schedule, timed(real), "issue")
        assert not errors, f"replica {w}: the real run breaks the schedule's dependencies:\n" + "\n".join(errors[:10])
        # (c) the weights
        got = {k: torch.from_numpy(v) for part in parts for k, v in part["weights"].items()}
        assert got.keys() == reference.keys(), f"replica {w}: weights {sorted(got)} != {sorted(reference)}"
        if case.exact:
            differ = [k for k in reference if not torch.equal(got[k], reference[k])]
            assert not differ, (
                f"replica {w}: not bit-equal although the float operations are the same: {differ} (max rel {max_rel_diff(reference, got):.2e})"
            )
        else:
            err = max_rel_diff(reference, got)
            assert err <= RELATIVE, f"replica {w}: relative error {err:.2e} > {RELATIVE:g}"


def coverage(case: Case, schedule: PipelineSchedule) -> list[str]:
    model = build_model(case)
    tied = find_tied_parameters(model, case.bounds, schedule.chunk_rank)
    shared = len({id(p) for p in model.parameters()}) < len(model.state_dict())
    slots = {c for b in case.blocks for c in b.out}
    return [
        f"{schedule.name} on {case.schedule.stages} stages x {case.replicas} replicas",
        "weights tied across ranks" if tied else "weights shared on one rank" if shared else "no shared weights",
        "integer or bool tensors in activations" if slots & set("mbp") else "float activations only",
        "two float tensors needing grad in an activation" if "g" in slots else "one float tensor needing grad",
        "bit-exact case" if case.exact else "1e-12 case",
        "headers read in the traced step" if reads_headers(case) else "no header in the traced step",
    ]


def reads_headers(case: Case) -> bool:
    """Whether the traced (last) step meets a micro-batch signature no earlier step had: then its
    receivers read shape headers (blocking) before taking the data."""
    seen = {(size, t) for n, t in case.steps[:-1] for size in microbatch_sizes(n, case.schedule.microbatches)}
    n, t = case.steps[-1]
    return any((size, t) not in seen for size in microbatch_sizes(n, case.schedule.microbatches))


@pytest.fixture(scope="module")
def pool():
    workers = Pool(POOL_WORLD)
    yield workers
    workers.close()


class TestOnProcesses:
    pytestmark = pytest.mark.multiprocess

    @pytest.mark.parametrize("name", SYNCHRONOUS)  # 2BW's own rule: tests/test_two_bw_*.py
    @settings(max_examples=40, **QUICK)
    @given(data=st.data())
    def test_training_equals_one_process(self, pool, name, data):
        case = data.draw(cases(names=[name]), label="case")
        schedule = case.schedule.build()  # (a): built and validated before any process runs it
        validate(schedule)
        for label in coverage(case, schedule):  # pytest --hypothesis-show-statistics lists them
            event(label)
        results = pool.run(train_stage, case, what=f"training {case.describe()}")
        check_case(case, schedule, results)

    def test_trace_stamps_sends_when_issued(self, pool):
        # wave, 2 ranks, 1 micro-batch: rank 0 runs F0 [SEND_F(0) RECV_F(3)] F3 ...; the new sequence length of
        # the second step makes RECV_F(3) read a header, which rank 1 sends only after F1 (consuming SEND_F(0)) and F2
        mix = Block("mix", "")
        case = Case(
            seed=3,
            vocab=7,
            hidden=3,
            blocks=(Block("embed", ""), mix, mix, Block("head")),
            tie_head=True,
            schedule=ScheduleCase("wave", 2, 1, (("waves", 1),)),
            replicas=1,
            bounds=((0, 1), (1, 2), (2, 3), (3, 4)),
            steps=((2, 3), (2, 4)),
            optimizer="sgd",
            prefetch=False,
            batch_ops=False,
        )
        assert reads_headers(case)
        results = pool.run(train_stage, case, what=f"training {case.describe()}")
        schedule = case.schedule.build()
        real = timed(traced_timeline(schedule, [results[0]["records"], results[1]["records"]]))
        assert order_errors(schedule, real, "producer") == []  # the computes' stamps are right
        errors = order_errors(schedule, real, "issue")
        assert not errors, "\n".join(errors)
