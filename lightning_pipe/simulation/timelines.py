"""Timelines you can see: a Gantt chart PNG and a Chrome-trace JSON (chrome://tracing, Perfetto).

Both take a `Timeline`, from the simulator or from a traced real run (`traced_timeline`), so a
prediction can be put next to what happened.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Sequence

from ..schedules.actions import Op
from .simulator import Event, Timeline

log = logging.getLogger(__name__)
_warned: list[bool] = []  # the missing-matplotlib warning, once per process

COLOURS = {
    Op.FORWARD: "#4C72B0",
    Op.BACKWARD: "#DD8452",
    Op.BACKWARD_INPUT: "#C44E52",  # a split backward: its input gradient (zero-bubble's B) ...
    Op.BACKWARD_WEIGHT: "#8172B3",  # ... and its weight gradients (W)
    "comm": "#55A868",
    "idle": "#EEEEEE",
}
LABELS = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "input grad (BI)", Op.BACKWARD_WEIGHT: "weight grad (W)"}


def gantt(timeline: Timeline, path: str | Path, title: Optional[str] = None, show_comm: bool = True) -> Optional[Path]:
    """Rank x time: forward, backward, communication and idle in distinct colours, micro-batch numbers on
    the bars. Without matplotlib (an optional dependency of the strategy) no picture: None, said once."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        if not _warned:
            _warned.append(True)
            log.warning("matplotlib is not installed: timelines are not drawn (pip install 'lightning-pipe[plots]')")
        return None

    ranks = timeline.schedule.num_ranks
    scale, unit = _unit(timeline.iteration_time)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.35 * len(timeline.computes()) / max(ranks, 1) + 4), 0.7 * ranks + 1.6))
    lane = 0.8 if not show_comm else 0.6
    for r in range(ranks):
        y = ranks - 1 - r
        ax.broken_barh([(0, timeline.iteration_time * scale)], (y - 0.4, 0.8), facecolors=COLOURS["idle"])
    for e in timeline.events:
        y = ranks - 1 - e.rank
        start, width = e.start * scale, (e.end - e.start) * scale
        if e.action.op.is_compute:
            ax.broken_barh([(start, width)], (y - lane / 2, lane), facecolors=COLOURS[e.action.op], edgecolors="white", linewidth=0.5)
            if width > 0:
                mb = timeline.microbatch_label(e.action.microbatch)
                label = mb if timeline.schedule.num_chunks == ranks else f"{mb}.{e.action.chunk}"
                ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=7, color="white")
        elif show_comm and e.action.op.is_send and width > 0:
            ax.broken_barh([(start, width)], (y + lane / 2, 0.4 - lane / 2), facecolors=COLOURS["comm"])
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(ranks))])
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, timeline.iteration_time * scale)
    ax.set_title(
        title
        or f"{timeline.schedule.name}: {ranks} ranks, m={timeline.schedule.num_microbatches}, "
        f"iteration {timeline.iteration_time * scale:.3g} {unit}, bubble {timeline.bubble_ratio:.1%}"
    )
    drawn = {e.action.op for e in timeline.events if e.action.op.is_compute} or {Op.FORWARD, Op.BACKWARD}
    handles = [
        *(Patch(color=COLOURS[op], label=text) for op, text in LABELS.items() if op in drawn),
        Patch(color=COLOURS["comm"], label="send"),
        Patch(color=COLOURS["idle"], label="idle"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), frameon=False, fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    """Chrome-trace JSON: one process per rank, complete events ("X") in microseconds."""
    events = []
    for e in timeline.events:
        if not (e.action.op.is_compute or e.action.op.is_send):
            continue
        events.append(
            {
                "name": f"{e.action.op.value}{e.action.microbatch}"
                + (f" c{e.action.chunk}" if timeline.schedule.num_chunks != timeline.schedule.num_ranks else ""),
                "cat": "compute" if e.action.op.is_compute else "comm",
                "ph": "X",
                "pid": e.rank,
                "tid": 0 if e.action.op.is_compute else 1,
                "ts": e.start * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "args": {"chunk": e.action.chunk, "microbatch": e.action.microbatch},
            }
        )
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in range(timeline.schedule.num_ranks)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
    return path


def traced_timeline(schedule, records: Sequence[Sequence[tuple[int, float, float]]]) -> Timeline:
    """A Timeline from a real run: ``records[rank]`` lists ``(action index, start, end)`` in seconds
    (as the executor's trace records them), on a clock shared by the ranks (or aligned at step start)."""
    events = [Event(r, schedule.actions[r][i], s, e) for r, recs in enumerate(records) for i, s, e in recs]
    origin = min((e.start for e in events), default=0.0)
    events = [Event(e.rank, e.action, e.start - origin, e.end - origin) for e in events]
    iteration = max((e.end for e in events), default=0.0)
    busy = [sum(e.end - e.start for e in events if e.rank == r and e.action.op.is_compute) for r in range(schedule.num_ranks)]
    last = schedule.num_chunks - 1
    first = [e for e in events if e.action.op is Op.FORWARD and e.action.chunk == last and e.action.microbatch == 0]
    return Timeline(schedule, events, iteration, busy, first[0].start if first else 0.0)


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"
