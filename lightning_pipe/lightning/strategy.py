"""AutoPipeStrategy: pipeline parallelism for an unchanged LightningModule.

Lightning's hooks only. Settings are a `PipelineConfig` (checked there); the model is cut by `cutting`;
a step is the composition of the training layers (`compose.Training`, from `compose.choose_layers`),
which this module calls and never names; checkpoints are `checkpoint`'s, precision `precision`'s.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from typing_extensions import override

from ..config import PipelineConfig
from ..schedules import REGISTRY
from ..topology import ProcessGroups, Topology
from .autoplan import AutoPlanner
from .checkpoint import full_state_dict, load_stage_state, resumed_state, sharded
from .checkpoint.io import StreamedCheckpointIO
from .compose import Training
from .context import RankContext
from .cut import Cut
from .cutting import cut_module, uncut_module
from .empty_init import EmptyInitMixin
from .front import ensure_traced
from .launchers import make_launcher
from .precision import pipeline_precision
from .preflight import STRATEGY_SETTINGS, strategy_config
from .processes import ProcessGroupStrategy
from .shape import Where, choose_shape, rebatched


class AutoPipeStrategy(EmptyInitMixin, ProcessGroupStrategy):
    """Pipeline parallelism, planned and run by lightning-pipe: ``Trainer(strategy="autopipe")``.

    Keywords: every `PipelineConfig` field (documented there), and Lightning's accelerator, parallel_devices,
    cluster_environment, checkpoint_io, precision_plugin, process_group_backend; or `from_config(config)`.
    """

    strategy_name = "autopipe"

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        **settings: Any,
    ) -> None:
        self.config = strategy_config(settings)
        # Collectives wait twice the heartbeat's limit: a silent peer is named by the heartbeat first.
        super().__init__(
            process_group_backend=process_group_backend, timeout=timedelta(seconds=2 * self.config.timeout),
            heartbeat_timeout=self.config.timeout, accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io or StreamedCheckpointIO(), precision_plugin=precision_plugin,
        )  # fmt: skip
        self.planner, self.processes_per_device = AutoPlanner(self.config), self.config.processes_per_device
        self.resume_path: Optional[str] = None  # fit's ckpt_path, noted by the launcher
        self.topology: Optional[Topology] = None
        self.process_groups: Optional[ProcessGroups] = None
        self.ctx: Optional[RankContext] = None
        self.layers: Optional[Training] = None  # the composed training layers of this rank
        self.shape: Optional[Any] = None  # planner=...: the run's shape chosen at setup
        self.shape_plan: Optional[Any] = None  # ... and on global rank 0 the plan with every candidate
        self._active = False  # between setup and teardown: the model is cut and the process groups live

    @classmethod
    def from_config(cls, config: PipelineConfig, **kwargs: Any) -> "AutoPipeStrategy":
        """The strategy for `config`; `kwargs` are the Lightning arguments (accelerator, ...)."""
        return cls(**{name: getattr(config, name) for name in STRATEGY_SETTINGS}, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("autopipe", cls, description="Pipeline parallelism planned and run by lightning-pipe", override=True)
        for name in [*REGISTRY, "auto"]:  # autopipe_<schedule>
            strategy_registry.register(f"autopipe_{name}", cls, description=f"lightning-pipe, {name}", override=True, schedule=name)

    # ---- what the run is ------------------------------------------------------------------------
    @property
    def cut(self) -> Optional[Cut]:
        return self.ctx.cut if self.ctx is not None else None

    @property
    def device_mesh(self) -> Optional[Any]:
        """The run's DeviceMesh, "pp" stages x "dp" replicas, made on first use (from setup on; None on one process)."""
        return self.process_groups.mesh(self.root_device.type) if self.process_groups is not None else None

    @property
    def adaptive(self) -> Optional[Any]:
        """The monitor and live switches (AutoPipe-RL) while fitting; callbacks read `.monitor.latest`."""
        return self.layers.partition.adaptive if self.layers is not None else None

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
        # width 1: every rank reads the DataLoader as one process would, logs equal; replicas: shard, reduce
        return self.config.replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline must see the same batch: shard data by replica, not by rank.
        topology = self.config.topology(self.num_nodes * self.num_processes, len(self.parallel_devices or ()))
        return {"num_replicas": self.config.replicas, "rank": topology.replica_of(self.global_rank)}

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # a planned shape: every replica's batch is global_batch / width rows, whatever the loader said
        return rebatched(dataloader, self.shape.replica_batch) if self.shape is not None else dataloader

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is cut into stages in setup; load the stage's part afterwards

    @override
    def _configure_launcher(self) -> None:
        self._launcher = make_launcher(self)

    # ---- setup: cut the model into this rank's stage and compose the layers ----------------------
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("AutoPipeStrategy needs automatic optimization (automatic_optimization=True): the schedule runs the backward")
        out_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: a broadcast from rank 0
        fitting = trainer.state.fn == TrainerFn.FITTING
        ensure_traced(
            module, trainer, self.config.microbatches, self.config.blocks, self.config.sublayers
        )  # a model looping over its blocks
        if self.config.planner is not None and self.shape is None:  # the run's shape is the planner's answer
            where = Where(self.world_size, self.num_processes, self.global_rank, self.root_device, out_dir)
            resumed = resumed_state(self.checkpoint_io, self.resume_path)
            self.config, self.shape, self.shape_plan = choose_shape(self.config, module, where, resumed)
            self.planner = AutoPlanner(self.config)
        self.topology = self.config.topology(self.world_size, len(self.parallel_devices or ()))
        if self.process_groups is None:
            self.process_groups = ProcessGroups(self.topology, self.global_rank, pipeline_backend=self.group_backend)
        env = self.cluster_environment
        cut = self.cut if self.cut is not None and module.get_submodule(self.cut.path) is self.cut.stage else None  # an earlier fit's
        self.ctx = ctx = RankContext(
            self.config, self.topology, self.process_groups, self.global_rank, self.root_device, module, out_dir,
            env.main_address, env.main_port, self.resume_path, self.checkpoint_io, self.shape, cut,
        )  # fmt: skip
        self.layers = Training(ctx, self.planner, self.precision_plugin)
        if ctx.cut is None:
            ctx.cut = cut_module(ctx, self.planner, module)
        self.layers.build_gradients()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.layers.prepare_stage()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        ctx.optimizers, ctx.lr_scheduler_configs = self.optimizers, self.lr_scheduler_configs
        self.layers.start(fitting)
        self._active = True

    # ---- partition control -----------------------------------------------------------------------
    def repartition(self, bounds: Any, early: Optional[int] = None) -> Any:
        """Move to partition `bounds` (a [start, stop) block range per model chunk) from the next batch,
        without restarting: call it on every rank (e.g. from a callback); checked now. `early`: the
        micro-batches a fine-grained switch leaves on the old worker (None: from the measurements)."""
        if self.layers is None:
            raise RuntimeError("repartition() works while fitting, after setup")
        return self.layers.partition.request(bounds, early)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.layers.partition.before_batch()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.layers.finish()

    # ---- steps (steps.py) ------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        scaler = getattr(self.precision_plugin, "scaler", None)  # Lightning's plugins have it or not
        return self.layers.steps.train(self.precision_plugin.train_step_context, args, kwargs, scaler)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """No autograd here: the schedule ran the backward; its gradients go back between the precision hooks."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.layers.steps.backward(module.trainer.accumulate_grad_batches if module._trainer is not None else 1)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.layers.steps.evaluate("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.layers.steps.evaluate("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self.layers.steps.evaluate("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        return self.layers.steps.from_last_stage(output)  # the trainer returns rank 0's predictions

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return self.layers.optimizer_step(lambda: super(AutoPipeStrategy, self).optimizer_step(optimizer, closure, model, **kwargs))

    # ---- checkpoints (checkpoint/) ---------------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self._active and self.config.checkpoint == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._active:  # after fit: rank 0 holds the full model again (or this is the spawn parent)
            return super().lightning_module_state_dict()
        read = self.lightning_module.state_dict if self._sharded else lambda: full_state_dict(self.ctx)
        return self.layers.model_state(read)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._active:
            return super().optimizer_state(optimizer)
        return self.layers.optimizer_state(optimizer, self._sharded)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("checkpoint='sharded' writes with torch.distributed.checkpoint, not the CheckpointIO: no storage_options")
        sharded.save(self.ctx, checkpoint, filepath, self.layers.run_state())

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if sharded.is_sharded(checkpoint_path):  # a directory of checkpoint="sharded" (either setting reads it)
            return sharded.load(self.lightning_module, self.optimizers, checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.layers.load(checkpoint)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        load_stage_state(self.lightning_module, checkpoint, strict)

    # ---- teardown: hand the trained full model back on rank 0 ------------------------------------
    @override
    def teardown(self) -> None:
        module = self.lightning_module
        finished = module is not None and module._trainer is not None and module.trainer.state.status == TrainerStatus.RUNNING
        if finished and self.cut is not None and _distributed_is_initialized():
            self.layers.drain()
            if self.config.trace:
                self.planner.write_trace(self.ctx)  # collective: every rank's last traced step to rank 0
            if not self.cut.built_empty:  # a model created empty (meta) stays cut: its checkpoint has the weights
                state = self.layers.model_state(lambda: full_state_dict(self.ctx))  # collective, only on success
                if self.global_rank == 0:
                    uncut_module(module, self.cut, state)
                    self.ctx.cut = None
        if self.layers is not None:
            self.layers.close(graceful=finished)  # e.g. reference processes stop (killed after a failure)
        self._active = False
        self._finished = finished
        super().teardown()
