"""Zero bubble in planning: the profiler measures each block's BI and W, `schedule="auto"` simulates
the zero-bubble candidates on such a profile only, and picks one only where it is predicted faster."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.planning.auto import choose_schedule
from lightning_pipe.profiling.blocks import Profile, profile_blocks
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, simulate


def test_the_profiler_splits_each_backward_into_bi_and_w(tmp_path):
    torch.manual_seed(0)
    width = 384
    blocks = [nn.Linear(width, width), nn.Sequential(nn.Tanh(), nn.Tanh()), nn.Linear(width, width)]
    measured = profile_blocks(blocks, torch.randn(256, width), torch.device("cpu"), repeats=6, warmup=2, inflight=2)
    w = [measured[i]["weight"] for i in range(3)]
    bi = [measured[i]["backward_input"] for i in range(3)]
    split = [x + y for x, y in zip(bi, w)]
    assert w[0] > 0.8 * split[0]  # the pipeline's input is data: the first block's backward is all W
    assert w[1] < 0.2 * split[1]  # no weights: its W has nothing to do
    assert 0.2 * split[2] < w[2] < 0.8 * split[2]  # a matmul's weight gradient costs about its input gradient
    b = [measured[i]["backward"] for i in range(3)]
    profile = Profile("m", 256, "float32", "cpu", [1.0] * 3, b, [0.0] * 3, [0.0] * 3, weight=w, backward_input=bi)
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded.costs().weight == tuple(w) and loaded.costs().backward_input == tuple(bi)
    assert Profile.load(Profile.synthetic([1.0, 1.0]).save(tmp_path / "s.json")).costs().weight == ()


def test_the_simulator_charges_a_measured_split_its_own_cost():
    # BI + W measured at 1.5x the whole backward (the cut's own calls): a split schedule pays it
    costs = CostModel.uniform(4, 1.0, 2.0, weight=(1.5,) * 4, backward_input=(1.5,) * 4)
    zb = simulate(build_schedule("zb-h1", 4, 8), costs, [(i, i + 1) for i in range(4)])
    assert sum(e.end - e.start for e in zb.computes(1)) == pytest.approx(8 * (1.0 + 3.0))
    one = simulate(build_schedule("1f1b", 4, 8), costs, [(i, i + 1) for i in range(4)])
    assert sum(e.end - e.start for e in one.computes(1)) == pytest.approx(8 * (1.0 + 2.0))
    with pytest.raises(ValueError, match="backward_input .* comes with weight"):
        CostModel.uniform(2, 1.0, 2.0, backward_input=(1.0,) * 2)


def test_auto_simulates_zero_bubble_only_on_a_measured_split():
    guessed = choose_schedule(CostModel.uniform(16, 1e-3, 2e-3), 4, 8)
    verdicts = {c.name: c.verdict for c in guessed.candidates}
    assert verdicts["zb-h1"].startswith("skipped: the profile has no measured W") and verdicts["zb-v"].startswith("skipped")
    assert "zb-h1: skipped" in guessed.table()
    measured = choose_schedule(CostModel.uniform(16, 1e-3, 2e-3, weight=(1e-3,) * 16), 4, 8)
    assert measured.chosen.name == "zb-v"  # no bubble in its steady state
    times = {c.name: c.iteration_time for c in measured.candidates}
    assert times["zb-h1"] == pytest.approx((3 * 8 + 3) * 4e-3) and times["1f1b"] == pytest.approx((3 * 8 + 9) * 4e-3)


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_auto_takes_zero_bubble_only_where_it_is_predicted_faster(share):
    # with no weight-gradient time there is no W to fill a bubble: ZB-H1 is 1F1B, and the tie goes to 1F1B
    costs = CostModel.uniform(8, 1e-3, 2e-3, weight=(2e-3 * share,) * 8)
    choice = choose_schedule(costs, 4, 8, candidates=[("1f1b", {}), ("zb-h1", {})])
    times = {c.name: c.iteration_time for c in choice.candidates}
    assert choice.chosen.name == ("zb-h1" if times["zb-h1"] < times["1f1b"] * (1 - 1e-9) else "1f1b")
    assert (choice.chosen.name == "zb-h1") == (share > 0)
