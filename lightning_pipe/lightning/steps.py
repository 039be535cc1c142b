"""One rank's part of a Lightning step: the batch's micro-batches through the composed layers.

Per step the batch is split (the slicer's halves become micro-batches of their own), the runner
(the weight-versions layer) runs this rank's action list with `LightningHost` calling the user's step methods, under the
precision plugin's context and with ``module.log`` redirected to a recorder; then the loss and
everything the last stage logged reach every rank (`logs.LogBroadcaster`) and are logged there, in a
training step during the schedule's waits where the values have landed by then.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ..modes.engine import Versions
from ..modes.lightning import PartitionLayer
from ..runtime.microbatch import batch_size, signature, split_microbatches
from ..runtime.tensor_parallel import split_logits
from .context import RankContext
from .gradients import GradientStash, StageGradients
from .host import LightningHost
from .logs import LogBroadcaster, replay, silence_sync_dist_advice
from .metric_state import attach
from .outputs import merge_outputs


class Layers(Protocol):
    """What a step uses of the composed layers (`compose.Training` is one)."""

    runner: Optional[Versions]
    partition: PartitionLayer
    gradients: Optional[StageGradients]

    def drain(self) -> None: ...

    def showing_model(self) -> ContextManager[None]: ...

    def keep_trace(self, executor: Any) -> None: ...


class PipelineSteps:
    def __init__(self, ctx: RankContext, layers: Layers, host: LightningHost, group: Optional[Any], last: int, logs: LogBroadcaster):
        self.ctx, self.layers, self.host = ctx, layers, host
        self.module, self.cut, self.device, self.microbatches = ctx.module, ctx.cut, ctx.device, ctx.config.microbatches
        self.group, self.last = group, last  # the pipeline's process group (None: one stage); the last chunk's global rank
        self.logs = logs
        self.logged_early: Optional[float] = None  # this step's loss where its logs were logged during the step
        self.trace_group = group if ctx.config.trace else None
        self.stash = GradientStash()
        self.replicas = ctx.topology.width  # pipelines side by side, each evaluating its shard
        self.recording: Optional[Any] = None  # the tuner's profile run (tune_record.TuneRecording)

    @classmethod
    def build(cls, ctx: RankContext, layers: Layers, previous: Optional["PipelineSteps"] = None) -> "PipelineSteps":
        """`previous`: the steps over the cut before a live switch (its log channel stays)."""
        cut = ctx.cut
        host = LightningHost(ctx.module, cut.stage, len(cut.placement) - 1, layers.gradients.reduce_chunk)
        attach(ctx.module, ctx.groups.stage, ctx.topology.width)
        if ctx.topology.width == 1 and ctx.config.pipelines is None:
            silence_sync_dist_advice()
        last, group = ctx.pipeline_rank(cut.loss_stage), ctx.pipeline_group
        if previous is not None and previous.logs.src == last:
            logs = previous.logs
        else:  # the frames' group is collective to make: every rank builds its steps together
            if previous is not None:
                frames = previous.logs.frames
            else:
                frames = ctx.groups.own_pipeline_group() if group is not None else None
            logs = LogBroadcaster(group, last, ctx.device, ctx.global_rank == last, frames)
        return cls(ctx, layers, host, group, last, logs)

    def _run(self, kind: str, step: str, context: Callable, args: tuple, kwargs: dict, m: int, scaler: Any = None) -> float:
        module, host = self.module, self.host
        microbatches, weights = split_microbatches(args[0], m, sliced=self.cut.sliced if kind == "train" else 0)
        # a fine-grained switch's early micro-batches cross the old boundary: other shapes, other keys
        early = self.cut.stage.early if kind == "train" else 0
        keys = [(kind, signature(mb)) + (("before switch",) if i < early else ()) for i, mb in enumerate(microbatches)]
        host.begin(step, microbatches, weights, args[1:], kwargs, scaler.scale if scaler is not None else None)
        self._arm_early_logs(kind)
        module.log = host.recorder  # type: ignore[method-assign]
        if self.logs.is_src and host.recorder.metrics is not None:
            host.recorder.metrics.begin()  # the micro-batches build each metric's batch state
        if self.trace_group is not None:
            dist.barrier(group=self.trace_group)  # a common start, so the ranks' traces line up
        partition, runner = self.layers.partition, self.layers.runner
        if kind == "train":
            partition.begin_step()
        self.logs.post(kind)
        try:
            with context(), split_logits() if kind == "train" and self.ctx.config.loss_parallel else contextlib.nullcontext():
                if self.recording is not None and kind == "train":
                    executor = self.recording.around(lambda: runner.run(kind, host, keys), len(keys), args[0])
                else:
                    executor = runner.run(kind, host, keys)
        finally:
            del module.log
        if kind == "train":
            partition.end_step(executor, len(keys))
        if self.trace_group is not None and kind == "train":
            self.layers.keep_trace(executor)
        host.on_forwards_done = host.on_idle = None
        if self.logged_early is not None:
            return self.logged_early
        loss, entries = self.logs.exchange(host.recorder, host.loss if host.loss is not None else 0.0, kind)
        replay(module.log, entries, self.device, sync=kind == "eval" and self.replicas > 1)
        return loss

    def _arm_early_logs(self, kind: str) -> None:
        """Ours: in a training step the last stage sends its logs after its last forward, and the other
        ranks log them while they wait for a gradient, instead of after their last backward: on the
        first stage, which ends every 1F1B step, that end is the critical path (docs/results/predictions.md)."""
        self.logged_early = None
        host, logs = self.host, self.logs
        host.on_forwards_done = host.on_idle = None
        if kind != "train" or logs.frames is None:
            return
        if logs.is_src:
            host.on_forwards_done = lambda: logs.send_early(host.recorder, host.loss, kind)
            return
        log = functools.partial(type(self.module).log, self.module)  # the real one: module.log is the recorder now

        def log_if_arrived() -> None:
            if self.logged_early is None and (got := logs.arrived(host.recorder, kind)) is not None:
                loss, entries = got
                replay(log, entries, self.device)
                self.logged_early = loss

        host.on_idle = log_if_arrived

    def train(self, context: Callable, args: tuple, kwargs: dict, scaler: Any) -> Tensor:
        """training_step: the schedule's gradients are set aside from Lightning's zero_grad."""
        run = lambda: self._run("train", "training_step", context, args, kwargs, self.microbatches, scaler)  # noqa: E731
        loss = self.stash.around_step(list(self.module.parameters()), run)
        dtype = self.host.loss.dtype if self.host.loss is not None else torch.get_default_dtype()
        return torch.tensor(loss, dtype=dtype, device=self.device)

    def backward(self, accumulate: int) -> None:
        """The schedule already ran the backward: put its gradients where the optimizer expects them."""
        self.stash.put_back(list(self.module.parameters()), accumulate)
        self.layers.partition.after_backward()

    def evaluate(self, step: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        """validation/test/predict: forwards only, on the weights the run shows; the outputs are the
        last chunk's rank's."""
        self.layers.drain()
        with self.layers.showing_model():
            self._run("eval", step, context, args, kwargs, min(self.microbatches, batch_size(args[0])))
        return merge_outputs(self.host.outputs) if self.ctx.stage_index == self.cut.loss_stage else None

    def from_last_stage(self, output: Any) -> Any:
        """The last chunk's rank's `output` on every rank of the pipeline."""
        if self.group is None:
            return output
        box = [output]
        dist.broadcast_object_list(box, self.last, group=self.group, device=self.device)
        return box[0]
