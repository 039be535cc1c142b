"""Profiles (measured and synthetic, JSON round trip, bad input) and timeline pictures/traces."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_pipe.models import build_gpt, get_model_config
from lightning_pipe.profiler import Profile, profile_blocks
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulator import simulate
from lightning_pipe.viz import chrome_trace, gantt, traced_timeline


def test_profile_blocks_measures_every_block_and_round_trips(tmp_path):
    torch.manual_seed(0)
    blocks = list(build_gpt(get_model_config("gpt-tiny")))
    x = torch.randint(0, 256, (2, 32))
    measured = profile_blocks(blocks, x, torch.device("cpu"), repeats=2, warmup=1)
    assert sorted(measured) == list(range(len(blocks)))
    for i, m in measured.items():
        assert m["forward"] > 0 and m["backward"] > 0
        assert m["activation_bytes"] > 0
    # the FFN block holds 2 * d * 4d weights (+ biases, LN): the biggest blocks after embedding/head
    assert measured[2]["param_bytes"] > measured[1]["param_bytes"]
    assert measured[1]["activation_bytes"] == 2 * 32 * 128 * 4  # (B, T, d) float32
    field = lambda k: [measured[i][k] for i in range(len(blocks))]  # noqa: E731
    p = Profile("gpt-tiny", 2, "float32", "cpu", field("forward"), field("backward"), field("activation_bytes"), field("param_bytes"))
    path = p.save(tmp_path / "profile.json")
    q = Profile.load(path)
    assert q == p and q.key == "gpt-tiny-mbs2-float32-cpu"
    costs = q.costs(bandwidth=1e9, latency=1e-5)
    assert costs.num_blocks == len(blocks) and costs.forward == tuple(p.forward)


def test_synthetic_profile_and_bad_profiles(tmp_path):
    p = Profile.synthetic([1.0, 2.0, 3.0])
    assert p.backward == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="forward must hold finite numbers >= 0"):
        Profile.synthetic([1.0, -2.0])
    with pytest.raises(ValueError, match="backward must hold finite numbers >= 0"):
        Profile.synthetic([1.0, 1.0], [1.0, math.nan])
    with pytest.raises(ValueError, match="has 3 blocks but the model has 4"):
        p.check_blocks(4)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m", "forward": [1.0]}))
    with pytest.raises(ValueError, match="missing fields"):
        Profile.load(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Profile.load(bad)


def test_gantt_png_and_chrome_trace(tmp_path):
    t = simulate(build_schedule("1f1b", 3, 4), Profile.synthetic([1.0, 2.0, 1.0], activation_bytes=8.0).costs(bandwidth=16.0),
                 [(0, 1), (1, 2), (2, 3)])
    png = gantt(t, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(chrome_trace(t, tmp_path / "trace.json").read_text())["traceEvents"]
    computes = [e for e in trace if e.get("cat") == "compute"]
    assert len(computes) == 3 * 4 * 2
    assert max(e["ts"] + e["dur"] for e in computes) == pytest.approx(t.iteration_time * 1e6)


def test_traced_timeline_from_records():
    s = build_schedule("gpipe", 2, 1)
    index = {r: {a: i for i, a in enumerate(s.actions[r])} for r in range(2)}
    f0, b0 = [a for a in s.actions[0] if a.op.is_compute]
    f1, b1 = [a for a in s.actions[1] if a.op.is_compute]
    records = [[(index[0][f0], 10.0, 11.0), (index[0][b0], 14.0, 16.0)], [(index[1][f1], 11.5, 12.5), (index[1][b1], 12.5, 13.5)]]
    t = traced_timeline(s, records)
    assert t.iteration_time == pytest.approx(6.0) and t.busy == pytest.approx([3.0, 2.0]) and t.startup == pytest.approx(1.5)
