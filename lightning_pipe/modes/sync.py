"""The synchronous mode: GPipe, 1F1B, interleaved, wave (and the slicer's halved warm-up).

The pipeline fills and drains inside one step, so one step's gradients equal one process's on
the same batch; the optimizer step that follows is the user's, unchanged. Executors are built
once per (kind, micro-batch count): the last batch of an epoch may split into fewer.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..runtime.executor import Executor, StageHost
from ..runtime.p2p import Transport
from ..schedules import ScheduleSpec, forward_only, validate


class SyncMode:
    def __init__(
        self,
        spec: ScheduleSpec,
        stages: int,
        microbatches: int,
        rank: int,
        transport: Transport,
        prefetch: bool = True,
        trace: bool = False,
        sliced: int = 0,
    ):
        self.spec, self.stages, self.rank, self.transport = spec, stages, rank, transport
        self.prefetch, self.trace, self.sliced = prefetch, trace, sliced
        self.placement = spec.placement(stages, microbatches)  # where each model chunk lives
        self._executors: dict[tuple[str, int], Executor] = {}

    def executor(self, kind: str, microbatches: int) -> Executor:
        key = (kind, microbatches)
        if key not in self._executors:
            if kind == "train":
                schedule = self.spec.build(self.stages, microbatches)
            else:  # evaluation: forwards only, over the training placement (the chunks are where they are)
                schedule = forward_only(self.stages, microbatches, self.placement)
                validate(schedule)
            self._executors[key] = Executor(schedule, self.rank, self.transport, self.prefetch, trace=self.trace)
        return self._executors[key]

    def run(self, kind: str, host: StageHost, keys: Sequence[Any]) -> Executor:
        executor = self.executor(kind, len(keys))
        executor.run(host, keys)
        return executor

    def drain(self) -> None:
        pass  # nothing outlives a step

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": [self.spec.name, dict(self.spec.options)], "sliced": self.sliced}
