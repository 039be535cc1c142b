"""AvgPipe's advance forward propagation (§4.2, Algorithm 1): the schedule, its ends, its memory,
the adaptive rule, and training with it on real processes against one process."""

from __future__ import annotations

import glob
import os

import lightning as L
import matplotlib.image
import pytest
import torch
from _dist import run_distributed
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from models import START, LitSeq, loader, max_rel_diff, mlp_blocks, trainer_kwargs
from torch import nn

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.modes.advance.engine import AdvanceRule
from lightning_pipe.planning import partition_blocks
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.schedules import Op, build_schedule, validate
from lightning_pipe.schedules.advance import advance_bounds, peak_stash
from lightning_pipe.simulation import CostModel, simulate
from lightning_pipe.simulation.timelines import gantt
from lightning_pipe.tuning.record import in_flight_peak


def compute_order(schedule, rank):
    return [(a.op, a.microbatch) for a in schedule.actions[rank] if a.op.is_compute]


# ---- the schedule -------------------------------------------------------------------------------
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 9])
def test_the_ends_are_1f1b_and_all_forwards_first(stages, m):
    low, high = advance_bounds(stages, m)
    assert low == stages - 1
    assert build_schedule("advance", stages, m, advance_num=low or 0).actions == build_schedule("1f1b", stages, m).actions
    if m > stages - 1:
        assert build_schedule("advance", stages, m, advance_num=m).actions == build_schedule("gpipe", stages, m).actions


@given(stages=st.integers(1, 6), m=st.integers(1, 12), data=st.data())
def test_every_advance_num_validates_and_holds_what_it_says(stages, m, data):
    low, high = advance_bounds(stages, m)
    a = data.draw(st.integers(low, high))
    schedule = build_schedule("advance", stages, m, advance_num=a or 0)
    validate(schedule)
    first = compute_order(schedule, 0)
    ahead = next((i for i, (op, _) in enumerate(first) if op is Op.BACKWARD), len(first))
    # Algorithm 1: advance_num forwards in advance (line 3), then forward, backward, ... (lines 5-7)
    assert ahead == min(m, a + 1)
    if stages > 1 and a < m:  # the last stage keeps 1F1B's order (Fig. 7(c)): holding it back only delays gradients
        assert compute_order(schedule, stages - 1) == compute_order(build_schedule("1f1b", stages, m), stages - 1)
    held = peak_stash(stages, m, a or 0)
    for rank in range(stages):
        assert in_flight_peak(schedule.actions[rank]) == held[rank]
        order = compute_order(schedule, rank)
        assert sorted(order) == sorted([(Op.FORWARD, i) for i in range(m)] + [(Op.BACKWARD, i) for i in range(m)])
        assert [i for op, i in order if op is Op.BACKWARD] == list(range(m))  # gradients accumulate in 1F1B's order
    if a < high:  # one more forward in advance never holds fewer activations anywhere
        more = peak_stash(stages, m, a + 1)
        assert all(x >= y for x, y in zip(more, held))


def test_out_of_range_advance_num_is_named_before_anything_runs():
    with pytest.raises(SettingError, match=r"advance_num=5 is outside \[K - 1, M\] = \[1, 4\]") as err:
        PipelineConfig(schedule="advance", advance_num=5, microbatches=4).check_world(2)
    assert err.value.setting == "advance_num"
    with pytest.raises(SettingError, match=r"advance_num=1 is outside \[K - 1, M\] = \[3, 8\]"):
        PipelineConfig(schedule="advance", advance_num=1, microbatches=8).check_world(4)
    with pytest.raises(SettingError, match="advance_num=2 is a setting of schedule='advance'"):
        PipelineConfig(schedule="1f1b", advance_num=2)
    with pytest.raises(SettingError) as err:
        build_schedule("advance", 2, 4, advance_num=6)
    assert err.value.setting == "advance_num"
    with pytest.raises(SettingError, match="slicer"):
        PipelineConfig(schedule="advance", slicer=True)


def test_advance_hides_slow_messages_in_the_simulator_and_draws(tmp_path):
    # Fig. 7: with messages as slow as a forward, 1F1B starves between micro-batches; forwards in
    # advance overlap them, and all-forwards-first (AFAB) is the fastest and holds the most
    stages, m = 4, 8
    costs = CostModel.uniform(stages, 1.0, 2.0, latency=1.0)
    bounds = [(i, i + 1) for i in range(stages)]
    times = [simulate(build_schedule("advance", stages, m, advance_num=a), costs, bounds).iteration_time for a in range(stages - 1, m + 1)]
    assert times[1] < times[0]  # one forward in advance already beats 1F1B
    assert all(later <= earlier + 1e-9 for earlier, later in zip(times, times[1:]))  # more in advance never slower here
    assert times[-1] < times[0]
    free = CostModel.uniform(stages, 1.0, 2.0)  # free messages: nothing to hide, every advance_num ties
    assert len({simulate(build_schedule("advance", stages, m, advance_num=a), free, bounds).iteration_time for a in range(3, 9)}) == 1
    timeline = simulate(build_schedule("advance", stages, m, advance_num=5), costs, bounds)
    first = [e.action.op for e in sorted(timeline.computes(0), key=lambda e: e.start)]
    # AvgPipe's Algorithm 1 (lines 2-7): advance_num forwards, then one forward one backward
    assert first[:7] == [Op.FORWARD] * 6 + [Op.BACKWARD]
    assert timeline.peak_activations[0] == 6  # ... all six stashed at once on the first stage (1F1B: 4)
    gantt(timeline, tmp_path / "advance.png", title="advance 5")
    pixels = matplotlib.image.imread(tmp_path / "advance.png")  # a picture that decodes, with bars drawn on it
    assert pixels.ndim == 3 and len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::97]}) > 3


# ---- Algorithm 1's rule (one process: no agreement needed) ---------------------------------------
def algorithm_1(history, low: int, high: int, steps: int) -> tuple[int, bool]:
    """AvgPipe's Algorithm 1 lines 9-10 on recorded (advance_num, step time) pairs, written out from
    the paper: start at K - 1; raise by one after a step faster than the one before (the first
    measured step has none before it) up to M; the first step that is not faster, or at M, settles it.
    Checks every recorded value is the one the rule was at, and that a rule that never settled
    recorded all `steps` measured steps."""
    a, last = low, None
    for i, (num, seconds) in enumerate(history):
        assert num == a, f"step {i} ran advance_num={num}, the rule was at {a}"
        if (last is None or seconds < last) and a < high:
            a, last = a + 1, seconds
        else:
            assert i == len(history) - 1, "the rule kept measuring after it settled"
            return a, True
    assert len(history) == steps, f"{len(history)} steps recorded of {steps}"
    return a, False  # at M it settles at the next step's observation


def test_the_rule_raises_while_faster_then_settles_for_good():
    rule = AdvanceRule(stages=2, microbatches=6, rank=0, warmup=1)
    assert rule.advance_num == 1  # starts at 1F1B
    seen = [rule.observe(t) for t in (9.0, 5.0, 4.0, 3.0, 3.5, 1.0, 0.5)]
    # warm-up (9.0) not compared; 5.0: first measure -> 2; 4.0 -> 3; 3.0 -> 4; 3.5 is slower -> settled at 4
    assert seen == [1, 2, 3, 4, 4, 4, 4]
    assert rule.settled and rule.history == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 3.5)]


def test_warm_up_steps_are_not_compared():
    rule = AdvanceRule(stages=2, microbatches=6, rank=0)  # the default skips 3 steps getting faster by themselves
    assert [rule.observe(t) for t in (9.0, 7.0, 5.0, 5.0, 4.0, 6.0)] == [1, 1, 1, 2, 3, 3]
    assert rule.history == [(1, 5.0), (2, 4.0), (3, 6.0)] and rule.settled


def test_the_rule_stops_at_all_forwards_first():
    rule = AdvanceRule(stages=2, microbatches=3, rank=0, warmup=1)
    assert [rule.observe(t) for t in (1.0, 0.9, 0.8, 0.7, 0.1)] == [1, 2, 3, 3, 3] and rule.settled


def test_the_rule_never_raises_past_the_memory_limit():
    # stage 0 holds 2 micro-batches at 1F1B (K=2), 3 at advance_num=2, 4 at 3: 100 + 10 per micro-batch
    rule = AdvanceRule(stages=2, microbatches=8, rank=0, memory_limit=135.0, static_bytes=lambda: 100.0, warmup=1)
    rule.stash_bytes = 10.0
    assert rule.predicted_peak(2) == 130.0 and rule.predicted_peak(3) == 140.0
    assert [rule.observe(t) for t in (5.0, 4.0, 3.0, 2.0)] == [1, 2, 2, 2]  # 3 would need 140 > 135
    assert rule.settled


def test_the_rule_measures_what_autograd_keeps_per_microbatch():
    rule = AdvanceRule(stages=2, microbatches=4, rank=0, memory_limit=1e9)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    with rule.measure_stash(microbatches=2):
        (torch.tanh(x @ w)).sum().backward()  # saves x, w and tanh's output: 3 storages
    assert rule.stash_bytes == (8 * 16 + 16 * 16 + 8 * 16) * 4 / 2


def _agree_on_rank(rank: int, world: int) -> list[int]:
    rule = AdvanceRule(stages=world, microbatches=6, rank=rank, warmup=1)
    # rank 1 gets faster every step, rank 0 is slow at the 3rd measured step: the agreed (max) time is rank 0's
    mine = [9.0, 5.0, 4.0, 4.5, 3.0] if rank == 0 else [9.0, 5.0, 4.0, 3.0, 2.0]
    return [rule.observe(t) for t in mine]


def test_every_rank_takes_the_same_decisions():
    first, second = run_distributed(_agree_on_rank, 2, timeout=60)
    assert first == second == [1, 2, 3, 3, 3]


# ---- training with it equals one process ---------------------------------------------------------
def _train(rank: int, world: int, m: int, advance_nums: list) -> list:
    out = []
    for a in advance_nums:
        torch.manual_seed(0)
        model = mlp_blocks().double()
        start, stop = partition_blocks("uniform", len(model), world).bounds[rank]
        chunk = nn.Sequential(*[model[i] for i in range(start, stop)])
        host = SequentialHost({rank: chunk}, world - 1, nn.functional.cross_entropy)
        pipe = SequentialPipeline(
            build_schedule("advance", world, m, advance_num=a), rank, host, Transport(lambda r: r, torch.device("cpu"))
        )
        opt = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7)
        for _ in range(3):
            x, y = torch.randn(12, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
            opt.zero_grad()
            pipe.step(x, y)
            opt.step()
        out.append({k: v for k, v in model.state_dict().items() if start <= int(k.split(".")[0]) < stop})
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_every_advance_num_trains_as_one_process(world):
    m = 4
    nums = list(range(world - 1, m + 1))
    per_rank = run_distributed(_train, world, m, nums, timeout=180)
    torch.manual_seed(0)
    ref = mlp_blocks().double()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        x, y = torch.randn(12, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for i, a in enumerate(nums):
        got = {k: v for rank in per_rank for k, v in rank[i].items()}
        assert max_rel_diff(ref.state_dict(), got) <= 1e-10, f"advance_num={a}"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_adaptive_rule_trains_as_one_process_through_the_trainer(tmp_path):
    # 6 steps, 46 samples in batches of 10 (a short 5th batch of 6): the rule may change the list
    # between steps; the weights must be one process's whatever it chose
    ref = LitSeq()
    L.Trainer(devices=1, **trainer_kwargs(max_steps=6)).fit(ref, loader())
    model = LitSeq()
    strategy = AutoPipeStrategy(schedule="advance", microbatches=4, partition="uniform", start_method=START)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    L.Trainer(devices=2, strategy=strategy, callbacks=[saver], **trainer_kwargs(max_steps=6, enable_checkpointing=True)).fit(
        model, loader()
    )
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    (path,) = glob.glob(os.path.join(tmp_path, "*step=6.ckpt"))
    rule = torch.load(path, weights_only=False)["optimizer_states"][0]["autopipe_advance"]
    # the recorded step times, replayed through Algorithm 1 as the paper states it, give the state saved
    assert (rule["advance_num"], rule["settled"]) == algorithm_1(rule["history"], low=1, high=4, steps=6 - 3)
