"""AutoPipe-RL part 2: the learned speed predictor, the RL arbiter, their weight files, and
adaptive=learned end to end (a real Trainer on real processes, exact weights across its switches)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
from models import max_rel_diff, trainer_kwargs
from test_adaptive import SlowRankOne, emulated_data, emulated_reference_and_model

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.adaptive import offline
from lightning_pipe.adaptive.learned import load_learned
from lightning_pipe.adaptive.predictor import WEIGHTS
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError


@pytest.fixture(scope="module")
def small_world():
    """A small simulated training set and a held-out one (seeds fixed), and a predictor trained on it."""
    train = offline.generate(150, 2, seed=11)
    held = offline.generate(40, 2, seed=12)
    model = offline.train_predictor(train, 2, epochs=15, seed=0)
    return train, held, model


def test_predictor_learns_iteration_times_better_than_a_constant(small_world):
    train, held, model = small_world
    scores = offline.evaluate_predictor(model, held)
    constant = offline.constant_error(train, held)
    assert scores["mean_relative_error"] < 0.5 * constant, (scores, constant)
    assert scores["median_spearman_over_candidates"] > 0.6, scores  # it orders one scenario's candidates


def test_arbiter_earns_more_than_either_constant_decision(small_world):
    _, _, model = small_world
    data = offline.decisions(model, offline.generate(300, 2, seed=13), seed=1)
    train, held = data[:240], data[240:]
    arbiter = offline.train_arbiter(train, epochs=300, seed=0)
    learned = offline.mean_reward(lambda d: arbiter.switch(d.features)[0], held)
    always = offline.mean_reward(lambda d: True, held)
    assert learned > max(0.0, always), (learned, always)  # never switching earns 0


def test_spearman_by_hand():
    assert offline.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert offline.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert offline.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


def test_shipped_weights_load_and_bad_files_are_named(tmp_path):
    for depth in (2, 4):
        learned = load_learned(None, depth)
        assert learned.predictor.depth == depth
    folder = tmp_path / "w"
    shutil.copytree(WEIGHTS, folder)
    (folder / "predictor_d2.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=f"adaptive weights {folder / 'predictor_d2.pt'}: cannot be read"):
        load_learned(folder, 2)
    shutil.copy(WEIGHTS / "predictor_d4.pt", folder / "predictor_d2.pt")  # another depth's file
    with pytest.raises(ValueError, match=r"predictor_d2.pt: depth is 4, needed 2"):
        load_learned(folder, 2)
    shutil.copy(WEIGHTS / "predictor_d2.pt", folder / "predictor_d2.pt")
    shutil.copy(WEIGHTS / "predictor_d2.pt", folder / "arbiter.pt")  # another network's file
    with pytest.raises(ValueError, match=r"arbiter.pt: kind is 'speed_predictor', needed 'arbiter'"):
        load_learned(folder, 2)
    with pytest.raises(FileNotFoundError, match=r"predictor_d3.pt: no such file"):
        load_learned(folder, 3)
    # refused before any process starts, naming the setting and the file
    config = PipelineConfig(adaptive="learned", adaptive_weights=str(folder))
    with pytest.raises(SettingError, match="arbiter.pt") as error:
        config.check_world(2)
    assert error.value.setting == "adaptive_weights"


def test_adaptive_values():
    assert PipelineConfig(adaptive=True).adaptive == "rule"
    assert PipelineConfig(adaptive="learned").adaptive == "learned"
    assert PipelineConfig(adaptive="false").adaptive is False
    with pytest.raises(SettingError, match="one of rule"):
        PipelineConfig(adaptive="sometimes")
    with pytest.raises(SettingError, match="adaptive=learned with schedule='wave'"):
        PipelineConfig(adaptive="learned", schedule="wave")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_learned_mode_moves_blocks_off_a_slowed_rank_and_stays_exact(tmp_path):
    ref, model = emulated_reference_and_model()
    strategy = AutoPipeStrategy(
        microbatches=4, partition="uniform", adaptive="learned", adaptive_window=3, adaptive_interval=5, start_method="spawn"
    )
    trainer = L.Trainer(devices=2, strategy=strategy, callbacks=[SlowRankOne()], **trainer_kwargs(max_steps=30))
    trainer.fit(model, emulated_data())
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    seen = json.loads(Path("monitor-0.json").read_text())
    assert seen == json.loads(Path("monitor-1.json").read_text())
    assert seen[5]["bounds"] == [[0, 4], [4, 8]], "no switch while the ranks are equal"
    assert seen[-1]["bounds"][0][1] >= 5, f"blocks moved to the fast rank 0, got {seen[-1]['bounds']}"
