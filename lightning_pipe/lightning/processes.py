"""The process side of the strategy, as Lightning's DDPStrategy does it: one process per device,
a torch.distributed process group over all of them, collectives for Lightning's own use.
Nothing pipeline-specific lives here (strategy.py adds that).

`processes_per_device` > 1 (AvgPipe's shared devices): local rank ``l`` runs on device
``l % devices``, so consecutive local ranks fill every device once before any doubles up. NCCL
refuses two ranks of one communicator on one GPU, so the world group is then gloo (on the host, as
the paper's reference exchange) and `group_backend` names the device's backend for the groups whose
ranks are on distinct devices (the pipelines)."""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from .heartbeat import Heartbeat, start_heartbeat
from .launchers import close_process_groups


class ProcessGroupStrategy(ParallelStrategy):
    def __init__(
        self,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        heartbeat_timeout: Optional[float] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._heartbeat_timeout = heartbeat_timeout  # seconds of silence before a peer counts as lost (None: no heartbeat)
        self._heartbeat: Optional[Heartbeat] = None
        self._finished = False  # set by the subclass before teardown: the run ended without an error
        self.processes_per_device = 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) * self.processes_per_device if self.parallel_devices is not None else 0

    @property
    def group_backend(self) -> Optional[str]:
        """The backend of groups over distinct devices when the world group cannot be the device's (None: the world's)."""
        return _get_default_process_group_backend_for_device(self.root_device) if self.processes_per_device > 1 else None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        shared = self.processes_per_device > 1
        backend = self._process_group_backend or ("gloo" if shared else _get_default_process_group_backend_for_device(self.root_device))
        self._process_group_backend = backend
        device_id = self.root_device if self.root_device.type != "cpu" and backend != "gloo" else None
        self._owns_group = not _distributed_is_initialized()  # a group this process had before is the user's
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        atexit.register(close_process_groups)
        if self._heartbeat_timeout is not None:
            env = self.cluster_environment
            self._heartbeat = start_heartbeat(env.main_address, env.main_port, self.global_rank, self.world_size, self._heartbeat_timeout)

    @override
    def teardown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.leave(wait=self._finished)
            self._heartbeat = None
        super().teardown()
        if getattr(self, "_owns_group", False) and self.world_size == 1 and _distributed_is_initialized():
            # one process, in the user's own (no launcher): close the group now, not at exit, so the
            # process can fit again or fork workers that would otherwise inherit a live group
            dist.destroy_process_group()
            self._owns_group = False

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
