"""AvgPipe's tuner of M x N (§5.2): the equations against hand computation, the choice and its
refusals, the utilisation sampler, and the whole command on real processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli import run_module
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.cli.paths import CONFIG_DIR
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.tuning import StageProfile, TuneProfile, UtilisationSampler, choose, default_grid, predict, predict_calibrated

ROOT = Path(__file__).resolve().parents[1]


def two_stages(phi=0.5, m=8, n=1, B=16) -> TuneProfile:
    # stage 0: 40 ms compute, 10 ms of messages on the wire; stage 1: 60 ms and 6 ms; phi over a 100 ms batch
    s0 = StageProfile(0.040, 0.010, ((0.05, phi), (0.05, 0.0)), model_bytes=100.0, data_bytes=40.0)
    s1 = StageProfile(0.060, 0.006, ((0.08, phi), (0.02, 0.0)), model_bytes=80.0, data_bytes=20.0)
    return TuneProfile(m, n, B, (s0, s1))


def test_equations_by_hand_without_overuse():
    # M = 4, N = 2 from (m, n) = (8, 1): r = m n* / (m* n) = 4; phi = 0.2 -> r phi = 0.8 <= 1: no extra time
    p = predict(two_stages(phi=0.2), 4, 2)
    g0, g1 = 0.040 / 4, 0.060 / 4  # Eq. 2: (m* n / (m n*)) T_gpu
    w0, w1 = 2 * 0.010, 2 * 0.006  # (n* / n) 𝕋
    c0 = w0 / 4 + 3 / 4 * max(w0 - g0, 0)  # Eq. 4
    c1 = w1 / 4 + 3 / 4 * max(w1 - g1, 0)
    up1 = (w0 + g0) / 4  # Eq. 6
    down0 = (w1 + g1) / 4  # Eq. 7
    want = [g0 + c0 + down0, g1 + c1 + up1]  # Eq. 1, 5
    assert [t[0] for t in p.terms] == pytest.approx([g0, g1])
    assert [t[1] for t in p.terms] == pytest.approx([c0, c1])
    assert p.per_batch == pytest.approx(max(want))
    assert p.throughput == pytest.approx(16 / max(want))
    # Eq. 8: (n*/n) F_mod + (m n* / (m* n)) F_dat
    assert p.memory_per_device == pytest.approx((2 * 100 + 4 * 40, 2 * 80 + 4 * 20))
    assert p.memory == pytest.approx(360.0)


def test_equations_by_hand_with_overuse():
    # r = 4, phi = 0.5: r phi = 2 > 1 for 50 ms on stage 0 and 80 ms on stage 1 -> the excess becomes time
    p = predict(two_stages(phi=0.5), 4, 2)
    g0 = (0.040 + 0.05 * (2 - 1)) / 4
    g1 = (0.060 + 0.08 * (2 - 1)) / 4
    assert [t[0] for t in p.terms] == pytest.approx([g0, g1])


@given(phi=st.floats(0.0, 1.0), m=st.integers(1, 64), n=st.integers(1, 4))
def test_the_profiled_setting_predicts_itself(phi, m, n):
    prof = two_stages(phi=phi, m=m, n=n)
    p = predict(prof, m, n)
    assert [t[0] for t in p.terms] == pytest.approx([s.compute for s in prof.stages])  # r = 1: no overuse when phi <= 1
    assert p.memory_per_device == pytest.approx([s.model_bytes + s.data_bytes for s in prof.stages])


@given(phi=st.floats(0.0, 1.0), m_star=st.integers(1, 32), n_star=st.integers(1, 8))
def test_memory_grows_with_pipelines_and_falls_with_microbatches(phi, m_star, n_star):
    prof = two_stages(phi=phi)
    p = predict(prof, m_star, n_star)
    assert predict(prof, m_star, n_star + 1).memory > p.memory
    assert predict(prof, m_star + 1, n_star).memory < p.memory
    # compute per batch never falls below the work itself spread over the pipelines (Eq. 2's floor)
    for (g, *_), s in zip(p.terms, prof.stages):
        r = 8 * n_star / m_star
        assert g >= s.compute / r - 1e-12


def test_the_choice_is_the_fastest_that_fits_and_every_candidate_is_listed():
    prof = two_stages(phi=0.2)
    free = choose(prof, [1, 2, 4, 8], [1, 2, 4])
    assert len(free.candidates) == 12 and sum(c.verdict == "chosen" for c in free.candidates) == 1
    assert free.chosen.per_batch == min(c.per_batch for c in free.candidates)
    limit = sorted(c.memory for c in free.candidates)[5]  # half of the grid fits
    capped = choose(prof, [1, 2, 4, 8], [1, 2, 4], memory_limit=limit)
    fits = [c for c in capped.candidates if c.memory <= limit]
    assert capped.chosen.per_batch == min(c.per_batch for c in fits) and capped.chosen.memory <= limit
    assert {c.verdict for c in capped.candidates if c.memory > limit} == {"over memory_limit"}
    table = capped.table()
    assert table.count("\n") == 1 + 12 and "chosen" in table
    d = capped.to_dict()
    assert d["chosen"] == {"microbatches": capped.chosen.microbatches, "pipelines": capped.chosen.pipelines}
    assert TuneProfile.from_dict(d["profile"]) == prof


def test_refusals_name_the_setting():
    prof = two_stages()
    with pytest.raises(SettingError, match="below what one pipeline's model needs") as err:
        choose(prof, [1, 2], [1], memory_limit=50.0)
    assert err.value.setting == "memory_limit"
    with pytest.raises(SettingError, match=r"no \(M, N\) in tune_microbatches=\[1, 2\] x tune_pipelines=\[2, 4\] fits") as err:
        choose(prof, [1, 2], [2, 4], memory_limit=150.0)
    assert err.value.setting == "memory_limit"
    with pytest.raises(SettingError, match=r"\[32\] exceed the batch size 16") as err:
        default_grid(16, [4, 32], None)
    assert err.value.setting == "tune_microbatches"
    assert default_grid(12, None, None) == ([1, 2, 4, 8], [1, 2, 4])
    for bad, name in ((dict(tune_pipelines=[0, 2]), "tune_pipelines"), (dict(tune_microbatches=[]), "tune_microbatches")):
        with pytest.raises(SettingError) as err:
            PipelineConfig(pipelines=2, **bad)
        assert err.value.setting == name
    with pytest.raises(SettingError, match="python -m lightning_pipe.train ... pipeline.tune=true") as err:
        AutoPipeStrategy(pipelines=2, tune=True)
    assert err.value.setting == "tune"


def test_utilisation_is_the_busy_fraction_of_the_core():
    sampler = UtilisationSampler(interval=0.005, threads=1).start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.15:  # busy
        pass
    t1 = time.perf_counter()
    time.sleep(0.15)  # idle
    t2 = time.perf_counter()
    sampler.stop()

    def mean(curve):
        return sum(d * phi for d, phi in curve) / sum(d for d, _ in curve)

    assert mean(sampler.curve(t0, t1)) > 0.8
    assert mean(sampler.curve(t1, t2)) < 0.2
    assert math.isclose(sum(d for d, _ in sampler.curve(t0, t2)), t2 - t0, rel_tol=0.05)


# ---- the commands on real processes ---------------------------------------------------------------
def run(module, args, cwd, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("LOCAL_RANK", "LIGHTNING_PIPE_TUNED", "LIGHTNING_PIPE_TUNE_RECORD"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


TUNE = ["recipe=gpt-tiny-avgpipe", "pipeline.tune=true", "pipeline.tune_batches=3", "data.max_bytes=300000"]
TUNE += ["pipeline.tune_microbatches=[2,4]", "pipeline.tune_pipelines=[1,2]"]
# every job forks its second rank instead of re-running its command line (the tuner's profile runs get the
# setting with the rest): what these tests check, the profiles, the grid and the chosen job, is the same
TUNE += ["pipeline.start_method=fork"]
PAPER = ["pipeline.tune_model=paper"]  # §5.2's Eq. 1-8 from one profile (the default is ours, calibrated)


def calibration_points():
    # N = 1 profiles at M = 1 and M = 8 of two stages: computation, wire, step wall, start-to-start period
    lo = (
        StageProfile(0.050, 0.002, (), 100.0, 40.0, wall=0.080, period=0.100),
        StageProfile(0.024, 0.002, (), 80.0, 20.0, wall=0.080, period=0.096),
    )
    hi = (
        StageProfile(0.071, 0.009, (), 100.0, 40.0, wall=0.090, period=0.110),
        StageProfile(0.031, 0.009, (), 80.0, 20.0, wall=0.090, period=0.114),
    )
    return TuneProfile(8, 1, 16, hi), TuneProfile(1, 1, 16, lo)


def test_calibrated_prediction_by_hand():
    hi, lo = calibration_points()
    p = predict_calibrated(hi, lo, 4, 2)
    c = [0.050 + (0.071 - 0.050) * 3 / 7, 0.024 + (0.031 - 0.024) * 3 / 7]  # the line through M = 1 and M = 8, at 4
    w = [0.002 + 0.007 * 3 / 7] * 2
    o = [(0.020 + 0.020) / 2, (0.016 + 0.024) / 2]  # period - wall, mean of both points
    t = [(c[k] + w[k]) / 4 for k in range(2)]
    critical = t[0] + t[1] + 3 * max(t) + max(o)  # one pipeline's flush schedule and its outside work
    device = [2 * (c[k] + w[k] + o[k]) for k in range(2)]  # the N = 2 pipelines' work on each device
    assert [x for t in p.terms for x in t] == pytest.approx([c[0], w[0], critical, o[0], c[1], w[1], critical, o[1]])
    assert p.per_batch == pytest.approx(max(max(device), critical) / 2)
    assert p.throughput == pytest.approx(16 / p.per_batch)
    assert p.memory_per_device == pytest.approx((2 * 100 + 8 / 4 * 2 * 40, 2 * 80 + 8 / 4 * 2 * 20))  # Eq. 8
    # M = 1, N = 1: nothing overlaps, the batch is the sum of the stages plus the outside work
    one = predict_calibrated(hi, lo, 1, 1)
    assert one.per_batch == pytest.approx(0.050 + 0.002 + 0.024 + 0.002 + 0.020)
    # M = 1, N = 2: the second pipeline fills the first one's bubble: the device's work bounds it
    assert predict_calibrated(hi, lo, 1, 2).per_batch == pytest.approx(max(0.050 + 0.002 + 0.020, one.per_batch / 2))


@given(m=st.integers(1, 16), n=st.integers(1, 4), extra=st.integers(1, 4))
def test_calibrated_time_per_batch_never_grows_with_pipelines_and_is_bounded_by_the_work(m, n, extra):
    hi, lo = calibration_points()
    p, more = predict_calibrated(hi, lo, m, n), predict_calibrated(hi, lo, m, n + extra)
    assert more.per_batch <= p.per_batch + 1e-15  # more pipelines fill more bubble, never add any
    work = max(c + w + o for c, w, _, o in p.terms)
    assert p.per_batch >= work - 1e-15 and p.per_batch == pytest.approx(max(work, p.terms[0][2] / n))


def test_tune_model_is_checked():
    with pytest.raises(SettingError, match="tune_model='fast': one of 'paper'"):
        PipelineConfig(tune_model="fast")


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_plan_profiles_one_setting_and_predicts_the_grid(tmp_path):
    done = run("lightning_pipe.plan", [*TUNE, *PAPER], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("outputs/*/*/tune.json")
    result = json.loads(path.read_text())
    assert {(c["microbatches"], c["pipelines"]) for c in result["candidates"]} == {(2, 1), (2, 2), (4, 1), (4, 2)}
    chosen = result["chosen"]
    assert f"chosen: M={chosen['microbatches']}, N={chosen['pipelines']}" in done.stdout
    assert done.stdout.count("fits") + done.stdout.count("chosen") >= 4
    profile = result["profile"]
    assert (profile["microbatches"], profile["pipelines"], profile["batch_size"]) == (4, 1, 8)  # the largest M, N = 1
    assert result["model"] == "paper" and result["profile_lo"] is None and not (path.parent / "tune_profile_lo").exists()
    records = sorted(path.parent.glob("tune_profile/ranks/rank*.json"))
    assert len(records) == 2
    for stage, record in zip(profile["stages"], map(lambda p: json.loads(p.read_text()), records)):
        assert 0 < stage["compute"] <= stage["wall"]  # the forwards and backwards are inside the step
        assert record["steps"] == 3 and record["messages"] > 0 and record["comm_total"] > 0
        busy = sum(d * phi for d, phi in stage["utilisation"])
        assert 0 < busy <= sum(d for d, _ in stage["utilisation"]) + 1e-9
        assert stage["data_bytes"] > 0
    # the model bytes are what AdamW holds for the stages: weights, gradients and two moments, fp32
    # (the tied embedding is held by the first and the last stage: a few % more)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        params = sum(p.numel() for p in instantiate(compose("config", overrides=["recipe=gpt-tiny-avgpipe"]).model).parameters())
    total = sum(s["model_bytes"] for s in profile["stages"])
    assert 16 * params <= total <= 16 * params * 1.1


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_train_tunes_then_runs_the_chosen_job(tmp_path):
    args = [
        *TUNE,
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false",
    ]  # the default tune_model: calibrated (ours)
    done = run("lightning_pipe.train", args, tmp_path, timeout=550)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("outputs/*/*/tune.json")
    chosen = json.loads(path.read_text())["chosen"]
    log = (path.parent / "train.log").read_text()
    assert f"tuner: M={chosen['microbatches']}, N={chosen['pipelines']}" in log
    resolved = OmegaConf.load(path.parent / "config_resolved.yaml")
    # K = 2 devices whatever N: the chosen pipelines share them (N processes per device)
    assert resolved.trainer.devices == 2 and resolved.pipeline.microbatches == chosen["microbatches"]
    partition = json.loads(path.read_text())["partition"]  # the profiled run's plan, reused (not planned again)
    assert sum(partition) == 10 and list(resolved.pipeline.partition) == partition
    assert len(list(path.parent.glob("tune_profile/ranks/rank*.json"))) == 2  # profiled once, not by every worker
    # calibrated (ours): the second point at the grid's smallest M, on the first point's partition
    tuned = json.loads(path.read_text())
    assert tuned["model"] == "calibrated" and tuned["profile_lo"]["microbatches"] == 2 and tuned["profile"]["microbatches"] == 4
    assert len(list(path.parent.glob("tune_profile_lo/ranks/rank*.json"))) == 2
    lo_config = OmegaConf.load(path.parent / "tune_profile_lo" / "config_resolved.yaml")
    assert list(lo_config.pipeline.partition) == partition and lo_config.pipeline.microbatches == 2
    assert set(tuned["candidates"][0]["terms_per_device"][0]) == {"C", "W", "L", "O"}


def test_bad_tuner_settings_are_one_line_before_any_process(tmp_path):
    # refused before any process starts: both commands forked from the tests' fork server (tests/_cli.py)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LIGHTNING_PIPE_TUNED", "LIGHTNING_PIPE_TUNE_RECORD")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = run_module("lightning_pipe.plan", ["recipe=gpt-tiny-cpu", "pipeline.tune=true"], tmp_path, env, timeout=60)
    assert done.returncode == 2 and "tune=true is AvgPipe's tuner" in done.stderr and "pipeline.tune" in done.stderr
    args = ["recipe=gpt-tiny-avgpipe", "pipeline.tune=true", "pipeline.tune_microbatches=[4,64]"]
    done = run_module("lightning_pipe.train", args, tmp_path, env, timeout=60)
    assert done.returncode == 2 and "[64] exceed the batch size 8" in done.stderr and "pipeline.tune_microbatches" in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("error:")]) == 1
    assert not list(tmp_path.glob("outputs/*/*/tune_profile"))
