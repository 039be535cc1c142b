"""adaptive=paper: the paper's networks decide in training. Online adaptation of the predictor from
the job's measured iterations, the arbiter's update from the measured reward, the refusals outside
the shipped networks' range, and a real Trainer run on two processes under a slowed rank."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from models import START, max_rel_diff, trainer_kwargs
from test_adaptive import SlowRankOne, emulated_data, emulated_reference_and_model

from benchmarks.harness.emulated import set_slowdown
from lightning_pipe import AutoPipeStrategy
from lightning_pipe.adaptive.monitor import IterationMetrics, StaticMetrics
from lightning_pipe.adaptive.paper_decider import PaperDecider, load_paper
from lightning_pipe.adaptive.paper_offline import reward
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError

STATIC = StaticMetrics((2e5,) * 8, (0.0,) + (2e5,) * 7, (4e6,) * 8, (0.002,) * 8, (0.004,) * 8)
EVEN = ((0, 4), (4, 8))


def window(bounds, slow: float, wall: float, start: int = 0, n: int = 3) -> list[IterationMetrics]:
    """n iterations on 2 ranks, rank 1 `slow` times its profiled compute, each taking `wall` seconds."""
    blocks = [hi - lo for lo, hi in bounds]
    f = (4 * 0.002 * blocks[0], 4 * 0.002 * blocks[1] * slow)
    b = (4 * 0.004 * blocks[0], 4 * 0.004 * blocks[1] * slow)
    links = {(0, 1): 1e8, (1, 0): 1e8}
    return [IterationMetrics(start + i, 4, bounds, (0, 1), f, b, (wall, wall), dict(links), dict(links)) for i in range(n)]


def decider() -> PaperDecider:
    return PaperDecider(load_paper(None, 2), STATIC, 4, window=3)


def test_online_adaptation_moves_the_predictor_toward_the_measured_times():
    # the job measures its running partition at 3x what the shipped network predicts: after the
    # online steps (from the shipped, meta-learned weights) the prediction is nearer the measurement
    d = decider()
    verdict = d.decide(window(EVEN, 1.0, 0.13), None, 100, 1e8)  # nothing measured yet: the shipped network
    shipped_now = verdict.now_s
    measured = 3 * shipped_now
    for step in range(8):
        d.observe(window(EVEN, 1.0, measured, start=step))
    verdict = d.decide(window(EVEN, 1.0, measured), None, 100, 1e8)
    assert d.online_steps > 0
    assert abs(math.log(verdict.now_s / measured)) < 0.8 * abs(math.log(shipped_now / measured)), (shipped_now, verdict.now_s, measured)
    changed = [not torch.equal(p, q) for p, q in zip(d.predictor.parameters(), d.shipped.predictor.parameters())]
    assert any(changed), "the adapted copy differs from the shipped weights"
    assert all(torch.equal(p, q) for p, q in zip(d.shipped.predictor.parameters(), load_paper(None, 2).predictor.parameters())), (
        "each adaptation starts from the shipped weights, which stay as loaded"
    )


def _switching_decider(soften: float = 1.0) -> tuple[PaperDecider, object]:
    """A decider whose arbiter said switch under a slowed rank 1; `soften` scales its output layer (the
    shipped arbiter is nearly deterministic: p rounds to 1, where REINFORCE's step, ~ 1 - p, is nil)."""
    d = decider()
    with torch.no_grad():
        d.arbiter.net[-1].weight.mul_(soften)
        d.arbiter.net[-1].bias.mul_(soften)
    for step in range(4):
        d.observe(window(EVEN, 3.0, 0.33, start=step))
    verdict = d.decide(window(EVEN, 3.0, 0.33), None, 100, 1e8)
    assert verdict.switch and verdict.best[0][1] > 4, "blocks go to the fast rank 0"
    return d, verdict


@pytest.mark.parametrize("after_s, up", [(0.20, True), (0.60, False)])
def test_the_arbiter_learns_from_the_measured_reward_of_its_switch(after_s, up):
    d, verdict = _switching_decider(soften=0.01)
    x, baseline = d.proposal["x"], d.arbiter.baseline
    before = d.arbiter.probability(x)
    d.switched(8e6, 1e8, 1, 0.02, old=EVEN, new=verdict.best)  # the measured switch prices the reward's C
    cost = d.proposal["cost_s"]
    assert cost > 0 and d.switch_samples[-1][2] == pytest.approx(math.log10(0.02))
    assert d.rewards == [], "no reward before a window on the new partition is measured"
    d.observe(window(verdict.best, 3.0, after_s, n=2))
    assert d.rewards == [], "a window not yet full"
    d.observe(window(verdict.best, 3.0, after_s))
    assert d.rewards == [(True, pytest.approx(reward(0.33, after_s, cost)))], "the paper's reward from the measured times"
    assert d.proposal is None
    assert d.arbiter.baseline == pytest.approx(0.9 * baseline + 0.1 * d.rewards[0][1]), "the baseline follows the measured reward"
    after = d.arbiter.probability(x)
    assert (after > before + 1e-4) if up else (after < before - 1e-4), (before, after)


def test_online_state_round_trips_through_a_checkpoint():
    # what the run learned (recent samples, measured switches, the arbiter as updated, a switch
    # awaiting its reward) comes back from a checkpoint read as Lightning reads it, and decides alike
    import io

    first, verdict = _switching_decider(soften=0.01)
    first.switched(8e6, 1e8, 1, 0.02, old=EVEN, new=verdict.best)
    first.observe(window(verdict.best, 3.0, 0.2))  # rewarded: the arbiter and its optimizer changed
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    again = decider()
    again.load_state_dict(torch.load(buffer, weights_only=True))
    for d in (first, again):
        d.observe(window(verdict.best, 2.0, 0.25, start=9))
    a, b = (d.decide(window(verdict.best, 2.0, 0.25, start=9), None, 10, 1e8) for d in (first, again))
    assert a.scores == b.scores and a.probability == b.probability and a.cost_s == b.cost_s
    assert first.rewards == again.rewards and again.online_steps == first.online_steps
    fresh = decider()
    assert fresh.decide(window(verdict.best, 2.0, 0.25, start=9), None, 10, 1e8).scores != a.scores


def test_a_switch_by_hand_is_not_the_arbiters():
    d, verdict = _switching_decider()
    d.switched(8e6, 1e8, 1, 0.02, old=EVEN, new=((0, 2), (2, 8)))  # another switch (by hand)
    assert d.switch_samples == [] and d.proposal["cost_s"] is None


def test_selected_from_the_command_line():
    from hydra import compose, initialize_config_dir

    from lightning_pipe.cli.paths import CONFIG_DIR
    from lightning_pipe.cli.train import pipeline_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["recipe=gpt-tiny-cpu", "pipeline.adaptive=paper"])
        refused = compose("config", overrides=["recipe=gpt-tiny-cpu", "pipeline.adaptive=paper", "schedule=interleaved"])
    config = pipeline_config(cfg)
    assert config.adaptive == "paper"
    config.check_world(cfg.trainer.devices)
    with pytest.raises(SettingError, match="adaptive=paper with schedule='interleaved'") as error:
        pipeline_config(refused)
    assert error.value.setting == "adaptive"


def test_refusals_outside_the_shipped_networks():
    assert PipelineConfig(adaptive="paper").adaptive == "paper"
    PipelineConfig(adaptive="paper").check_model(2, 24)
    cases = [
        (dict(), lambda c: c.check_world(3), "adaptive=paper at depth 3: the paper's networks cover depths 2, 4"),
        (dict(), lambda c: c.check_model(2, 25), "adaptive=paper with 25 blocks: the paper's per-layer inputs take at most 24 blocks"),
        (dict(schedule="interleaved"), None, "adaptive=paper with schedule='interleaved': the paper's networks take one model chunk"),
        (dict(schedule="wave"), None, "adaptive=paper with schedule='wave'"),
        (dict(schedule="auto"), None, "adaptive=paper with schedule='auto'"),
    ]
    for kw, later, message in cases:
        with pytest.raises(SettingError, match=message) as error:
            config = PipelineConfig(adaptive="paper", **kw)
            if later is not None:
                later(config)
        assert error.value.setting == "adaptive" and "\n" not in str(error.value)


def test_a_depth_without_networks_is_refused_before_any_process_starts():
    # the Trainer's launcher checks the world as it is made, before fit could spawn anything
    strategy = AutoPipeStrategy(microbatches=4, adaptive="paper", start_method=START)
    with pytest.raises(SettingError, match="adaptive=paper at depth 3"):
        L.Trainer(devices=3, strategy=strategy, **trainer_kwargs(max_steps=1))


class SlowFromStart(SlowRankOne):
    """Rank 1 3x slower from the first iteration (the monitor's record as `SlowRankOne`'s)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == 0 and trainer.global_rank == 1:
            set_slowdown(3.0)


class Switches(L.Callback):
    """On rank 0 at the end: the switches (who decided, from and to) and the decider's online record."""

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank != 0:
            return
        adaptive = trainer.strategy.adaptive
        records = [{"iteration": s.iteration, "by": s.by, "old": s.old, "new": s.new} for s in adaptive.switches]
        Path("paper-switches.json").write_text(json.dumps(records))
        decider = adaptive.decider
        Path("paper-online.json").write_text(json.dumps({"online_steps": decider.online_steps, "rewards": decider.rewards}))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_paper_mode_switches_by_its_arbiter_and_stays_exact():
    # rank 1 computes 3x slower throughout: the paper's predictor (adapted online on the measured
    # iterations) proposes, its arbiter decides, every rank switches alike, the arbiter is rewarded
    # from the measured times after its switch, and the weights stay one process's
    steps = 12
    ref, model = emulated_reference_and_model(steps=steps)
    strategy = AutoPipeStrategy(
        microbatches=4, partition="uniform", adaptive="paper", adaptive_window=3, adaptive_interval=5, start_method=START
    )
    callbacks = [SlowFromStart(), Switches()]
    trainer = L.Trainer(devices=2, strategy=strategy, callbacks=callbacks, **trainer_kwargs(max_steps=steps))
    trainer.fit(model, emulated_data())
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    seen = json.loads(Path("monitor-0.json").read_text())
    assert seen == json.loads(Path("monitor-1.json").read_text()), "every rank ran the same partitions"
    assert 2.0 < seen[3]["slowdown"][1] / seen[3]["slowdown"][0] < 4.5, "the monitor sees rank 1 slowed about 3x"
    switches = json.loads(Path("paper-switches.json").read_text())
    assert switches and all(s["by"] == "paper" for s in switches), switches
    first = switches[0]
    assert first["old"] == [[0, 4], [4, 8]] and first["new"][0][1] > 4, f"the first switch gives blocks to the fast rank 0: {first}"
    assert seen[-1]["bounds"] != [[0, 4], [4, 8]]
    online = json.loads(Path("paper-online.json").read_text())
    assert online["online_steps"] > 0, "the predictor adapted on the measured iterations"
    assert [True, online["rewards"][0][1]] == online["rewards"][0] and math.isfinite(online["rewards"][0][1]), (
        "the arbiter's switch was rewarded from the measured times after it"
    )
