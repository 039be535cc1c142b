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
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..runtime.executor import Executor
from ..schedules import Op
from .utilisation import UtilisationSampler


class SavedBytes:
    """Within the block: the bytes autograd saves for backward. A storage counts once while some
    saved tensor still holds it: in 1F1B a micro-batch's backward frees its saved tensors and the
    next forward reuses their addresses, which are new bytes (an address-only key undercounted them).
    Storages in `exclude` (e.g. the stage's parameters, counted elsewhere) are not counted."""

    def __init__(self, exclude: Any = ()) -> None:
        self.total = 0
        self._live: dict[int, int] = {}  # storage address -> saved tensors still holding it
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._hooks: Optional[Any] = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._exclude:
            return t
        if ptr not in self._live:
            self.total += storage.nbytes()
            self._live[ptr] = 0
        self._live[ptr] += 1
        weakref.finalize(t, self._release, ptr)
        return t

    def _release(self, ptr: int) -> None:
        left = self._live.get(ptr, 0) - 1
        if left > 0:
            self._live[ptr] = left
        else:
            self._live.pop(ptr, None)

    def __enter__(self) -> "SavedBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


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


def measure_link(stage: int, stages: int, to_global: Callable[[int], int], nbytes: int, device: torch.device, reps: int = 7) -> float:
    """One-way seconds of an `nbytes` message between this stage and its neighbours (median of
    `reps` round trips / 2; the larger of the two ends' sizes; a rank with two links averages them).
    Collective over the pipeline: pairs (0,1), (2,3), ... first, then (1,2), (3,4), ..."""
    if stages == 1:
        return 0.0
    out = []
    for phase in (0, 1):
        for left in range(phase, stages - 1, 2):
            if stage not in (left, left + 1):
                continue
            peer = left + 1 if stage == left else left
            size = torch.tensor([nbytes], dtype=torch.int64, device=device)
            other = torch.empty_like(size)
            if stage == left:
                dist.send(size, to_global(peer))
                dist.recv(other, to_global(peer))
            else:
                dist.recv(other, to_global(peer))
                dist.send(size, to_global(peer))
            payload = torch.zeros(max(1, int(max(nbytes, int(other.item()))) // 4), dtype=torch.float32, device=device)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                if stage == left:
                    dist.send(payload, to_global(peer))
                    dist.recv(payload, to_global(peer))
                else:
                    dist.recv(payload, to_global(peer))
                    dist.send(payload, to_global(peer))
                if device.type == "cuda":  # NCCL returns once enqueued: wait for the transfer itself
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times) / 2)
    return statistics.fmean(out) if out else 0.0
