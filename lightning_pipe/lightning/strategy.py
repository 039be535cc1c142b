"""AutoPipeStrategy: pipeline parallelism for an unchanged LightningModule.

The only place that knows both Lightning and the runtime. Per step it splits the batch into
micro-batches, runs this rank's action list of the schedule through `LightningHost` (which calls
the user's own step methods), and then fits the result into Lightning's automatic optimisation:

- Lightning calls ``optimizer.zero_grad()`` *after* ``training_step``, so the gradients the
  schedule produced are set aside in `training_step` and put back in `backward` (which runs no
  autograd of its own). Leftover gradients from gradient accumulation are kept and added to.
- The loss and everything the last stage logged are broadcast and logged on every rank.
- Gradient clipping by norm uses the global norm over all stages; fp16's inf check is agreed on
  by all ranks so every stage skips the same steps.
- Launch checks and the workers' clean exit live in launchers.py.
- Checkpoints hold the full model in single-process layout (gathered on rank 0); optimizer
  states are kept per stage, so resuming needs the same depth.
"""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _get_default_process_group_backend_for_device, _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout

from ..planning.partition import PartitionSpec, check_partition_spec, partition_blocks
from ..planning.partitioners import PARTITIONERS
from ..runtime.executor import Executor
from ..runtime.microbatch import batch_size, signature, split_microbatches
from ..runtime.p2p import Transport
from ..runtime.reduce import allreduce_mean, clip_grad_norm_global
from ..runtime.tied import TiedParameter, allreduce_tied, find_tied_parameters
from ..schedules import SCHEDULES, build_schedule, forward_only, validate
from ..topology import ProcessGroups, Topology
from .host import LightningHost
from .autoplan import AutoPlanner
from .launchers import CheckedMultiProcessingLauncher, CheckedSubprocessLauncher, close_process_groups
from .logs import LogBroadcaster, replay
from .outputs import merge_outputs
from .stage import PipelineStage, check_no_outside_parameters, find_pipeline, set_submodule

log = logging.getLogger(__name__)
START_METHODS = ("popen", "spawn", "fork", "forkserver")


class AutoPipeStrategy(ParallelStrategy):
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
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if not isinstance(schedule, str) or (schedule.lower() not in SCHEDULES and schedule.lower() != "auto"):
            raise ValueError(f"schedule={schedule!r} is not a known schedule; allowed values: {sorted(SCHEDULES) + ['auto']}")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"microbatches={microbatches!r}: the number of micro-batches must be an integer >= 1")
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"width={width!r}: the number of pipeline replicas must be an integer >= 1")
        if not isinstance(slicer, (bool, int)) or (not isinstance(slicer, bool) and not 0 <= slicer <= microbatches):
            raise ValueError(f"slicer={slicer!r}: True (the simulator chooses), False, or a count 0..microbatches={microbatches}")
        for name, value in (("chunks", chunks), ("waves", waves)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if slicer and schedule.lower() in ("interleaved", "wave"):
            raise ValueError(f"slicer={slicer!r} works with schedule='gpipe' or '1f1b', not {schedule!r}")
        if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) or memory_limit <= 0):
            raise ValueError(f"memory_limit={memory_limit!r}: bytes per device (> 0) for schedule='auto', or None (the device's memory)")
        if schedule.lower() == "auto" and not isinstance(partition, str):
            raise ValueError(f"schedule='auto' plans its own partition for each candidate schedule: partition={partition!r} must be "
                             f"a method name, one of {sorted(PARTITIONERS)}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r}; allowed values: {list(START_METHODS)}")
        if isinstance(partition, str):
            if partition not in PARTITIONERS:
                raise ValueError(
                    f"partition={partition!r} is not a known method; allowed: {sorted(PARTITIONERS)} or a list of blocks per stage"
                )
        else:
            partition = [int(n) if isinstance(n, int) and not isinstance(n, bool) else n for n in partition]
            check_partition_spec(partition)
        # schedule="auto" runs 1F1B until the planner has chosen (in setup, from the profile)
        self.auto = schedule.lower() == "auto"
        self.schedule_name = "1f1b" if self.auto else schedule.lower()
        self.microbatches, self.partition, self.width = microbatches, partition, width
        self.memory_limit = memory_limit
        self.prefetch, self.trace = prefetch, trace
        self.chunks, self.waves = chunks, waves
        self._planner = AutoPlanner(partition if isinstance(partition, str) else None, slicer, profile, bandwidth, latency)
        self.plan: Optional[Any] = None  # the Plan this run trains with (planner partitions)
        self.schedule_choice: Optional[Any] = None  # schedule="auto": every candidate and the chosen one
        self.sliced = 0  # warm-up micro-batches the slicer cuts in halves
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.topology: Optional[Topology] = None
        self._groups: Optional[ProcessGroups] = None
        self._stage: Optional[PipelineStage] = None
        self._pipeline_path: Optional[str] = None
        self._full_pipeline: Optional[nn.Sequential] = None  # kept on global rank 0 to hand the trained model back
        self._host: Optional[LightningHost] = None
        self._transport: Optional[Transport] = None
        self._executors: dict[tuple[str, int], Executor] = {}
        self._logs: Optional[LogBroadcaster] = None
        self._new_grads: list[Optional[Tensor]] = []
        self._active = False  # between setup and teardown: the model is cut and the process groups live
        self._tied: list[TiedParameter] = []
        self._chunk_blocks: dict[int, list[int]] = {}  # this rank's chunks -> their block indices
        self._num_chunks = 0
        self._bounds: tuple = ()
        self._loss_stage = 0
        self._resume_path: Optional[str] = None
        self._reduced: set[int] = set()
        self._tied_groups: dict[int, Any] = {}

    # ---- Lightning plumbing (as DDP does it) ---------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        # Lightning reads this (not the class) to turn on ``sync_dist`` and its distributed sampler.
        # One pipeline (width 1): every rank reads the user's own DataLoader in its own order, as one
        # process would, and logged values are already equal on all ranks. Several replicas: shard
        # the data by replica (see distributed_sampler_kwargs) and reduce metrics across them.
        return self.width > 1

    @property
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
    def depth(self) -> int:
        return (self.num_nodes * self.num_processes) // self.width

    @property
    def stage_index(self) -> int:
        return self.global_rank % self.depth

    @property
    def replica_index(self) -> int:
        return self.global_rank // self.depth

    @property
    def schedule_options(self) -> dict[str, int]:
        return {"interleaved": {"chunks": self.chunks}, "wave": {"waves": self.waves}}.get(self.schedule_name, {})

    @property
    def memory_limit_bytes(self) -> Optional[float]:
        """schedule="auto"'s limit: as configured, else a GPU's total memory; none on CPU."""
        if self.memory_limit is not None:
            return float(self.memory_limit)
        if self.root_device.type == "cuda":
            return float(torch.cuda.get_device_properties(self.root_device).total_memory)
        return None

    def use_schedule(self, name: str, options: dict[str, int]) -> None:
        """Run `name` with `options` (chunks= / waves=): the choice of schedule="auto"."""
        self.schedule_name = name
        self.chunks = options.get("chunks", self.chunks)
        self.waves = options.get("waves", self.waves)

    def placement(self, microbatches: Optional[int] = None) -> tuple[int, ...]:
        """Which pipeline rank holds each model chunk (one chunk per rank for GPipe / 1F1B)."""
        m = microbatches or self.microbatches
        return build_schedule(self.schedule_name, self.depth, m, **self.schedule_options).chunk_rank

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline must see the same batch: shard data by replica, not by rank.
        return {"num_replicas": self.width, "rank": self.replica_index}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is cut into stages in setup; load the stage's part afterwards

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        Topology(self.num_nodes * self.num_processes, self.width)  # fail before spawning anything
        self.placement()  # e.g. interleaved needs micro-batches in multiples of the stages
        if self._start_method == "popen":
            self._launcher = CheckedSubprocessLauncher(self, self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = CheckedMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        atexit.register(close_process_groups)

    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl" and self.root_device.type == "cuda":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- setup: cut the model into this rank's stage --------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("AutoPipeStrategy needs automatic optimization (automatic_optimization=True): the schedule runs the backward")
        self.topology = Topology(self.world_size, self.width)
        if self._groups is None:
            self._groups = ProcessGroups(self.topology, self.global_rank)
        self._planner.prepare(self)
        self._cut(module)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_replicas()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._install_precision_hooks()
        topo = self.topology
        self._transport = Transport(lambda r: topo.global_rank(self.replica_index, r), self.root_device)
        self._executors = {}
        # the rank holding the last chunk computes the loss (the last stage, or rank 0 in a wave)
        self._loss_stage = self.placement()[-1]
        last = topo.global_rank(self.replica_index, self._loss_stage)
        self._logs = LogBroadcaster(
            self._groups.pipeline if topo.depth > 1 else None, last, self.root_device, self.global_rank == last
        )
        self._host = LightningHost(module, self._stage, self._num_chunks - 1, self._reduce_chunk)
        self._active = True

    def _cut(self, module: nn.Module) -> None:
        if self._stage is not None and self._pipeline_path is not None:
            current = module.get_submodule(self._pipeline_path)
            if current is self._stage:
                return  # already cut by an earlier fit / validate on this trainer
        path, pipeline = find_pipeline(module)
        check_no_outside_parameters(module, path)
        depth = self.topology.depth
        resumed = self._resumed_partition(module.trainer)
        if resumed is not None:  # resuming: the checkpoint's schedule and partition, not a new (noisy) plan
            bounds, self.sliced = resumed
        elif self.auto or self._planner.needs_profile:  # choose a schedule, plan or slice: profile first
            result = self._planner.run(self, module, pipeline)
            self.use_schedule(result.schedule, result.options)
            bounds, self.plan, self.sliced, self.schedule_choice = result.bounds, result.plan, result.sliced, result.choice
        else:
            spec = self.partition if not isinstance(self.partition, str) else "uniform"
            bounds = partition_blocks(spec, len(pipeline), len(self.placement())).bounds
        placement = self.placement()
        self._bounds = tuple(tuple(b) for b in bounds)
        mine = {c: bounds[c] for c in range(len(placement)) if placement[c] == self.stage_index}
        self._chunk_blocks = {c: list(range(*b)) for c, b in mine.items()}
        self._setup_tied(find_tied_parameters(pipeline, bounds, placement))
        blocks = {i: pipeline[i] for ids in self._chunk_blocks.values() for i in ids}
        self._stage = PipelineStage(blocks, mine)
        self._num_chunks = len(placement)
        self._pipeline_path = path
        self._full_pipeline = pipeline if self.global_rank == 0 else None
        set_submodule(module, path, self._stage)
        log.info(f"rank {self.global_rank}: stage {self.stage_index}/{depth} holds chunks {mine} (blocks [start, stop))")

    def _resumed_partition(self, trainer: Any) -> Optional[tuple]:
        """(bounds, sliced) stored in the checkpoint `fit(ckpt_path=...)` resumes from, if any; with
        schedule="auto" also the schedule the run chose, which is put back in use."""
        # Lightning loads the checkpoint only after setup; the launcher noted fit's ckpt_path for us
        path = self._resume_path
        if path is None or trainer.state.fn != TrainerFn.FITTING or not os.path.isfile(path):
            return None
        states = self.checkpoint_io.load_checkpoint(path).get("optimizer_states") or [{}]
        bounds, chosen = states[0].get("autopipe_bounds"), states[0].get("autopipe_schedule")
        if self.auto and chosen is not None:
            self.use_schedule(chosen[0], dict(chosen[1]))
        if bounds is None or len(bounds) != len(self.placement()):
            return None  # load_optimizer_state_dict explains a mismatch of depth
        return tuple(tuple(b) for b in bounds), int(states[0].get("autopipe_sliced", 0))

    def _setup_tied(self, tied: list[TiedParameter]) -> None:
        """One group per tied parameter and replica (new_group is collective: every rank, same order);
        the copies start from the first holding stage's values."""
        self._tied, self._tied_groups = tied, {}
        topo = self.topology
        for t in tied:
            for w in range(topo.width):
                ranks = [topo.global_rank(w, s) for s in t.stages]
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    self._tied_groups[t.index] = group
            if self.stage_index in t.stages:
                src = topo.global_rank(self.replica_index, t.stages[0])
                dist.broadcast(t.parameter.data, src, group=self._tied_groups[t.index])
        if tied:
            log.info(f"tied parameters across stages: {[t.stages for t in tied]}")

    def _sync_replicas(self) -> None:
        """Replicas of a stage start from replica 0's weights (as DDP syncs from rank 0)."""
        if self.width == 1:
            return
        src = self.topology.global_rank(0, self.stage_index)
        for tensor in list(self._stage.parameters()) + list(self._stage.buffers()):
            dist.broadcast(tensor.data, src, group=self._groups.stage)

    def _install_precision_hooks(self) -> None:
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not getattr(scaler, "_autopipe_synced", False):
            _agree_on_inf(scaler)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        group = self._groups.pipeline if self.topology.depth > 1 else None
        # a tied parameter's (equal) gradient counts once in the norm: on the first stage holding it
        copies = {id(t.parameter) for t in self._tied if t.stages[0] != self.stage_index}
        clip_grad_norm_global(self.precision_plugin.main_params(optimizer), float(clip_val), group, skip_in_norm=copies)

    def _reduce_chunk(self, chunk: int) -> None:
        """REDUCE(chunk): average the chunk's gradients over the replicas; after this rank's last
        chunk also sum the tied weights over the stages holding them (both are linear: any order)."""
        params = {id(p): p for i in self._chunk_blocks[chunk] for p in self._stage._modules[str(i)].parameters()}
        allreduce_mean(params.values(), self._groups.stage, self.width)
        self._reduced.add(chunk)
        if self._reduced >= set(self._chunk_blocks):
            allreduce_tied(self._tied, self._tied_groups, self.stage_index)
            self._reduced = set()

    def _executor(self, kind: str, m: int) -> Executor:
        key = (kind, m)
        if key not in self._executors:
            if kind == "train":
                schedule = build_schedule(self.schedule_name, self.topology.depth, m, **self.schedule_options)
            else:
                schedule = forward_only(self.topology.depth, m, self.placement())
                validate(schedule)
            self._executors[key] = Executor(schedule, self.stage_index, self._transport, self.prefetch, trace=self.trace)
        return self._executors[key]

    # ---- steps -------------------------------------------------------------------------------
    def _run(self, kind: str, step: str, context: Callable, args: tuple, kwargs: dict, m: int) -> tuple[float, list]:
        module, host = self.lightning_module, self._host
        batch = args[0]
        microbatches, weights = split_microbatches(batch, m, sliced=self.sliced if kind == "train" else 0)
        m = len(microbatches)  # halves from the slicer are micro-batches of their own
        keys = [(kind, signature(mb)) for mb in microbatches]
        scaler = getattr(self.precision_plugin, "scaler", None) if kind == "train" else None
        host.begin(step, microbatches, weights, args[1:], kwargs, scaler.scale if scaler is not None else None)
        module.log = host.recorder  # type: ignore[method-assign]
        executor = self._executor(kind, m)
        if self.trace and self.topology.depth > 1:
            dist.barrier(group=self._groups.pipeline)  # a common start, so the ranks' traces line up
        try:
            with context():
                executor.run(host, keys)
        finally:
            del module.log
        if self.trace and kind == "train":
            self._planner.keep_trace(executor)
        loss, entries = self._logs.exchange(host.recorder, host.loss if host.loss is not None else 0.0)
        replay(module, entries, self.root_device)
        return loss, entries

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        params = list(self.lightning_module.parameters())
        saved = [p.grad for p in params]  # Lightning zeroes (or accumulates into) these after this step
        for p in params:
            p.grad = None
        try:
            loss, _ = self._run("train", "training_step", self.precision_plugin.train_step_context, args, kwargs, self.microbatches)
        finally:
            self._new_grads = [p.grad for p in params]
            for p, g in zip(params, saved):
                p.grad = g
        dtype = self._host.loss.dtype if self._host.loss is not None else torch.get_default_dtype()
        return torch.tensor(loss, dtype=dtype, device=self.root_device)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran the backward: put its gradients where the optimizer expects them."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        accumulate = module.trainer.accumulate_grad_batches if module._trainer is not None else 1
        for p, g in zip(module.parameters(), self._new_grads):
            if g is None:
                continue
            if accumulate > 1:
                g = g / accumulate  # as Lightning divides the closure loss
            p.grad = g if p.grad is None else p.grad + g
        self._new_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _eval(self, step: str, context: Callable, args: tuple, kwargs: dict) -> Any:
        m = min(self.microbatches, batch_size(args[0]))
        self._run("eval", step, context, args, kwargs, m)
        return merge_outputs(self._host.outputs) if self.stage_index == self._loss_stage else None

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._eval("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        if self.topology.depth == 1:
            return output
        box = [output]  # predictions come from the last stage; the trainer returns rank 0's
        last = self.topology.global_rank(self.replica_index, self._loss_stage)
        dist.broadcast_object_list(box, last, group=self._groups.pipeline, device=self.root_device)
        return box[0]

    # ---- checkpoints -------------------------------------------------------------------------
    def _gather_to_zero(self, obj: Any) -> Optional[list[Any]]:
        """Gather `obj` from the stages of replica 0 onto global rank 0 (others: None)."""
        if self.topology.depth == 1:
            return [obj] if self.global_rank == 0 else None
        if self.replica_index != 0:
            return None
        parts = [None] * self.topology.depth if self.global_rank == 0 else None
        dist.gather_object(obj, parts, dst=0, group=self._groups.pipeline)
        return parts

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._active:  # after fit: rank 0 holds the full model again (or this is the spawn parent)
            return super().lightning_module_state_dict()
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        parts = self._gather_to_zero(local)
        if parts is None:
            return {}
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return merged

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self._active:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        state = _to_cpu(optimizer.state_dict())
        parts = self._gather_to_zero(state)
        if parts is None:
            return {}
        # the partition travels with the states: a resumed run must cut the model the same way
        return {"autopipe_stage_states": parts, "autopipe_depth": self.topology.depth,
                "autopipe_bounds": [list(b) for b in self._bounds], "autopipe_sliced": self.sliced,
                "autopipe_schedule": [self.schedule_name, dict(self.schedule_options)]}

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if "autopipe_stage_states" not in state:
                raise ValueError("this checkpoint's optimizer state was not written by AutoPipeStrategy; resume it with the strategy that wrote it")
            if state["autopipe_depth"] != self.topology.depth:
                raise ValueError(
                    f"the checkpoint was written by a {state['autopipe_depth']}-stage pipeline and this one has "
                    f"{self.topology.depth} stages: resume with the same devices x nodes / width"
                )
            optimizer.load_state_dict(state["autopipe_stage_states"][self.stage_index])
        _optimizers_to_device(self.optimizers, self.root_device)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        module = self.lightning_module
        local_keys = module.state_dict().keys()
        state = {k: v for k, v in checkpoint["state_dict"].items() if k in local_keys}
        if strict:
            missing = [k for k in local_keys if k not in state]
            if missing:
                raise KeyError(f"the checkpoint lacks this stage's keys: {missing[:5]}")
        module.load_state_dict(state, strict=strict)

    # ---- teardown: hand the trained full model back on rank 0 ------------------------------------
    def teardown(self) -> None:
        module = self.lightning_module
        finished = module is not None and module._trainer is not None and module.trainer.state.status == TrainerStatus.RUNNING
        if finished and self.trace and self._stage is not None and _distributed_is_initialized():
            self._planner.write_trace(self)  # collective: every rank's last traced step to rank 0
        if finished and self._stage is not None and _distributed_is_initialized():
            state = self.lightning_module_state_dict()  # collective: all ranks, only on success
            if self.global_rank == 0 and self._full_pipeline is not None:
                prefix = self._pipeline_path + "."
                self._full_pipeline.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
                set_submodule(module, self._pipeline_path, self._full_pipeline)
                self._stage = None
        self._active = False
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # registered by lightning_pipe/__init__.py


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _agree_on_inf(scaler: Any) -> None:
    """fp16: every stage must skip the same steps, so the inf check is reduced over all ranks."""
    unscale = scaler.unscale_

    def unscale_(optimizer: Any) -> None:
        unscale(optimizer)
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:
            return
        values = list(found.values())
        total = torch.stack([v.float() for v in values]).sum().reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        for v in values:
            v.fill_(float(total.item() > 0))

    scaler.unscale_ = unscale_
    scaler._autopipe_synced = True
