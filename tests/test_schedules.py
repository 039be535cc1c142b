"""Schedules are well-formed, and the validator names the rank and action of a broken one."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import Action, Op, PipelineSchedule, ScheduleError, build_schedule, forward_only, get_schedule, validate


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(1, 1), (2, 1), (2, 5), (3, 4), (4, 8), (4, 3)])
def test_builtin_schedules_validate(name, stages, m):
    s = build_schedule(name, stages, m)
    assert s.num_ranks == stages and s.num_microbatches == m
    for actions in s.actions:
        f = [a.microbatch for a in actions if a.op is Op.FORWARD]
        b = [a.microbatch for a in actions if a.op is Op.BACKWARD]
        assert sorted(f) == list(range(m)) and sorted(b) == list(range(m))
        assert actions[-1].op is Op.REDUCE_GRAD


def peak_in_flight(actions):
    live = peak = 0
    for a in actions:
        live += a.op is Op.FORWARD
        live -= a.op is Op.BACKWARD
        peak = max(peak, live)
    return peak


def test_1f1b_stashes_at_most_depth_activations_gpipe_all():
    p, m = 4, 8
    one = build_schedule("1f1b", p, m)
    gp = build_schedule("gpipe", p, m)
    assert [peak_in_flight(a) for a in one.actions] == [p - r for r in range(p)]
    assert [peak_in_flight(a) for a in gp.actions] == [m] * p


def test_1f1b_pairs_send_with_next_receive_for_batching():
    # Steady state of rank 0: SEND_F of one micro-batch directly followed by RECV_B of an older one.
    acts = build_schedule("1f1b", 2, 4).actions[0]
    pairs = [(a.op, b.op) for a, b in zip(acts, acts[1:])]
    assert (Op.SEND_ACT, Op.RECV_GRAD) in pairs


def test_forward_only_has_no_backward():
    s = forward_only(3, 2)
    validate(s)
    assert all(a.op in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT) for acts in s.actions for a in acts)


def test_unknown_schedule_names_allowed_values():
    with pytest.raises(
        ValueError,
        match=r"schedule='zigzag'.*\['1f1b', '2bw', 'advance', 'gpipe', 'hanayo', 'interleaved', 'wave', 'zb-auto', 'zb-h1', 'zb-v', 'flush'\]",
    ):
        get_schedule("zigzag")


def broken(mutate) -> PipelineSchedule:
    s = build_schedule("1f1b", 2, 2)
    mutate(s.actions)
    return s


def test_unmatched_send_is_named():
    def drop_recv(lists):
        lists[1].remove(Action(Op.RECV_ACT, 1, 1, 0))

    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ SEND_F\(chunk=0, mb=1, to=1\): no matching receive"):
        validate(broken(drop_recv))


def test_missing_backward_is_named():
    def drop_backward(lists):
        lists[0].remove(Action(Op.BACKWARD, 0, 1))

    with pytest.raises(ScheduleError, match=r"rank 0: micro-batch 1 is never backwarded on chunk 0"):
        validate(broken(drop_backward))


def test_dependency_cycle_is_named():
    def send_activation_after_its_backward(lists):
        # rank 0 waits in B(mb 0) for a gradient that needs the activation it only sends afterwards
        acts = lists[0]
        send = Action(Op.SEND_ACT, 0, 0, 1)
        acts.remove(send)
        acts.insert(acts.index(Action(Op.BACKWARD, 0, 0)) + 1, send)

    schedule = build_schedule("1f1b", 2, 1)
    send_activation_after_its_backward(schedule.actions)
    with pytest.raises(
        ScheduleError,
        match=r"dependency cycle: ranks wait on each other forever: rank 0, action \d+ B\(chunk=0, mb=0\); rank 1, action \d+ F\(chunk=1, mb=0\)",
    ):
        validate(schedule)


def test_receive_order_mismatch_is_named():
    def swap(lists):
        acts = lists[1]
        i, j = acts.index(Action(Op.RECV_ACT, 1, 0, 0)), acts.index(Action(Op.RECV_ACT, 1, 1, 0))
        acts[i], acts[j] = acts[j], acts[i]

    with pytest.raises(ScheduleError, match=r"rank 1, action \d+ RECV_F\(chunk=1, mb=1, from=0\).*order of the sends"):
        validate(broken(swap))


def test_compute_without_input_is_named():
    def drop_forward_recv_and_send(lists):
        lists[0].remove(Action(Op.SEND_ACT, 0, 0, 1))
        lists[1].remove(Action(Op.RECV_ACT, 1, 0, 0))

    with pytest.raises(ScheduleError, match=r"rank 1, action 0 F\(chunk=1, mb=0\): needs the activation of chunk 0"):
        validate(broken(drop_forward_recv_and_send))


def test_wrong_peer_is_named():
    s = build_schedule("gpipe", 3, 1)
    s.actions[0][1] = Action(Op.SEND_ACT, 0, 0, 2)
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 .*peer must be the rank holding chunk 1"):
        validate(s)
