"""AutoPipeStrategy: pipeline parallelism for an unchanged LightningModule.

The only place that knows both Lightning and the runtime, and a thin one: settings are a
`PipelineConfig` (checked there), the model is cut by `cutting`, a step is run by the training
mode (`lightning_pipe.modes`), gradients are handled by `gradients` and the precision plugin
(`precision`), checkpoints by `checkpoints`, and the launch checks live in `launchers`.
"""

from __future__ import annotations

import contextlib
from dataclasses import fields
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from typing_extensions import override

from ..adaptive.switch import switch_blocks
from ..config import PipelineConfig
from ..errors import SettingError
from ..modes import TrainingMode, make_mode
from ..planning.partition import PartitionSpec
from ..runtime.tied import tied_from_groups
from ..schedules import REGISTRY
from ..topology import ProcessGroups, Topology
from . import avgpipe, checkpoint_sharded, checkpoints, two_bw
from .adaptive import Adaptive
from .autoplan import AutoPlanner
from .cutting import Cut, cut_module, uncut_module
from .gradients import StageGradients
from .launchers import CheckedMultiProcessingLauncher, CheckedSubprocessLauncher
from .plan_2bw import TwoBWChoice, plan_in_setup, rebatched
from .precision import pipeline_precision
from .processes import ProcessGroupStrategy
from .steps import PipelineSteps
from .tune_record import TuneRecording


class AutoPipeStrategy(ProcessGroupStrategy):
    """Pipeline parallelism, planned and run by lightning-pipe: ``Trainer(strategy="autopipe")``.

    Arguments (the pipeline's are `PipelineConfig`'s fields, documented there):
        schedule: ``"gpipe"``, ``"1f1b"`` (alias ``"flush"``), ``"interleaved"``, ``"wave"``, ``"advance"``, ``"2bw"`` or ``"auto"``.
        microbatches: micro-batches per optimizer step.
        partition: a partitioner name (``"autopipe"``, ``"dp"``, ``"parameters"``, ``"exhaustive"``,
            ``"uniform"``) or blocks per stage, e.g. ``[4, 6]``.
        width: pipeline replicas (data parallel); stages = devices x nodes / width.
        pipelines, alpha, staleness: AvgPipe's N parallel pipelines joined by elastic averaging with
            one reference process per stage (None: off), the pull α (None: 1/N), the staleness bound s.
        prefetch: post receives before the compute that needs them.
        chunks: interleaved's model chunks per rank. waves: wave's Hanayo waves.
        slicer: AutoPipe slicer: True, False or a count of warm-up micro-batches to halve.
        memory_limit: bytes per device for schedule="auto", the advance rule and the tuner (None: a GPU's memory).
        advance_num: schedule="advance": forwards in advance on the first stage, K - 1 .. M (None: AvgPipe's
            Algorithm 1 raises it from K - 1 while steps get faster and memory fits).
        tune, tune_batches, tune_microbatches, tune_pipelines: AvgPipe's M x N tuner; it runs from the CLI
            (it chooses the process count), so tune=True is refused here with the commands to use.
        adaptive, adaptive_gain, adaptive_interval, adaptive_window, adaptive_weights: AutoPipe-RL's re-partitioning
            while training: "rule" (or True: move blocks between neighbouring workers when the simulator on the
            measured speeds predicts >= adaptive_gain after the switch's cost) or "learned" (the speed predictor and
            the RL arbiter; adaptive_weights: a folder of other weights); `repartition(bounds)` switches by hand.
        trace: record each action's real times; writes trace.json and a timeline picture.
        profile: a saved profile.json to plan from. bandwidth, latency: the link model for planning.
        message_costs: measure at setup what a message costs the ranks (send / receive thread time, hand-off
            delay; lightning_pipe.profiling.messages) and plan with it (a loaded profile keeps what it holds).
        start_method: ``"popen"`` (Lightning re-runs the command), ``"spawn"``, ``"fork"``, ``"forkserver"``.
        checkpoint: ``"full"`` (one file, single-process layout) or ``"sharded"`` (a directory, each rank its stage).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        timeout: seconds (or a timedelta) a silent peer or a waiting collective is given before the job
            ends naming the rank (a heartbeat; collectives give up after twice this). Default 300 s.
        process_group_backend: as for Lightning's DDPStrategy.

    ``AutoPipeStrategy.from_config(config)`` takes a `PipelineConfig` instead of the keywords.
    """

    strategy_name = "autopipe"

    def __init__(
        self,
        schedule: str = "1f1b",
        microbatches: int = 4,
        partition: PartitionSpec = "autopipe",
        width: int = 1,
        pipelines: Optional[int] = None,
        alpha: Optional[float] = None,
        staleness: int = 0,
        prefetch: bool = True,
        chunks: int = 2,
        waves: int = 1,
        slicer: Union[bool, int] = False,
        memory_limit: Optional[Union[float, str]] = None,
        advance_num: Optional[int] = None,
        tune: bool = False,
        tune_batches: int = 20,
        tune_microbatches: Optional[list[int]] = None,
        tune_pipelines: Optional[list[int]] = None,
        adaptive: Union[bool, str] = False,
        adaptive_gain: float = 0.05,
        adaptive_interval: int = 20,
        adaptive_window: int = 5,
        adaptive_weights: Optional[str] = None,
        planner: Optional[str] = None,
        global_batch: Optional[int] = None,
        recompute: Union[bool, list[bool]] = False,
        intra_bandwidth: Optional[float] = None,
        inter_bandwidth: Optional[float] = None,
        trace: bool = False,
        profile: Optional[str] = None,
        bandwidth: Optional[float] = None,
        latency: Optional[float] = None,
        message_costs: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, timedelta]] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        checkpoint: Literal["full", "sharded"] = "full",
    ) -> None:
        self.config = PipelineConfig(
            schedule=schedule,
            microbatches=microbatches,
            partition=partition,
            width=width,
            pipelines=pipelines,
            alpha=alpha,
            staleness=staleness,
            prefetch=prefetch,
            chunks=chunks,
            waves=waves,
            slicer=slicer,
            memory_limit=memory_limit,
            advance_num=advance_num,
            tune=tune,
            tune_batches=tune_batches,
            tune_microbatches=tune_microbatches,
            tune_pipelines=tune_pipelines,
            adaptive=adaptive,
            adaptive_gain=adaptive_gain,
            adaptive_interval=adaptive_interval,
            adaptive_window=adaptive_window,
            adaptive_weights=adaptive_weights,
            planner=planner,
            global_batch=global_batch,
            recompute=recompute,
            intra_bandwidth=intra_bandwidth,
            inter_bandwidth=inter_bandwidth,
            trace=trace,
            profile=profile,
            bandwidth=bandwidth,
            latency=latency,
            message_costs=message_costs,
            start_method=start_method,
            checkpoint=checkpoint,
            **({} if timeout is None else {"timeout": timeout.total_seconds() if isinstance(timeout, timedelta) else timeout}),
        )
        if self.config.tune:
            raise SettingError(
                "tune=True: AvgPipe's tuner chooses how many processes run (pipelines x stages) before they start, which a "
                "Trainer's fixed devices cannot follow; run `python -m lightning_pipe.train ... pipeline.tune=true` (it profiles, "
                "then trains with the choice), or `python -m lightning_pipe.plan ... pipeline.tune=true` and pass the chosen "
                "pipelines= and microbatches= here",
                "tune",
            )
        super().__init__(
            process_group_backend=process_group_backend,
            # Twice the heartbeat's limit: a silent peer is named by the heartbeat before a collective gives up.
            timeout=timedelta(seconds=2 * self.config.timeout),
            heartbeat_timeout=self.config.timeout,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.planner = AutoPlanner(self.config)
        self.resume_path: Optional[str] = None  # fit's ckpt_path, noted by the launcher
        self.topology: Optional[Topology] = None
        self.process_groups: Optional[ProcessGroups] = None
        self.cut: Optional[Cut] = None
        self.mode: Optional[TrainingMode] = None
        self._gradients: Optional[StageGradients] = None
        self._steps: Optional[PipelineSteps] = None
        self.adaptive: Optional[Adaptive] = None  # monitor and live switches (AutoPipe-RL), while fitting
        self.two_bw: Optional[TwoBWChoice] = None  # planner=2bw: the configuration chosen at setup
        self.two_bw_plan: Optional[Any] = None  # ... and on global rank 0 the plan with every candidate
        self._active = False  # between setup and teardown: the model is cut and the process groups live

    @classmethod
    def from_config(cls, config: PipelineConfig, **kwargs: Any) -> "AutoPipeStrategy":
        """The strategy for `config`; `kwargs` are the Lightning arguments (accelerator, ...)."""
        settings = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "stages"}
        return cls(**settings, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("autopipe", cls, description="Pipeline parallelism planned and run by lightning-pipe", override=True)
        for name in [*REGISTRY, "auto"]:
            strategy_registry.register(
                f"autopipe_{name}", cls, description=f"lightning-pipe with schedule={name!r}", override=True, schedule=name
            )

    # ---- what the run is ------------------------------------------------------------------------
    @property
    def plan(self) -> Optional[Any]:
        return self.cut.plan if self.cut is not None else None

    @property
    def schedule_choice(self) -> Optional[Any]:
        return self.cut.choice if self.cut is not None else None

    @property
    def depth(self) -> int:
        return (self.num_nodes * self.num_processes) // self.config.replicas

    @property
    def stage_index(self) -> int:
        return self.global_rank % self.depth

    @property
    def replica_index(self) -> int:
        return self.global_rank // self.depth

    # ---- Lightning plumbing (as DDP does it) ---------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = pipeline_precision(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = pipeline_precision(precision_plugin)

    @property
    @override
    def is_distributed(self) -> bool:
        # Width 1: every rank reads the user's DataLoader in its own order, as one process would, and
        # logged values are equal on all ranks. Replicas: shard by replica and reduce metrics.
        return self.config.replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline must see the same batch: shard data by replica, not by rank.
        return {"num_replicas": self.config.replicas, "rank": self.replica_index}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # planner=2bw: every replica's batch is global_batch / width rows, whatever the loader said
        return rebatched(dataloader, self.two_bw.replica_batch) if self.two_bw is not None else dataloader

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is cut into stages in setup; load the stage's part afterwards

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.config.check_world(self.num_nodes * self.num_processes)  # fail before spawning anything
        if self.config.start_method == "popen":
            self._launcher = CheckedSubprocessLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = CheckedMultiProcessingLauncher(self, start_method=self.config.start_method)

    # ---- setup: cut the model into this rank's stage and build the mode --------------------------
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("AutoPipeStrategy needs automatic optimization (automatic_optimization=True): the schedule runs the backward")
        if self.config.planner == "2bw" and self.two_bw is None:  # the run's shape is the planner's answer
            self.planner.prepare(self)
            self.two_bw, self.two_bw_plan = plan_in_setup(self)
            self.config = self.config.replace(**self.two_bw.settings())
            self.planner = AutoPlanner(self.config)
            if self.config.mode == "2bw":
                two_bw.check_trainer(trainer, module)
        self.topology = topo = Topology(self.world_size, self.config.replicas)
        if self.process_groups is None:
            self.process_groups = ProcessGroups(topo, self.global_rank)
        self.planner.prepare(self)
        if self.cut is None or module.get_submodule(self.cut.path) is not self.cut.stage:  # not cut by an earlier fit
            self.cut = cut_module(self, module)
            self._gradients = self._stage_gradients()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._gradients.sync_replicas()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._build_runtime()
        if self.config.mode == "2bw":
            two_bw.defer_schedulers(self)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._steps.recording = TuneRecording.from_env(self) if fitting else None
        self.adaptive = Adaptive(self, self.planner.profile, self.planner.costs) if fitting else None
        self._steps.adaptive = self.adaptive
        self._active = True

    def _stage_gradients(self) -> StageGradients:
        assert self.cut is not None and self.topology is not None and self.process_groups is not None
        return StageGradients(
            self.cut.stage,
            self.cut.chunk_blocks,
            self.topology,
            self.process_groups,
            self.global_rank,
            self.cut.tied,
            average_replicas=self.config.mode != "avgpipe",
        )

    def _build_runtime(self) -> None:
        """The training mode and the step runner over the current cut (again after a live switch)."""
        self.precision_plugin.pipeline = self._gradients
        extras = {}
        if self.config.mode == "2bw":  # weight versions of the stage; a drain's update is Lightning's optimizer step
            extras = {"module": self.cut.stage, "apply": lambda: (two_bw.apply_update(self), two_bw.after_update(self))}
        elif self.config.mode == "avgpipe":  # the elastic update around Lightning's optimizer step
            extras = avgpipe.mode_extras(self)
        self.mode = make_mode(self.config.mode, **self.cut.mode_settings(self), **extras)
        previous = self._steps
        self._steps = PipelineSteps.build(self, self.lightning_module, self.mode, self._gradients)
        if previous is not None:
            self._steps.recording, self._steps.adaptive = previous.recording, previous.adaptive

    # ---- adaptive re-partitioning (AutoPipe-RL; lightning/adaptive.py) ---------------------------
    def repartition(self, bounds: Any) -> Any:
        """Move to partition `bounds` (one [start, stop) block range per model chunk) at the next
        batch's start, without restarting: call it on every rank (e.g. from a callback). Checked
        now; a chunk left without a block is refused."""
        if self.adaptive is None:
            raise RuntimeError("repartition() works while fitting, after setup")
        return self.adaptive.request(bounds)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.adaptive is not None:
            self.adaptive.apply_pending()

    def switch_partition(self, new: Any) -> Any:
        """The live switch to `new` (collective over the pipeline): blocks, optimizer state, tied
        weights and 2BW's stash move; gradient groups, schedule and step runner are rebuilt."""
        cut, topo, replica = self.cut, self.topology, self.replica_index
        stashed, applied = None, 0
        if self.config.mode == "2bw":  # drain: the update in flight is applied, the stash is what the next batch reads
            self.mode.drain()
            stashed, applied = self.mode.stashed, self.mode.applied
        blocks = cut.stage.blocks()
        extras = (lambda p: {"stash": stashed[id(p)]} if id(p) in stashed else {}) if stashed else None
        result = switch_blocks(
            blocks,
            cut.skeletons,
            cut.bounds,
            new,
            cut.placement,
            self.stage_index,
            lambda r: topo.global_rank(replica, r),
            self.optimizers,
            cut.ties,
            self.root_device,
            extras,
        )
        cut.bounds, cut.switched = tuple(tuple(b) for b in new), True
        cut.stage.reassign(blocks, {c: cut.bounds[c] for c, r in enumerate(cut.placement) if r == self.stage_index})
        cut.tied = tied_from_groups(cut.ties, cut.bounds, cut.placement, self.stage_index, blocks)
        self._gradients = self._stage_gradients()
        self._build_runtime()
        if stashed is not None:
            live = {id(p) for p in self.mode.versions.live}
            carried = {pid: t for pid, t in stashed.items() if pid in live}
            carried.update({pid: e["stash"] for pid, e in result.received_extras.items() if pid in live and "stash" in e})
            self.mode.load_state(applied, carried)
        return result

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.adaptive is not None:
            self.adaptive.close()
        if self._steps is not None and self._steps.recording is not None:  # the tuner's profile run: the link, then the files
            self._steps.recording.finish()
            self._steps.recording = None

    # ---- steps (steps.py) ------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        scaler = getattr(self.precision_plugin, "scaler", None)
        return self._steps.train(self.precision_plugin.train_step_context, args, kwargs, scaler)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """No autograd here: the schedule ran the backward; its gradients go back between the precision hooks."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._steps.backward(module.trainer.accumulate_grad_batches if module._trainer is not None else 1)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.evaluate("validation_step", self.precision_plugin.val_step_context, args, kwargs, self.stage_index)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.evaluate("test_step", self.precision_plugin.test_step_context, args, kwargs, self.stage_index)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._steps.evaluate("predict_step", self.precision_plugin.predict_step_context, args, kwargs, self.stage_index)
        return self._steps.from_last_stage(output)  # the trainer returns rank 0's predictions

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        step = lambda: super(AutoPipeStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)  # noqa: E731
        return avgpipe.optimizer_step(self, step) if self.config.mode == "avgpipe" else step()

    # ---- checkpoints (checkpoints.py, checkpoint_sharded.py) --------------------------------------
    @property
    def _sharded(self) -> bool:
        return self._active and self.config.checkpoint == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._active:  # after fit: rank 0 holds the full model again (or this is the spawn parent)
            return super().lightning_module_state_dict()
        self.mode.drain()
        with self._showing_reference():  # AvgPipe: the reference model is the model
            return self._kept(self.lightning_module.state_dict() if self._sharded else checkpoints.full_state_dict(self))

    def _showing_reference(self) -> Any:
        return self.mode.showing_reference() if self.config.mode == "avgpipe" else contextlib.nullcontext()

    def _kept(self, state: dict[str, Any]) -> dict[str, Any]:
        """AvgPipe: copies, since the stage's tensors get the pipeline's own weights back after the block."""
        return {k: v.detach().clone() for k, v in state.items()} if self.config.mode == "avgpipe" else state

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._active:
            return super().optimizer_state(optimizer)
        if self._sharded:
            return checkpoints.stage_named_state(self, optimizer)
        return checkpoints.full_optimizer_state(self, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("checkpoint='sharded' writes with torch.distributed.checkpoint, not the CheckpointIO: no storage_options")
        checkpoint_sharded.save(self, checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if checkpoint_sharded.is_sharded(checkpoint_path):  # a directory of checkpoint="sharded" (either setting reads it)
            return checkpoint_sharded.load(self, checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        extras = checkpoints.load_optimizer_states(self, checkpoint)
        if self.config.mode == "2bw":
            two_bw.load_mode_state(self, checkpoint, extras)
        elif self.config.mode == "avgpipe":
            avgpipe.load_mode_state(self, checkpoint)
        rule = getattr(getattr(self.mode, "sync", self.mode), "advance", None)
        saved = next((s.get("autopipe_advance") for s in checkpoint.get("optimizer_states", []) if isinstance(s, dict)), None)
        if rule is not None and saved is not None:
            rule.load_state_dict(saved)
        adaptive = next((s.get("autopipe_adaptive") for s in checkpoint.get("optimizer_states", []) if isinstance(s, dict)), None)
        if self.adaptive is not None and adaptive is not None:
            self.adaptive.load_state_dict(adaptive)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        checkpoints.load_stage_state(self.lightning_module, checkpoint, strict)

    # ---- teardown: hand the trained full model back on rank 0 ------------------------------------
    @override
    def teardown(self) -> None:
        module = self.lightning_module
        finished = module is not None and module._trainer is not None and module.trainer.state.status == TrainerStatus.RUNNING
        if finished and self.cut is not None and _distributed_is_initialized():
            self.mode.drain()
            if self.config.trace:
                self.planner.write_trace(self)  # collective: every rank's last traced step to rank 0
            with self._showing_reference():
                state = self._kept(checkpoints.full_state_dict(self))  # collective: all ranks, only on success
            if self.global_rank == 0 and self.cut.pipeline is not None:
                uncut_module(module, self.cut, state)
                self.cut = None
        if self.mode is not None and hasattr(self.mode, "close"):
            self.mode.close(graceful=finished)  # AvgPipe: the reference processes stop (killed after a failure)
        self._active = False
        self._finished = finished
        super().teardown()
