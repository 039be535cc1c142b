"""Part 1's switching rule (ours; part 2 replaces it with AutoPipe-RL's learned arbiter).

Switch to the best candidate when, over the iterations left, it is predicted to save at least
`gain` of the time the current partition would take, after paying the switch:

    (T_now * n - (T_best * n + C)) / (T_now * n) >= gain

T: predicted iteration times (the scorer, on the same measured costs, so its bias cancels);
n: iterations left (a horizon when the run has no end); C: the switch's predicted seconds, from the
last measured switch (seconds per byte moved plus a fixed part), else from the link bandwidth.
At most one switch per `interval` iterations, and none before `window` iterations were measured
since the start or the last switch (the decision reads the median of that window).

Hysteresis (ours, off by default): a switch back to the partition the last switch left must save
`gain + hysteresis`, so a prediction that sits at the threshold on noisy medians cannot flip the
partition back and forth; every other candidate still needs `gain`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .switch import Bounds


def _bounds(value: Optional[Sequence[Sequence[int]]]) -> Optional[Bounds]:
    return None if value is None else tuple((int(lo), int(hi)) for lo, hi in value)


@dataclass
class SwitchRule:
    gain: float = 0.05
    interval: int = 20
    window: int = 5
    horizon: int = 1000  # iterations assumed left when the run's length is unknown
    fixed_s: float = 0.05  # a switch's cost beyond its bytes: groups rebuilt, schedule rebuilt (until measured)
    per_byte_s: Optional[float] = None  # measured seconds per byte moved (None: 1 / bandwidth)
    last_switch: int = -(10**9)  # iteration of the last switch
    hysteresis: float = 0.0  # extra gain a switch back to `left` must predict (ours; 0: the rule as above)
    left: Optional[Bounds] = None  # the partition the last switch left

    def cost(self, moved_bytes: float, bandwidth: float) -> float:
        per_byte = self.per_byte_s if self.per_byte_s is not None else 1.0 / bandwidth
        return self.fixed_s + per_byte * moved_bytes

    def measured(self, seconds: float, moved_bytes: float, bandwidth: float) -> None:
        """Learn from a switch: its bytes at the link's rate, the rest fixed."""
        self.per_byte_s = 1.0 / bandwidth
        self.fixed_s = max(0.0, seconds - moved_bytes / bandwidth)

    def predicted_gain(self, now: float, best: float, left: Optional[float], cost: float) -> float:
        n = self.horizon if left is None or left <= 0 else left
        return (now * n - (best * n + cost)) / (now * n)

    def required(self, candidate: Sequence[Sequence[int]]) -> float:
        """The gain `candidate` must predict: more when it is the partition just left."""
        return self.gain + (self.hysteresis if self.left is not None and _bounds(candidate) == self.left else 0.0)

    def choose(
        self,
        now: float,
        scored: Sequence[tuple[float, Bounds]],
        left: Optional[float],
        cost: Callable[[Bounds], float],
    ) -> Optional[tuple[Bounds, float, float]]:
        """Of the scored (seconds, bounds) candidates, the one predicted to save the most among those
        that clear their required gain: (bounds, gain, seconds), or None to stay."""
        best: Optional[tuple[Bounds, float, float]] = None
        for seconds, bounds in scored:
            gain = self.predicted_gain(now, seconds, left, cost(bounds))
            if gain >= self.required(bounds) and (best is None or gain > best[1]):
                best = (bounds, gain, seconds)
        return best

    def switched(self, iteration: int, old: Sequence[Sequence[int]]) -> None:
        self.last_switch, self.left = iteration, _bounds(old)

    def allows(self, iteration: int, measured: int) -> bool:
        return iteration - self.last_switch >= self.interval and measured >= self.window

    def state_dict(self) -> dict[str, Any]:
        left = None if self.left is None else [list(b) for b in self.left]
        return {"fixed_s": self.fixed_s, "per_byte_s": self.per_byte_s, "last_switch": self.last_switch, "left": left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fixed_s, self.per_byte_s, self.last_switch = state["fixed_s"], state["per_byte_s"], state["last_switch"]
        self.left = _bounds(state.get("left"))  # checkpoints from before hysteresis have none
