"""planner=2bw's answer as every rank applies it: the data `RankContext.shape` holds.

Data only, below `plan_2bw` (which chooses it) and `context` (which carries it to the helpers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TwoBWChoice:
    """What every rank applies: the planner's chosen configuration."""

    width: int
    microbatches: int
    microbatch_size: int
    schedule: str
    recompute: tuple[bool, ...]
    sizes: tuple[int, ...]  # blocks per stage
    global_batch: int

    @property
    def replica_batch(self) -> int:
        return self.microbatch_size * self.microbatches

    def settings(self) -> dict[str, Any]:
        return {
            "width": self.width,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "recompute": list(self.recompute),
            "partition": list(self.sizes),
            "planner": None,
            "global_batch": None,
        }
