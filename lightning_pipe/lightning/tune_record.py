"""The tuner's profile run, recorded inside a real training job (AvgPipe §5.2.1).

`python -m lightning_pipe.train ... pipeline.tune=true` first runs the same job at the profiled
setting (M large, N = 1) for `tune_batches` steps in a child process whose environment names a
folder (`RECORD_ENV`); there every rank measures its steps with a `StageRecorder` and, when
training ends, the link to its neighbours; then it writes `rank<global rank>.json`. The CLI reads
them (`lightning_pipe.cli.tune`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ..modes.engine import Versions
from ..profiling.link import measure_link
from ..profiling.saved import SavedBytes
from ..tuning.record import StageRecorder, in_flight_peak
from ..tuning.utilisation import UtilisationSampler
from .context import RankContext
from .cutting import held_bytes

RECORD_ENV = "LIGHTNING_PIPE_TUNE_RECORD"


class TuneRecording:
    def __init__(self, folder: Path, ctx: RankContext, runner: Versions):
        self.folder, self.ctx = folder, ctx
        sampler = UtilisationSampler(device=ctx.device).start()
        self.recorder = StageRecorder(ctx.stage_index, ctx.depth, ctx.config.microbatches, sampler)
        runner.trace = True  # executors are built on first use: every one records its actions' times
        self.transport = runner.transport
        self.per_microbatch: Optional[float] = None  # activation bytes autograd saved per micro-batch
        self.inputs = 0.0  # bytes of the stage's micro-batch inputs (the first stage: the batch itself)
        self.peak = 1
        self._steps = 0

    @classmethod
    def from_env(cls, ctx: RankContext, runner: Versions) -> Optional["TuneRecording"]:
        folder = os.environ.get(RECORD_ENV)
        return cls(Path(folder), ctx, runner) if folder else None

    def around(self, run: Any, microbatches: int, batch: Any) -> Any:
        """One training step of the mode, timed; the second one also counts saved activations."""
        self._steps += 1
        moved, messages = self.transport.moved_bytes, self.transport.messages
        params = list(self.ctx.module.parameters()) if self._steps == 2 else []
        saved = SavedBytes(exclude=params) if self._steps == 2 else None
        started = time.perf_counter()
        if saved is not None:
            with saved:
                executor = run()
        else:
            executor = run()
        ended = time.perf_counter()
        if saved is not None:
            self.per_microbatch = saved.total / max(1, microbatches)
            self.peak = in_flight_peak(executor.actions)
            self.inputs = float(_bytes(batch))
        self.recorder.step(executor, started, ended, self.transport.moved_bytes - moved, self.transport.messages - messages)
        return executor

    def finish(self) -> None:
        """Collective over the pipeline (the link's ping-pong); then this rank's file."""
        st = self.recorder
        steps = st.steps or [{"bytes": 0, "messages": 1}]
        size = int(sum(s["bytes"] for s in steps) / max(1, sum(s["messages"] for s in steps)))
        seconds = measure_link(st.stage, st.stages, self.ctx.pipeline_rank, size, self.ctx.device)
        data = self.peak * (self.per_microbatch or 0.0) + self.inputs
        out = st.finish(held_bytes(self.ctx.module, self.ctx.optimizers), data, seconds)
        out.update(
            utilisation_source=st.sampler.source,
            microbatches=st.microbatches,
            stages=st.stages,
            message_bytes=size,
            stash_per_microbatch=self.per_microbatch,
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{self.ctx.global_rank}.json").write_text(json.dumps(out))


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0
