"""Training modes: what one optimizer step runs on a rank's stage, behind one interface.

The strategy calls its mode once per step and at the edges (drain before validation, a
checkpoint or the end of fit; state for checkpoints; resume). `SyncMode` runs the synchronous
schedules (the pipeline fills and drains inside a step); `TwoBWMode` keeps PipeDream-2BW's pipeline
full across steps; `AvgPipeMode` runs one of AvgPipe's parallel pipelines and its elastic pull.
Adaptive re-partitioning (lightning_pipe.adaptive) works beside the modes: after a live switch the strategy
builds the mode again over the new cut. Modes know the runtime, never Lightning.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from ..runtime.executor import Executor, StageHost
from .avgpipe import AvgPipeMode
from .sync import SyncMode
from .two_bw import TwoBWMode


class TrainingMode(Protocol):
    def run(self, kind: str, host: StageHost, keys: Sequence[Any]) -> Executor:
        """Run one step's action list on this rank (`kind`: "train" or "eval"); keys[i] is
        micro-batch i's signature. Returns the executor that ran (for its trace)."""
        ...

    def drain(self) -> None:
        """Apply whatever is still in flight (nothing for a synchronous schedule)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this mode exactly."""
        ...


MODES: dict[str, Callable[..., TrainingMode]] = {"sync": SyncMode, "2bw": TwoBWMode, "avgpipe": AvgPipeMode}


def make_mode(name: str, **kwargs: Any) -> TrainingMode:
    if name not in MODES:
        raise ValueError(f"mode={name!r} is not a known training mode; allowed values: {sorted(MODES)}")
    return MODES[name](**kwargs)


__all__ = ["MODES", "AvgPipeMode", "SyncMode", "TrainingMode", "TwoBWMode", "make_mode"]
