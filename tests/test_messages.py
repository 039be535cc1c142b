"""Message costs measured on real ranks (lightning_pipe.profiling.messages) and how they reach the cost model."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.profiling import Profile
from lightning_pipe.profiling.messages import MessageCosts, measure_messages
from lightning_pipe.simulation import CostModel

THINK = 0.03  # s of busy work before each answer: far more than a hand-off on this machine


def _measure(rank: int, world: int) -> MessageCosts:
    return measure_messages(list(range(world)), 1 << 16, torch.device("cpu"), think=THINK, rounds=8)


@pytest.mark.multiprocess
def test_three_ranks_measure_both_links_and_agree():
    per_rank = run_distributed(_measure, 3, timeout=120)
    first = per_rank[0]
    assert all(m == first for m in per_rank)  # one answer everywhere: the planners on every rank agree
    # links (0, 1) and (1, 2): 8 round trips each (two hand-offs per trip), and on one host the
    # lockstep's stamped hand-offs besides (one per round whose receiver was waiting)
    assert first.method == "bounce+lockstep"
    assert first.samples > 2 * 2 * 8
    assert first.nbytes == 1 << 16
    assert first.send_overhead > 0 and first.recv_overhead > 0
    q = first.handoff_quantiles
    assert list(q) == sorted(q) and q[0] <= first.handoff_mean <= q[-1]
    # each round trip holds the other side's 30 ms of work: it is subtracted, so a hand-off is the
    # message's own delay (without the subtraction every sample would be >= THINK / 2)
    assert first.handoff_mean < THINK / 2


def _measure_on_separate_hosts(rank: int, world: int) -> MessageCosts:
    import lightning_pipe.profiling.messages as messages

    messages.socket.gethostname = lambda: f"host{rank}"  # each rank on a host of its own: clocks differ
    return _measure(rank, world)


@pytest.mark.multiprocess
def test_ranks_on_several_hosts_measure_round_trips_only():
    per_rank = run_distributed(_measure_on_separate_hosts, 2, timeout=120)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0].method == "bounce"
    assert per_rank[0].samples == 2 * 8  # one link, 8 round trips, two hand-offs each
    assert per_rank[0].handoff_mean < THINK / 2


def test_one_rank_has_no_messages():
    assert measure_messages([0], 1024, torch.device("cpu")) is None


def costs_of(**kw) -> MessageCosts:
    base = dict(
        send_overhead=1e-4,
        recv_overhead=5e-5,
        handoff_mean=1e-3,
        handoff_quantiles=(2e-4, 5e-4, 4e-3),
        nbytes=100_000,
        think=1e-3,
        samples=3,
        seconds=0.1,
    )
    return MessageCosts(**{**base, **kw})


def test_apply_charges_only_the_delay_the_link_model_misses():
    link = CostModel.uniform(2, 1.0, 2.0, latency=2e-4, bandwidth=1e9)  # 2e-4 + 1e5 / 1e9 = 3e-4 s per message
    costs = costs_of().apply(link)
    assert (costs.send_overhead, costs.recv_overhead) == (1e-4, 5e-5)
    assert costs.handoff_delay == pytest.approx(1e-3 - 1e-4 - 3e-4)  # hand-off less the send's own time and the link's
    assert costs.forward == link.forward and costs.latency == link.latency
    slow_link = CostModel.uniform(2, 1.0, 2.0, latency=5e-3)
    assert costs_of().apply(slow_link).handoff_delay == 0.0  # never negative: the link model already charges more


def test_profile_keeps_the_message_costs(tmp_path):
    profile = Profile.synthetic([1e-3, 2e-3])
    assert profile.costs().send_overhead == 0.0  # not measured: the link model alone
    profile.messages = costs_of().to_dict()
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded.message_costs == costs_of()
    costs = loaded.costs(bandwidth=1e9, latency=2e-4)
    assert (costs.send_overhead, costs.recv_overhead) == (1e-4, 5e-5) and costs.handoff_delay > 0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_message_costs_setting_is_a_bool(value):
    with pytest.raises(SettingError, match="message_costs"):
        PipelineConfig(message_costs=value)
