"""AvgPipe's rule for advance_num (Algorithm 1, lines 9-10): start at 1F1B, raise by one.

After each training step at ``advance_num = a`` the rule compares the step with the one before
it. While the step got faster and the predicted peak memory of ``a + 1`` stays under the memory
limit, it raises ``a`` by one (up to M, all forwards first); the first step that is not faster,
or a raise that would not fit, settles it and it stays put for the rest of the run (the paper's
conservative strategy: it never lowers ``a``). The first `warmup` steps (3) are not compared: they
pay one-off costs (headers, allocator, caches) and got faster by themselves in our runs, which
would read as "advance helped" (the paper does not say how it skips them; this count is ours).

Every rank must run the same action list, so the inputs of the decision are agreed first: one
all-reduce (max) of (this rank's step time, "a + 1 does not fit here") over the job's default
group, only while the rule is still exploring. Peak memory of ``a + 1`` on a rank is predicted as
``static_bytes + peak_stash(a + 1) x stash_bytes``: the bytes the stage holds regardless of the
schedule (weights, gradients, optimizer state: given by the caller) plus the activations autograd
keeps per micro-batch (measured on the first step with saved-tensor hooks) times the micro-batches
in flight at the stage's peak.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ...profiling.saved import SavedBytes
from ...schedules.advance import advance_bounds, peak_stash

log = logging.getLogger(__name__)


@dataclass
class AdvanceRule:
    stages: int
    microbatches: int
    rank: int
    memory_limit: Optional[float] = None  # bytes per device; None: no limit
    static_bytes: Callable[[], float] = lambda: 0.0  # noqa: E731  weights + gradients + optimizer state of the stage
    advance_num: int = -1  # -1: start at K - 1 (1F1B)
    settled: bool = False
    stash_bytes: Optional[float] = None  # activations autograd saves per micro-batch on this rank (measured)
    history: list[tuple[int, float]] = field(default_factory=list)  # (advance_num, agreed step seconds)
    warmup: int = 3  # steps not compared (one-off costs)
    _steps: int = 0
    _last: Optional[float] = None

    def __post_init__(self) -> None:
        low, high = advance_bounds(self.stages, self.microbatches)
        if self.advance_num < 0:
            self.advance_num = low
        self.high = high
        if self.advance_num >= high:
            self.settled = True  # nothing to raise (M <= K - 1, or resumed at M)

    # ---- the two facts a decision needs ---------------------------------------------------------
    def predicted_peak(self, advance_num: int) -> float:
        held = peak_stash(self.stages, self.microbatches, advance_num)[self.rank]
        return float(self.static_bytes()) + held * float(self.stash_bytes or 0.0)

    @property
    def measuring(self) -> bool:
        return not self.settled and self.memory_limit is not None and self.stash_bytes is None

    @contextlib.contextmanager
    def measure_stash(self, microbatches: int) -> Iterator[None]:
        """Around a training step: the bytes of tensors autograd saves for backward (each storage
        once), divided by the step's micro-batches."""
        if not self.measuring:
            yield
            return
        with SavedBytes() as saved:
            yield
        self.stash_bytes = saved.total / max(1, microbatches)

    # ---- Algorithm 1, lines 9-10 -------------------------------------------------------------
    def observe(self, seconds: float, device: Optional[torch.device] = None) -> int:
        """After a training step at the current advance_num: agree, decide, return the next value."""
        self._steps += 1
        if self.settled:
            return self.advance_num
        fits = self.memory_limit is None or self.advance_num >= self.high or self.predicted_peak(self.advance_num + 1) <= self.memory_limit
        seconds, fits = _agree(seconds, fits, device)
        if self._steps <= self.warmup:  # warm-up: its time says nothing about the schedule
            return self.advance_num
        self.history.append((self.advance_num, seconds))
        faster = self._last is None or seconds < self._last
        self._last = seconds
        before = self.advance_num
        if faster and fits and self.advance_num < self.high:
            self.advance_num += 1
        else:
            self.settled = True
        if self.rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            why = "raised" if not self.settled else "at M" if before >= self.high else "no faster" if not faster else "memory_limit"
            log.info(
                f"advance rule: step {self._steps - 1} at advance_num={before} took {seconds * 1e3:.1f} ms -> {self.advance_num} ({why})"
            )
        return self.advance_num

    def state_dict(self) -> dict[str, Any]:
        return {"advance_num": self.advance_num, "settled": self.settled, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        low, high = advance_bounds(self.stages, self.microbatches)
        self.advance_num = min(max(int(state["advance_num"]), low), high)
        self.settled = bool(state["settled"]) or self.advance_num >= high
        self.history = [tuple(h) for h in state.get("history", [])]


def _agree(seconds: float, fits: bool, device: Optional[torch.device]) -> tuple[float, bool]:
    """The slowest rank's step time, and whether a + 1 fits on every rank: the same on all ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seconds, fits
    box = torch.tensor([seconds, 0.0 if fits else 1.0], dtype=torch.float64, device=device or torch.device("cpu"))
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box[0]), float(box[1]) == 0.0
