"""Adaptive re-partitioning (AutoPipe-RL part 1): live switches keep training exact.

A callback asks every rank for a switch at given iterations (`strategy.repartition`); the run must
end with the weights of one process trained on the same batches (fp64, <= 1e-10), whichever blocks
moved, in which direction, while gradients were being accumulated, under 1F1B, GPipe, interleaved
and 2BW. GPT tiny keeps its tied embedding / LM head on the first and last stage.
"""

from __future__ import annotations

import csv
import itertools
import json
import statistics
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from models import START, EpochPerm, max_rel_diff, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness.emulated import EmulatedBlock, set_slowdown
from lightning_pipe import AutoPipeStrategy
from lightning_pipe.adaptive.switch import check_bounds
from lightning_pipe.models import CausalLM, ModelConfig

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]
CFG = dict(vocab_size=260, n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def gpt_data(n: int = 48):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (n, 13), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=6)


def make(layers: int = 2) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(model=ModelConfig(**dict(CFG, n_layer=layers)), lr=1e-2, warmup_steps=1, max_steps=8).double()


class SwitchAt(Callback):
    """strategy.repartition(bounds) at the start of the listed iterations (on every rank); writes what
    each rank held at every training step to held-<rank>.json (the worker's state does not come back)."""

    def __init__(self, plan: dict[int, list[list[int]]]):
        self.plan, self.seen = plan, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        bounds = self.plan.get(trainer.fit_loop.total_batch_idx)
        if bounds is not None:
            trainer.strategy.repartition(bounds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        self.seen.append([[list(b) for b in strategy.cut.bounds], sorted(strategy.cut.stage.blocks())])

    def on_train_end(self, trainer, pl_module):
        Path(f"held-{trainer.global_rank}.json").write_text(json.dumps(self.seen))


def partitions_over_time(plan: dict, partition: list[int], steps: int, accumulate: int) -> list[list[list[int]]]:
    edges = [0, *itertools.accumulate(partition)]
    current = [[a, b] for a, b in zip(edges, edges[1:])]
    out = []
    for i in range(steps * accumulate):
        current = plan.get(i, current)
        out.append(current)
    return out


def single_process(layers: int, steps: int, accumulate: int = 1) -> CausalLM:
    ref = make(layers)
    L.Trainer(devices=1, **trainer_kwargs(max_steps=steps, accumulate_grad_batches=accumulate)).fit(ref, gpt_data())
    return ref


CASES = {
    # name: (devices, layers, schedule options, start partition, {iteration: bounds}, accumulate)
    "1f1b-2-forth-and-back": (2, 2, dict(schedule="1f1b"), [3, 3], {2: [[0, 1], [1, 6]], 4: [[0, 5], [5, 6]]}, 1),
    "gpipe-2-accumulating": (2, 2, dict(schedule="gpipe"), [2, 4], {3: [[0, 4], [4, 6]], 5: [[0, 3], [3, 6]]}, 2),
    "1f1b-4-two-boundaries": (
        4,
        3,
        dict(schedule="1f1b"),
        [2, 2, 2, 2],
        {2: [[0, 1], [1, 4], [4, 5], [5, 8]], 4: [[0, 3], [3, 4], [4, 7], [7, 8]]},
        1,
    ),
    "interleaved-2": (2, 3, dict(schedule="interleaved", chunks=2), [2, 2, 2, 2], {2: [[0, 1], [1, 4], [4, 5], [5, 8]]}, 1),
    # wave: chunks 0 and 3 (the tied embedding and head) on rank 0, 1 and 2 on rank 1; blocks move both ways
    "wave-2": (
        2,
        3,
        dict(schedule="wave", waves=1),
        [2, 2, 2, 2],
        {2: [[0, 3], [3, 4], [4, 5], [5, 8]], 4: [[0, 1], [1, 4], [4, 7], [7, 8]]},
        1,
    ),
    "2bw-2-drain-then-switch": (2, 2, dict(schedule="2bw"), [3, 3], {2: [[0, 2], [2, 6]], 4: [[0, 4], [4, 6]]}, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forced_switches_keep_single_process_weights(name):
    devices, layers, options, partition, plan, accumulate = CASES[name]
    steps = 6
    if options["schedule"] == "2bw":  # 2BW's own trajectory (1-stale updates) is the reference: an unswitched run
        ref = make(layers)
        strategy = AutoPipeStrategy(microbatches=4, partition=partition, start_method=START, **options)
        L.Trainer(devices=devices, strategy=strategy, **trainer_kwargs(max_steps=steps)).fit(ref, gpt_data())
    else:
        ref = single_process(layers, steps, accumulate)
    model = make(layers)
    strategy = AutoPipeStrategy(microbatches=4, partition=partition, start_method=START, **options)
    trainer = L.Trainer(
        devices=devices,
        strategy=strategy,
        callbacks=[SwitchAt(plan)],
        **trainer_kwargs(max_steps=steps, accumulate_grad_batches=accumulate),
    )
    trainer.fit(model, gpt_data())
    assert model.model[-1].weight is model.model[0].token.weight, "the trained model comes back tied"
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    expected = partitions_over_time(plan, partition, steps, accumulate)
    for rank in range(devices):  # the switches happened where asked, and each rank held its part
        seen = json.loads(Path(f"held-{rank}.json").read_text())
        assert [bounds for bounds, _ in seen] == expected
        chunk_rank = [0, 1, 1, 0] if options["schedule"] == "wave" else list(range(devices)) * (len(expected[0]) // devices)
        for bounds, held in seen:
            assert held == [b for c, (lo, hi) in enumerate(bounds) if chunk_rank[c] == rank for b in range(lo, hi)]


# ---- resume after a switch -----------------------------------------------------------------------
def fit_with_checkpoints(folder, plan, resume=None, steps=8):
    model = make()
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=4, partition=[3, 3], start_method=START)
    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(
        devices=2, strategy=strategy, callbacks=[saver, SwitchAt(plan)], **trainer_kwargs(max_steps=steps, enable_checkpointing=True)
    )
    trainer.fit(model, gpt_data(24), ckpt_path=resume)  # 4 batches an epoch: the checkpoint at step 4 ends one
    return model.state_dict(), sorted(Path(folder).glob("*.ckpt"))


def test_resume_after_a_switch_equals_uninterrupted(tmp_path):
    weights, ckpts = fit_with_checkpoints(tmp_path / "a", {2: [[0, 2], [2, 6]]})
    uninterrupted_held = json.loads(Path("held-1.json").read_text())
    state = torch.load(ckpts[0], weights_only=False)["optimizer_states"][0]
    assert state["autopipe_bounds"] == [[0, 2], [2, 6]] and state["autopipe_switched"]
    resumed, _ = fit_with_checkpoints(tmp_path / "b", {}, resume=str(ckpts[0]))
    for k in weights:  # the partition does not change the arithmetic: bit for bit
        assert torch.equal(weights[k], resumed[k]), k
    held = json.loads(Path("held-1.json").read_text())
    assert [b for b, _ in held] == [[[0, 2], [2, 6]]] * 4, "the resumed run continues on the switched partition"
    assert held == uninterrupted_held[4:]


# ---- refusals ------------------------------------------------------------------------------------
def test_a_switch_leaving_a_worker_without_blocks_is_refused():
    with pytest.raises(ValueError, match=r"model chunk\(s\) \[1\] \(on worker\(s\) \[1\]\) with no block"):
        check_bounds([[0, 6], [6, 6]], 6, (0, 1))
    with pytest.raises(ValueError, match="must cover blocks 0..6 contiguously"):
        check_bounds([[0, 2], [3, 6]], 6, (0, 1))
    with pytest.raises(ValueError, match="has 2 chunks; this schedule runs 4"):
        check_bounds([[0, 2], [2, 6]], 6, (0, 1, 0, 1))
    model = make()
    strategy = AutoPipeStrategy(microbatches=4, partition=[3, 3], start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, callbacks=[SwitchAt({1: [[0, 6], [6, 6]]})], **trainer_kwargs(max_steps=3))
    with pytest.raises(Exception, match="with no block"):  # raised on every rank before anything moves
        trainer.fit(model, gpt_data())


def test_adaptive_settings_are_checked_by_hydra_and_the_config():
    from hydra import compose, initialize_config_dir

    from lightning_pipe.cli.paths import CONFIG_DIR
    from lightning_pipe.cli.train import pipeline_config
    from lightning_pipe.config import PipelineConfig
    from lightning_pipe.errors import SettingError

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["pipeline.adaptive=true", "pipeline.adaptive_gain=0.1", "pipeline.adaptive_interval=7"])
    config = pipeline_config(cfg)
    assert (config.adaptive, config.adaptive_gain, config.adaptive_interval) == ("rule", 0.1, 7)  # true means the rule
    with pytest.raises(SettingError, match=r"adaptive_gain=1.5: a fraction in \[0, 1\)"):
        PipelineConfig(adaptive=True, adaptive_gain=1.5)
    with pytest.raises(SettingError, match=r"adaptive_hysteresis=-0.1: a fraction in \[0, 1\)"):
        PipelineConfig(adaptive=True, adaptive_hysteresis=-0.1)
    with pytest.raises(SettingError, match=r"adaptive_hysteresis=0.05 is the rule's"):
        PipelineConfig(adaptive="learned", adaptive_hysteresis=0.05)
    assert PipelineConfig(adaptive=True, pipelines=2).adaptive == PipelineConfig(adaptive=True, width=2).adaptive == "rule"


# ---- the monitor and the rule, end to end, with one rank slowed ----------------------------------
class Emulated(L.LightningModule):
    """8 emulated blocks (2 ms forward, 4 ms backward each): a rank is slowed by set_slowdown."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*[EmulatedBlock(8, 0.002, 0.004) for _ in range(8)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.blocks(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def emulated_data(batch_size: int = 8, sampler=None):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8 * 40, 8, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.tanh(x.flip(1))), batch_size=batch_size, sampler=sampler)


def emulated_reference_and_model(steps: int = 30, width: int = 1):
    """`Emulated` trained `steps` steps in one process (fp64) on the batches `width` replicas see
    together, and a fresh copy for the pipeline."""
    torch.set_default_dtype(torch.float64)
    try:
        ref = Emulated()
        data = emulated_data(sampler=EpochPerm(8 * 40) if width > 1 else None)
        L.Trainer(devices=1, **trainer_kwargs(max_steps=steps)).fit(ref, data)
        return ref, Emulated()
    finally:
        torch.set_default_dtype(torch.float32)


class SlowRankOne(Callback):
    """Stage 1 of the last replica gets 3x slower from iteration 6; records the monitor's view and the partitions."""

    def __init__(self, slowed: int = 1):
        self.seen, self.slowed = [], slowed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == 6 and trainer.global_rank == self.slowed:
            set_slowdown(3.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        adaptive = trainer.strategy.adaptive
        latest = adaptive.monitor.latest
        self.seen.append(
            {
                "bounds": [list(b) for b in trainer.strategy.cut.bounds],
                # the monitor's gather is read a step later: at iteration k, iteration k - 1's metrics
                "slowdown": list(latest.slowdown(adaptive.monitor.static)) if latest is not None else None,
                "measured": latest.step if latest is not None else None,
                "switches": len(adaptive.switches),
                "left": [list(b) for b in adaptive.rule.left] if adaptive.rule.left is not None else None,
            }
        )

    def on_train_end(self, trainer, pl_module):
        Path(f"monitor-{trainer.global_rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.parametrize("width", [1, 2])
def test_adaptive_moves_blocks_off_a_slowed_rank_and_stays_exact(tmp_path, width):
    # width 2: only the second replica's stage 1 slows; the decision is taken on the slowest replica's
    # metrics, so every replica moves the same boundary at the same iteration
    ref, model = emulated_reference_and_model(width=width)
    strategy = AutoPipeStrategy(
        microbatches=4, partition="uniform", adaptive=True, adaptive_window=3, adaptive_interval=5, start_method=START, width=width
    )
    logger = CSVLogger(tmp_path, name="log")
    callbacks = [SlowRankOne(slowed=2 * width - 1)]
    trainer = L.Trainer(devices=2 * width, strategy=strategy, callbacks=callbacks, **trainer_kwargs(max_steps=30, logger=logger))
    trainer.fit(model, emulated_data(batch_size=8 // width))
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    seen = json.loads(Path("monitor-0.json").read_text())
    for rank in range(1, 2 * width):
        assert seen == json.loads(Path(f"monitor-{rank}.json").read_text()), "every rank sees the same metrics and partitions"
    assert seen[0]["bounds"] == [[0, 4], [4, 8]] and seen[3]["switches"] == 0, "nothing to gain while the ranks are equal"
    assert seen[0]["slowdown"] is None and [s["measured"] for s in seen[1:]] == list(range(29))
    final = seen[-1]["bounds"]
    for before, after in zip(seen, seen[1:]):  # the rule remembers the partition each switch left (its hysteresis)
        if after["switches"] > before["switches"]:
            assert after["left"] == before["bounds"] != after["bounds"], (before, after)
    if width == 2:
        # four processes share the 2 cores: whether the measured gain clears the threshold moves with the
        # load (CI saw 5 | 3 once and no switch at all once); the claim here is that the slowed replica's rank
        # is seen by every rank alike (above), that no replica switched alone, and that training stayed exact
        assert seen[8]["slowdown"][1] / seen[8]["slowdown"][0] > 1.5, "the monitor sees the slowed replica's rank 1"
        assert final[0][1] >= 4, f"blocks can only move to the fast rank 0, got {final}"
        return
    assert 0.7 < seen[5]["slowdown"][1] / seen[5]["slowdown"][0] < 1.4
    assert 2.0 < seen[8]["slowdown"][1] / seen[8]["slowdown"][0] < 4.5, "the monitor sees rank 1 slowed about 3x"
    assert final[0][1] >= 6, f"blocks moved to the fast rank 0 (balanced: 6 | 2), got {final}"
    # the logged per-stage compute tells the same story as the monitor: equal stages, then stage 1
    # about 3x slower (steps 7, 8: before any switch can act), then less on stage 1 once blocks left it
    rows = csv.DictReader((tmp_path / "log" / "version_0" / "metrics.csv").read_text().splitlines())
    logged = {
        int(r["step"]): (float(r["adaptive/stage0_compute_ms"]), float(r["adaptive/stage1_compute_ms"]))
        for r in rows
        if r["adaptive/stage0_compute_ms"]
    }
    ratio = lambda step: logged[step][1] / logged[step][0]  # noqa: E731
    assert 0.7 < statistics.median(ratio(k) for k in range(1, 6)) < 1.4, logged
    assert all(2.0 < ratio(k) < 4.5 for k in (7, 8)), logged
    after = statistics.median(logged[k][1] for k in sorted(logged)[-5:])
    assert after < 0.9 * min(logged[7][1], logged[8][1]), f"stage 1 still computes as much after the switch: {logged}"
