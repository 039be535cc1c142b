"""The README's Python API example runs as written, and the figures the public API reports (iteration
time, bubble ratio, start-up, master stage) are the ones worked out by hand for small 1F1B cases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_pipe as lp

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_runs(tmp_path, capsys):
    text = README.read_text()
    block = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert (tmp_path / "timeline.png").exists() and (tmp_path / "timeline.json").exists()
    best, timeline, costs = scope["best"], scope["timeline"], scope["costs"]
    assert isinstance(best, lp.Plan) and best.iteration_time == timeline.iteration_time
    # Blocks cost f = (2, 1, 1, 1, 1, 3), b = 2f: any 2-stage cut leaves one stage at least 1 + 2
    # heavier per micro-batch than the other (9 + 18 is odd in f). In 1F1B with 8 micro-batches
    # that stage computes a forward and a backward back to back while the other waits for it, so
    # the critical path runs along it: it is the master stage, whichever cut the planner chose.
    work = [sum(costs.forward[a:b]) + sum(costs.backward[a:b]) for a, b in best.bounds]
    assert len(work) == 2 and work[0] != work[1]
    assert timeline.master_stage == work.index(max(work))
    assert 0 < timeline.bubble_ratio < 1
    assert "stage" in capsys.readouterr().out


# Hand-worked 1F1B cases, 8 micro-batches, one block per stage, free communication.
#
# (a) 2 stages, stage 0 = (F 4, B 8), stage 1 = (F 1, B 2). Stage 1's gradient for micro-batch i is
#     back 4 + 1 + 2 = 7 after stage 0's forward i started, stage 0 is free again 4 + 4 = 8 after:
#     stage 0 never waits. Iteration 8 x 12 = 96; stage 1 busy 8 x 3 = 24 -> bubble
#     (96 - 24) / (2 x 96) = 0.375; start-up 4 (stage 1 starts micro-batch 0 when stage 0's forward
#     ends); the critical path is stage 0's F B F B ...: master 0.
# (b) the mirror image, stage 0 = (F 1, B 2), stage 1 = (F 4, B 8): stage 1 starts at 1 and never
#     waits (its next input left stage 0 long before), busy 96 until 97; stage 0's last backward
#     then takes 2: iteration 99, bubble (2 x 99 - 120) / (2 x 99) = 78 / 198; start-up 1; master 1.
# (c) 3 stages (F 1, B 2), (F 4, B 8), (F 1, B 2): the middle stage is the bottleneck, starts at 1,
#     busy 96 until 97, then stage 0's last backward: iteration 99, bubble (3 x 99 - 144) / (3 x 99)
#     = 153 / 297; start-up 1 + 4 = 5; master 1, neither end stage.
HAND_CASES = {
    "first-heavy": ((4.0, 1.0), 96.0, 72 / 192, 4.0, 0),
    "last-heavy": ((1.0, 4.0), 99.0, 78 / 198, 1.0, 1),
    "middle-heavy": ((1.0, 4.0, 1.0), 99.0, 153 / 297, 5.0, 1),
}


@pytest.mark.parametrize("case", list(HAND_CASES))
def test_simulated_1f1b_matches_the_hand_worked_timeline(case):
    forward, iteration, bubble, startup, master = HAND_CASES[case]
    stages = len(forward)
    costs = lp.CostModel(forward=forward, backward=tuple(2 * f for f in forward))
    timeline = lp.simulate(lp.build_schedule("1f1b", stages, 8), costs, [(s, s + 1) for s in range(stages)])
    assert timeline.iteration_time == pytest.approx(iteration, abs=1e-12)
    assert timeline.bubble_ratio == pytest.approx(bubble, abs=1e-12)
    assert timeline.startup == pytest.approx(startup, abs=1e-12)
    assert timeline.master_stage == master
