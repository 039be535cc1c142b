"""AutoPipeStrategy: pipeline parallelism for an unchanged LightningModule.

The only place that knows both Lightning and the runtime, and a thin one: settings are a
`PipelineConfig` (checked there), the model is cut by `cutting`, a step is run by the training
mode (`lightning_pipe.modes`), gradients are handled by `gradients` and the precision plugin
(`precision`), checkpoints by `checkpoints`, and the launch checks live in `launchers`.
"""

from __future__ import annotations

import atexit
from dataclasses import fields
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (_distributed_is_initialized, _get_default_process_group_backend_for_device,
                                                    _init_dist_connection, _sync_ddp_if_available)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from ..config import PipelineConfig
from ..modes import TrainingMode, make_mode
from ..planning.partition import PartitionSpec
from ..runtime.microbatch import batch_size, signature, split_microbatches
from ..runtime.p2p import Transport
from ..schedules import REGISTRY, ScheduleSpec
from ..topology import ProcessGroups, Topology
from . import checkpoints
from .autoplan import AutoPlanner
from .cutting import Cut, cut_module, uncut_module
from .gradients import GradientStash, StageGradients
from .host import LightningHost
from .launchers import CheckedMultiProcessingLauncher, CheckedSubprocessLauncher, close_process_groups
from .logs import LogBroadcaster, replay
from .outputs import merge_outputs
from .precision import pipeline_precision


class AutoPipeStrategy(ParallelStrategy):
    """Pipeline parallelism, planned and run by lightning-pipe: ``Trainer(strategy="autopipe")``.

    Arguments (the pipeline's are `PipelineConfig`'s fields, documented there):
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"wave"`` or ``"auto"``.
        microbatches: micro-batches per optimizer step.
        partition: a partitioner name (``"autopipe"``, ``"dp"``, ``"parameters"``, ``"exhaustive"``,
            ``"uniform"``) or blocks per stage, e.g. ``[4, 6]``.
        width: pipeline replicas (data parallel); stages = devices x nodes / width.
        prefetch: post receives before the compute that needs them.
        chunks: interleaved's model chunks per rank. waves: wave's Hanayo waves.
        slicer: AutoPipe slicer: True, False or a count of warm-up micro-batches to halve.
        memory_limit: schedule="auto": bytes per device (None: a GPU's memory).
        trace: record each action's real times; writes trace.json and a timeline picture.
        profile: a saved profile.json to plan from. bandwidth, latency: the link model for planning.
        start_method: ``"popen"`` (Lightning re-runs the command), ``"spawn"``, ``"fork"``, ``"forkserver"``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout: as for Lightning's DDPStrategy.

    ``AutoPipeStrategy.from_config(config)`` takes a `PipelineConfig` instead of the keywords.
    """

    strategy_name = "autopipe"

    def __init__(
        self,
        schedule: str = "1f1b",
        microbatches: int = 4,
        partition: PartitionSpec = "autopipe",
        width: int = 1,
        prefetch: bool = True,
        chunks: int = 2,
        waves: int = 1,
        slicer: Union[bool, int] = False,
        memory_limit: Optional[float] = None,
        trace: bool = False,
        profile: Optional[str] = None,
        bandwidth: Optional[float] = None,
        latency: Optional[float] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.config = PipelineConfig(schedule=schedule, microbatches=microbatches, partition=partition, width=width,
                                     prefetch=prefetch, chunks=chunks, waves=waves, slicer=slicer, memory_limit=memory_limit,
                                     trace=trace, profile=profile, bandwidth=bandwidth, latency=latency, start_method=start_method)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.planner = AutoPlanner(self.config)
        self.resume_path: Optional[str] = None  # fit's ckpt_path, noted by the launcher
        self.topology: Optional[Topology] = None
        self.process_groups: Optional[ProcessGroups] = None
        self.cut: Optional[Cut] = None
        self.mode: Optional[TrainingMode] = None
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._host: Optional[LightningHost] = None
        self._gradients: Optional[StageGradients] = None
        self._stash = GradientStash()
        self._logs: Optional[LogBroadcaster] = None
        self._active = False  # between setup and teardown: the model is cut and the process groups live

    @classmethod
    def from_config(cls, config: PipelineConfig, **kwargs: Any) -> "AutoPipeStrategy":
        """The strategy for `config`; `kwargs` are the Lightning arguments (accelerator, ...)."""
        settings = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "stages"}
        return cls(**settings, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("autopipe", cls, description="Pipeline parallelism planned and run by lightning-pipe",
                                   override=True)
        for name in [*REGISTRY, "auto"]:
            strategy_registry.register(f"autopipe_{name}", cls, description=f"lightning-pipe with schedule={name!r}",
                                       override=True, schedule=name)

    # ---- what the run is ------------------------------------------------------------------------
    @property
    def spec(self) -> ScheduleSpec:
        """The schedule this run trains with (schedule="auto": the chosen one once the model is cut)."""
        return self.cut.spec if self.cut is not None else self.config.schedule_spec

    @property
    def plan(self) -> Optional[Any]:
        return self.cut.plan if self.cut is not None else None

    @property
    def schedule_choice(self) -> Optional[Any]:
        return self.cut.choice if self.cut is not None else None

    @property
    def depth(self) -> int:
        return (self.num_nodes * self.num_processes) // self.config.width

    @property
    def stage_index(self) -> int:
        return self.global_rank % self.depth

    @property
    def replica_index(self) -> int:
        return self.global_rank // self.depth

    @property
    def memory_limit_bytes(self) -> Optional[float]:
        """schedule="auto"'s limit: as configured, else a GPU's total memory; none on CPU."""
        if self.config.memory_limit is not None:
            return float(self.config.memory_limit)
        if self.root_device.type == "cuda":
            return float(torch.cuda.get_device_properties(self.root_device).total_memory)
        return None

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
        return self.config.width > 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline must see the same batch: shard data by replica, not by rank.
        return {"num_replicas": self.config.width, "rank": self.replica_index}

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

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        atexit.register(close_process_groups)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl" and self.root_device.type == "cuda":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- setup: cut the model into this rank's stage and build the mode --------------------------
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("AutoPipeStrategy needs automatic optimization (automatic_optimization=True): the schedule runs the backward")
        self.topology = topo = Topology(self.world_size, self.config.width)
        if self.process_groups is None:
            self.process_groups = ProcessGroups(topo, self.global_rank)
        self.planner.prepare(self)
        if self.cut is None or module.get_submodule(self.cut.path) is not self.cut.stage:  # not cut by an earlier fit
            self.cut = cut_module(self, module)
            self._gradients = StageGradients(self.cut.stage, self.cut.chunk_blocks, topo, self.process_groups,
                                             self.global_rank, self.cut.tied)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._gradients.sync_replicas()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.precision_plugin.pipeline = self._gradients
        transport = Transport(lambda r: topo.global_rank(self.replica_index, r), self.root_device)
        self.mode = make_mode(self.config.mode, spec=self.cut.spec, stages=topo.depth, microbatches=self.config.microbatches,
                              rank=self.stage_index, transport=transport, prefetch=self.config.prefetch,
                              trace=self.config.trace, sliced=self.cut.sliced)
        last = topo.global_rank(self.replica_index, self.cut.loss_stage)
        group = self.process_groups.pipeline if topo.depth > 1 else None
        self._logs = LogBroadcaster(group, last, self.root_device, self.global_rank == last)
        self._host = LightningHost(module, self.cut.stage, len(self.cut.placement) - 1, self._gradients.reduce_chunk)
        self._active = True

    # ---- steps -------------------------------------------------------------------------------
    def _run(self, kind: str, step: str, context: Callable, args: tuple, kwargs: dict, m: int) -> float:
        module, host = self.lightning_module, self._host
        microbatches, weights = split_microbatches(args[0], m, sliced=self.cut.sliced if kind == "train" else 0)
        keys = [(kind, signature(mb)) for mb in microbatches]  # the slicer's halves are micro-batches of their own
        scaler = getattr(self.precision_plugin, "scaler", None) if kind == "train" else None
        host.begin(step, microbatches, weights, args[1:], kwargs, scaler.scale if scaler is not None else None)
        module.log = host.recorder  # type: ignore[method-assign]
        if self.config.trace and self.topology.depth > 1:
            dist.barrier(group=self.process_groups.pipeline)  # a common start, so the ranks' traces line up
        try:
            with context():
                executor = self.mode.run(kind, host, keys)
        finally:
            del module.log
        if self.config.trace and kind == "train":
            self.planner.keep_trace(executor)
        loss, entries = self._logs.exchange(host.recorder, host.loss if host.loss is not None else 0.0)
        replay(module, entries, self.root_device)
        return loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        params = list(self.lightning_module.parameters())
        run = lambda: self._run("train", "training_step", self.precision_plugin.train_step_context, args, kwargs,  # noqa: E731
                                self.config.microbatches)
        loss = self._stash.around_step(params, run)
        dtype = self._host.loss.dtype if self._host.loss is not None else torch.get_default_dtype()
        return torch.tensor(loss, dtype=dtype, device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran the backward: put its gradients where the optimizer expects them."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._stash.put_back(list(module.parameters()), module.trainer.accumulate_grad_batches if module._trainer is not None else 1)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _eval(self, step: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        self.mode.drain()
        self._run("eval", step, context, args, kwargs, min(self.config.microbatches, batch_size(args[0])))
        return merge_outputs(self._host.outputs) if self.stage_index == self.cut.loss_stage else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._eval("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        if self.topology.depth == 1:
            return output
        box = [output]  # predictions come from the last stage; the trainer returns rank 0's
        last = self.topology.global_rank(self.replica_index, self.cut.loss_stage)
        dist.broadcast_object_list(box, last, group=self.process_groups.pipeline, device=self.root_device)
        return box[0]

    # ---- checkpoints (checkpoints.py) --------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._active:  # after fit: rank 0 holds the full model again (or this is the spawn parent)
            return super().lightning_module_state_dict()
        self.mode.drain()
        return checkpoints.full_state_dict(self)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._active:
            return super().optimizer_state(optimizer)
        return checkpoints.stage_optimizer_state(self, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        checkpoints.load_stage_optimizer_states(self, checkpoint)
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
            state = self.lightning_module_state_dict()  # collective: all ranks, only on success
            if self.global_rank == 0 and self.cut.pipeline is not None:
                uncut_module(module, self.cut, state)
                self.cut = None
        self._active = False
        super().teardown()
