"""Flush: one weight version; GPipe, 1F1B, interleaved, wave, advance, zero bubble (and the slicer's halved warm-up).

The slicer's halves run in one of two forms (`slicing`): "algorithm2", AutoPipe's sliced 1F1B
(`schedules/sliced.py`: the halves back to back where their micro-batch ran, the blocked half's send
merged into its twin's), or "sweep" (ours), the schedule over the halves as micro-batches of their own.
A batch too small to halve every sliced micro-batch runs the sweep form (both are exact).

The pipeline fills and drains inside one step, so one step's gradients equal one process's on
the same batch; the optimizer step that follows is the user's, unchanged. Executors are built
once per (kind, micro-batch count, advance_num): the last batch of an epoch may split into fewer,
and AvgPipe's advance rule (`AdvanceRule`, schedule "advance" without a fixed advance_num) changes
the list between steps, the same way on every rank. zb-auto's list comes from the run's costs
(`costed`: the same on every rank), built again for a short last batch's count.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from ...runtime.executor import Executor, StageHost
from ...runtime.p2p import Transport
from ...schedules import PipelineSchedule, ScheduleSpec, forward_only, validate
from ...schedules.advance import advance_bounds
from ...schedules.sliced import paper_schedule
from ..advance.engine import AdvanceRule
from ..engine import Versions


class Flush(Versions):
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
        advance: Optional[AdvanceRule] = None,
        slicing: str = "sweep",
        costed: Optional[Callable[[int], PipelineSchedule]] = None,
    ):
        self.spec, self.stages, self.rank, self.transport = spec, stages, rank, transport
        self.costed = costed  # zb-auto: the schedule for a micro-batch count, built from the run's costs
        self.prefetch, self.trace, self.sliced, self.slicing = prefetch, trace, sliced, slicing
        self.advance = advance  # the adaptive advance_num (None: the spec's list is fixed)
        self.placement = spec.placement(stages, microbatches)  # where each model chunk lives
        self.spec_microbatches = microbatches
        self._executors: dict[tuple[str, int, int], Executor] = {}

    def _train_spec(self, microbatches: int) -> ScheduleSpec:
        if self.spec.name != "advance":
            return self.spec
        wanted = self.advance.advance_num if self.advance is not None else self.spec.kwargs["advance_num"] or self.stages - 1
        low, high = advance_bounds(self.stages, microbatches)  # a short last batch: at most its micro-batches
        return ScheduleSpec.of("advance", advance_num=min(max(wanted, low), high))

    def executor(self, kind: str, microbatches: int) -> Executor:
        spec = self._train_spec(microbatches) if kind == "train" else self.spec
        key = (kind, microbatches, dict(spec.options).get("advance_num", 0))
        if key not in self._executors:
            if kind == "train" and self.slicing == "algorithm2" and self.sliced and microbatches == self.spec_microbatches + self.sliced:
                schedule = paper_schedule(self.stages, self.spec_microbatches, self.sliced)
            elif kind == "train" and self.costed is not None:
                schedule = self.costed(microbatches)
                validate(schedule)
            elif kind == "train":
                schedule = spec.build(self.stages, microbatches)
            else:  # evaluation: forwards only, over the training placement (the chunks are where they are)
                schedule = forward_only(self.stages, microbatches, self.placement)
                validate(schedule)
            self._executors[key] = Executor(schedule, self.rank, self.transport, self.prefetch, trace=self.trace)
        return self._executors[key]

    def run(self, kind: str, host: StageHost, keys: Sequence[Any]) -> Executor:
        executor = self.executor(kind, len(keys))
        if kind != "train" or self.advance is None:
            executor.run(host, keys)
            return executor
        started = time.perf_counter()
        with self.advance.measure_stash(len(keys)):
            executor.run(host, keys)
        if len(keys) == self.spec_microbatches:  # a short last batch is faster by itself: not compared
            self.advance.observe(time.perf_counter() - started, self.transport.device)
        return executor

    def drain(self) -> None:
        pass  # nothing outlives a step

    def state_dict(self) -> dict[str, Any]:
        spec = self._train_spec(max(1, self.spec_microbatches)) if self.advance is not None else self.spec
        out: dict[str, Any] = {"schedule": [spec.name, dict(spec.options)], "sliced": self.sliced}
        if self.advance is not None:
            out["advance"] = self.advance.state_dict()
        return out
