"""What the tuner's profile measures on one rank (§5.2.1), while it trains `tune_batches` steps:

- computation time: the sum of the rank's forward and backward actions per step (the executor's
  trace: each compute's start, after its input arrived, to its end);
- utilisation over time: `UtilisationSampler`'s phi(t) inside each step;
- total communication time: the step's messages (this rank's sends and receives, counted by the
  transport) times the one-way time of one such message between the two neighbours, measured by a
  ping-pong after the steps (`measure_link`) — the time messages are on the wire, not the time they
  blocked compute (the equations subtract the overlap themselves);
- memory: the stage's model bytes (weights, gradients, optimizer state) and its data bytes (the
  activations autograd saved per micro-batch, times the micro-batches in flight at the peak, plus
  the stage's inputs).
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from ..runtime.executor import Executor
from ..schedules import Op
from .utilisation import UtilisationSampler


def in_flight_peak(actions: Any) -> int:
    """Micro-batches a rank's list holds activations for at its peak (forwards not yet backwarded)."""
    held = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.op is Op.BACKWARD:
            held -= 1
    return peak


class StageRecorder:
    def __init__(self, stage: int, stages: int, microbatches: int, sampler: Optional[UtilisationSampler] = None, skip: int = 1):
        self.stage, self.stages, self.microbatches = stage, stages, microbatches
        self.sampler = sampler if sampler is not None else UtilisationSampler().start()
        self.skip = skip  # the first steps pay one-off costs (headers, allocator): not profiled
        self.steps: list[dict[str, Any]] = []
        self._seen = 0
        self._starts: list[float] = []  # every recorded step's start: the period between them is a whole iteration

    def step(self, executor: Executor, started: float, ended: float, moved_bytes: int, messages: int) -> None:
        self._seen += 1
        if self._seen <= self.skip:
            return
        self._starts.append(started)
        actions = executor.actions
        compute = sum(e - s for i, s, e in executor.records if actions[i].op.is_compute)
        self.steps.append(
            {
                "wall": ended - started,
                "compute": compute,
                "bytes": moved_bytes,
                "messages": messages,
                "curve": self.sampler.curve(started, ended),
            }
        )

    def finish(self, model_bytes: float, data_bytes: float, message_seconds: float) -> dict[str, Any]:
        """The rank's profile (JSON-ready): means over the recorded steps."""
        self.sampler.stop()
        if not self.steps:
            raise ValueError(f"the tuner's profile recorded no step on stage {self.stage}: raise tune_batches above {self.skip}")
        n = len(self.steps)
        curve = [pair for s in self.steps for pair in s["curve"]]
        return {
            "stage": self.stage,
            "steps": n,
            "wall": statistics.fmean(s["wall"] for s in self.steps),
            # start to start: the schedule plus the optimizer step, AvgPipe's update and Lightning's loop
            "period": (self._starts[-1] - self._starts[0]) / (n - 1) if n > 1 else None,
            "compute": statistics.fmean(s["compute"] for s in self.steps),
            "messages": statistics.fmean(s["messages"] for s in self.steps),
            "bytes": statistics.fmean(s["bytes"] for s in self.steps),
            "message_seconds": message_seconds,
            "comm_total": statistics.fmean(s["messages"] for s in self.steps) * message_seconds,
            # phi(t) of one step: every interval of every step, their durations divided by the steps
            "utilisation": [[d / n, phi] for d, phi in curve],
            "model_bytes": model_bytes,
            "data_bytes": data_bytes,
        }
