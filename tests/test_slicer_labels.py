"""The slicer's timeline names the user's micro-batches: 32 of them, the first halved as "0a", "0b"."""

from __future__ import annotations

from lightning_pipe.planning.slicer import simulate_sliced
from lightning_pipe.simulation import CostModel, gantt


def test_sliced_timeline_labels_the_halves_and_counts_the_users_microbatches(tmp_path):
    costs = CostModel.uniform(4, 1e-3, 2e-3)
    timeline = simulate_sliced(costs, ((0, 2), (2, 4)), 32, 4)
    assert timeline.schedule.num_microbatches == 36  # 4 halves each run as their own micro-batch
    labels = [timeline.microbatch_label(m) for m in range(36)]
    assert labels[:8] == ["0a", "0b", "1a", "1b", "2a", "2b", "3a", "3b"] and labels[8:] == [str(i) for i in range(4, 32)]
    assert simulate_sliced(costs, ((0, 2), (2, 4)), 32, 0).microbatch_label(5) == "5"  # nothing sliced: the numbers
    assert gantt(timeline, tmp_path / "t.png").stat().st_size > 0
