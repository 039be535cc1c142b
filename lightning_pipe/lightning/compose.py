"""One builder from a `PipelineConfig` to the modes' layers, and `Training`: their composition on a rank.

The strategy calls `Training` and names no layer. `Training` owns what the layers share (the stage's
gradients, the step runner; the runner of the action lists is the weight-versions layer's) and calls
every layer's hooks in one order: weight versions, replicas, partition control, controllers. A layer
gets what it uses (the context, the runner, an update callable, the planner, the live switch), never
this composition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torch import Tensor

from ..adaptive.switch import switch_blocks
from ..config import PipelineConfig
from ..modes.advance.lightning import AdvanceController
from ..modes.avgpipe.lightning import ElasticReplicas
from ..modes.engine import Versions
from ..modes.flush.lightning import FlushLayer
from ..modes.lightning import ControllerLayer, Layer, PartitionLayer, ReplicasLayer, VersionsLayer
from ..modes.partition.lightning import AdaptivePartition, StaticPartition
from ..modes.two_bw.lightning import DoubleBufferLayer
from ..modes.width.lightning import AllReduce, FullyShardedReplicas, NoReplicas, ShardedOptimizer
from ..runtime.p2p import GroupTransport, Transport
from ..runtime.tied import tied_from_groups
from .autoplan import AutoPlanner
from .checkpoint import full as full_checkpoint
from .checkpoint.keys import decode_run
from .compiling import report_graph_breaks
from .context import RankContext
from .gradients import StageGradients
from .precision import PipelinePrecisionMixin
from .signals import StepSignals
from .steps import PipelineSteps
from .tensor import keep_host_memory_returnable, parallelize_stage
from .tune_record import TuneRecording


@dataclass(frozen=True)
class LayerChoice:
    """The layer classes a config composes (what the checks before spawning ask too)."""

    versions: type[VersionsLayer]
    replicas: type[ReplicasLayer]
    partition: type[PartitionLayer]
    controllers: tuple[type[ControllerLayer], ...]

    @property
    def all(self) -> tuple[type[Layer], ...]:
        return (self.versions, self.replicas, self.partition, *self.controllers)

    def check_trainer(self, config: PipelineConfig, trainer: Any, model: Any) -> None:
        for layer in self.all:
            layer.check_trainer(config, trainer, model)


VERSIONS: dict[str, type[VersionsLayer]] = {"flush": FlushLayer, "2bw": DoubleBufferLayer}  # ScheduleKind.versions


def choose_layers(config: PipelineConfig) -> LayerChoice:
    """The one place that turns settings into layers."""
    if config.pipelines is not None:
        replicas: type[ReplicasLayer] = ElasticReplicas
    elif config.width > 1:
        replicas = {"optimizer": ShardedOptimizer, "full": FullyShardedReplicas}.get(config.shard, AllReduce)
    else:
        replicas = NoReplicas
    partition = AdaptivePartition if config.adaptive else StaticPartition
    controllers = (AdvanceController,) if config.schedule == "advance" and config.advance_num is None else ()
    return LayerChoice(VERSIONS[config.schedule_spec.kind.versions], replicas, partition, controllers)


class Training:
    """This rank's composition of the layers, over the current cut."""

    def __init__(self, ctx: RankContext, planner: AutoPlanner, precision: PipelinePrecisionMixin):
        self.ctx, self.planner = ctx, planner
        keep_host_memory_returnable(ctx)  # before the model is profiled and cut
        self.precision = precision  # the Trainer's pipeline-aware precision plugin: clips over this stage's gradients
        choice = choose_layers(ctx.config)
        self.versions = choice.versions(ctx, self.update)
        self.replicas = choice.replicas(ctx, self.versions)
        self.partition = choice.partition(ctx, planner, self)  # self: the live switch (fine_switch.Switching)
        self.controllers = [c(ctx) for c in choice.controllers]
        self.layers: list[Layer] = [self.versions, self.replicas, self.partition, *self.controllers]
        self.gradients: Optional[StageGradients] = None
        self.steps: Optional[PipelineSteps] = None
        self.signals: Optional[StepSignals] = None  # SIGTERM checked without a blocking collective per step

    @property
    def runner(self) -> Optional[Versions]:
        """The runner of the action lists (the weight-versions layer's, rebuilt over each cut)."""
        return self.versions.runner

    def keep_trace(self, executor: Any) -> None:
        self.planner.keep_trace(executor)

    # ---- building ---------------------------------------------------------------------------------
    def build_gradients(self) -> StageGradients:
        cut = self.ctx.cut
        self.gradients = StageGradients(
            cut.stage,
            cut.chunk_blocks,
            self.ctx.topology,
            self.ctx.groups,
            self.ctx.global_rank,
            cut.tied,
            average_replicas=self.replicas.averages_gradients,
            norm_over_replicas=self.replicas.shards_optimizer,
        )
        self.precision.pipeline = self.gradients
        return self.gradients

    def prepare_stage(self) -> None:
        """Before the optimizers: the replicas start from replica 0's weights, then each layer lays the stage out
        (a layer may replace parameter objects, e.g. FSDP2's: the tied copies are found again by name)."""
        self.gradients.sync_replicas()
        parallelize_stage(self.ctx)  # tensor=T: blocks split over "tp" before the replicas' layer shards them over "dp"
        for layer in self.layers:
            layer.prepare_stage()
        cut = self.ctx.cut
        if cut.tied:
            cut.tied = tied_from_groups(cut.ties, cut.bounds, cut.placement, self.ctx.stage_index, cut.stage.blocks())
            self.gradients.tied = cut.tied

    def build_runtime(self) -> None:
        """The runner and the step runner over the current cut (again after a live switch)."""
        ctx, config = self.ctx, self.ctx.config
        settings: dict[str, Any] = dict(
            spec=ctx.cut.spec,
            stages=ctx.depth,
            microbatches=config.microbatches,
            rank=ctx.stage_index,
            transport=self._transport(),
            prefetch=config.prefetch,
            trace=config.trace,
            sliced=ctx.cut.sliced,
            costed=ctx.cut.costed,
        )
        for controller in self.controllers:
            settings.update(controller.runner_options())
        runner = self.versions.build_runner(settings)
        previous = self.steps
        self.steps = PipelineSteps.build(ctx, self, previous)
        if previous is not None:
            self.steps.recording = previous.recording
        for layer in self.layers:
            layer.on_runtime(runner)

    def _transport(self) -> Transport:
        """tensor > 1: one message per tensor group crosses a cut (its first rank's), broadcast inside the group."""
        ctx = self.ctx
        if ctx.topology.tensor == 1:
            return Transport(ctx.pipeline_rank, ctx.device)
        root = ctx.topology.global_rank(ctx.replica_index, ctx.stage_index, 0)
        return GroupTransport(ctx.pipeline_rank, ctx.device, ctx.groups.tensor, root)

    def start(self, fitting: bool) -> None:
        """Optimizers exist: the runtime over the cut, every layer started; the tuner's profile run records."""
        self.build_runtime()
        for layer in self.layers:
            layer.start()
        self.steps.recording = TuneRecording.from_env(self.ctx, self.runner) if fitting else None
        if fitting and self.ctx.topology.world_size > 1:  # before the Trainer registers its SIGTERM handler
            self.signals = StepSignals.install(self.ctx.module.trainer, self.ctx.device)
        if fitting:  # ours: setup's objects (modules, the Trainer, data) out of the collector's view, so a
            gc.collect()  # full collection scans only what training makes; one over the ~400k objects of a
            gc.freeze()  # Lightning process took 0.2-0.3 s mid-step on this CPU (docs/results/predictions.md)

    def finish(self) -> None:
        """The end of fit, on every rank: nothing in flight; the tuner's profile run writes its files."""
        self.partition.finish()
        if self.ctx.config.compile:
            report_graph_breaks()
        gc.unfreeze()  # collectable again after fit (a notebook's next run)
        if self.steps.recording is not None:  # the link, then the files
            self.steps.recording.finish()
            self.steps.recording = None

    # ---- a step -----------------------------------------------------------------------------------
    def optimizer_step(self, step: Callable[[], Any]) -> Any:
        """Lightning's optimizer step: an update through every layer, or (2BW's fill: nothing is
        complete yet) Lightning's step alone, which runs the batch and finds no gradient."""
        return self.update(step) if self.versions.update_due() else step()

    def update(self, step: Callable[[], Any]) -> Any:
        """One update of the weights, wrapped by every layer (the first layer's wrapper outermost):
        Lightning's optimizer step, or the update a drain applies (2BW), so e.g. AvgPipe's elastic
        pull follows every update whichever path applies it."""
        for layer in reversed(self.layers):
            step = _wrapped(layer, step)
        return step()

    def drain(self) -> None:
        for layer in self.layers:
            layer.drain()

    @contextlib.contextmanager
    def showing_model(self) -> Iterator[None]:
        """The weights evaluation, checkpoints and the end of fit see (AvgPipe: the reference)."""
        with contextlib.ExitStack() as stack:
            for layer in self.layers:
                stack.enter_context(layer.showing_model())
            yield

    def model_state(self, read: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
        """`read()` (a state dict) of the model the run shows, drained; copied when a layer showed
        other weights, since the stage gets its own back after the block."""
        self.drain()
        with self.showing_model():
            state = read()
            if any(layer.shows_other_weights for layer in self.layers):
                state = {k: v.detach().clone() for k, v in state.items()}
        return state

    # ---- a live switch ----------------------------------------------------------------------------
    def switch(self, new: Any) -> Any:
        """Move to partition `new` (collective over the pipeline): blocks, optimizer state, tied weights
        and the layers' per-parameter state move; gradient groups, runner and step runner are rebuilt."""
        ctx, cut = self.ctx, self.ctx.cut
        makers = [m for m in (layer.switch_extras() for layer in self.layers) if m is not None]
        extras = (lambda p: {k: v for make in makers for k, v in make(p).items()}) if makers else None
        blocks = cut.stage.blocks()
        result = switch_blocks(
            blocks,
            cut.skeletons,
            cut.bounds,
            new,
            cut.placement,
            ctx.stage_index,
            ctx.pipeline_rank,
            ctx.optimizers,
            cut.ties,
            ctx.device,
            extras,
        )
        cut.bounds, cut.switched = tuple(tuple(b) for b in new), True
        cut.stage.reassign(blocks, {c: cut.bounds[c] for c, r in enumerate(cut.placement) if r == ctx.stage_index})
        cut.tied = tied_from_groups(cut.ties, cut.bounds, cut.placement, ctx.stage_index, blocks)
        self.build_gradients()
        self.build_runtime()
        for layer in self.layers:
            layer.after_switch(result.received_extras)
        return result

    # ---- checkpoints ------------------------------------------------------------------------------
    def run_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"plan_2bw": dataclasses.asdict(self.ctx.shape)} if self.ctx.shape is not None else {}
        for layer in self.layers:
            state.update(layer.run_state())
        return state

    def parameter_state(self, stored: dict[int, str], state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for layer in self.layers:
            for name, extra in layer.parameter_state(stored, state).items():
                out.setdefault(name, {}).update(extra)
        return out

    def optimizer_state(self, optimizer: Any, sharded: bool) -> dict[str, Any]:
        self.drain()
        with self._whole_optimizers(gather=not sharded):  # sharded: every rank writes the states it owns
            if sharded:
                return full_checkpoint.stage_named_state(self.ctx, optimizer, self.parameter_state)
            return full_checkpoint.full_optimizer_state(self.ctx, optimizer, self.run_state(), self.parameter_state)

    def _whole_optimizers(self, gather: bool) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for layer in self.layers:
            stack.enter_context(layer.whole_optimizers(gather))
        return stack

    def load(self, checkpoint: dict[str, Any]) -> None:
        """The optimizers' states, then every layer's."""
        with self._whole_optimizers(gather=False):
            loaded = full_checkpoint.load_optimizer_states(self.ctx, checkpoint)
        extras = self.replicas.own_extras(loaded, checkpoint)
        states = checkpoint.get("optimizer_states") or [{}]
        run = decode_run(states[0])
        for layer in self.layers:
            layer.load(run, extras, checkpoint)

    def close(self, graceful: bool) -> None:
        if self.signals is not None:
            self.signals = self.signals.finish(graceful)
        for layer in self.layers:
            layer.close(graceful)


def _wrapped(layer: Layer, step: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: layer.optimizer_step(step)
