"""The rank grid: `width` pipeline replicas x `depth` stages.

Global rank ``r`` is stage ``r % depth`` of replica ``r // depth``: the stages of one pipeline
are consecutive ranks, so on a multi-GPU node a pipeline's point-to-point traffic stays inside
the node where it can, and the gradient all-reduce of a stage runs across replicas.

AvgPipe's shared devices (`node_stages`, the paper's layout): each node holds `node_stages`
consecutive stages of *every* pipeline, N processes per device. Lightning numbers a node's processes
after the node's (``node * processes + local``), so there the ranks go node by node, pipeline by
pipeline within a node: local rank ``n * node_stages + k`` is stage ``node * node_stages + k`` of
pipeline n, on the node's device k. With one node both orders are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    width: int
    node_stages: int = 0  # stages per node when the pipelines share the nodes' devices; 0: the whole depth

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width={self.width}: the number of pipeline replicas must be >= 1")
        if self.world_size % self.width:
            divisors = [w for w in range(1, self.world_size + 1) if self.world_size % w == 0]
            raise ValueError(
                f"width={self.width} does not divide the world size {self.world_size} (devices x nodes); allowed widths: {divisors}"
            )

        if self.node_stages and self.depth % self.node_stages:
            raise ValueError(f"{self.node_stages} stages per node do not divide the depth {self.depth}")

    @property
    def depth(self) -> int:
        return self.world_size // self.width

    @property
    def _per_node(self) -> int:
        return self.node_stages or self.depth

    def stage_of(self, rank: int) -> int:
        k = self._per_node
        return rank // (self.width * k) * k + rank % k

    def replica_of(self, rank: int) -> int:
        k = self._per_node
        return rank % (self.width * k) // k

    def global_rank(self, replica: int, stage: int) -> int:
        k = self._per_node
        return stage // k * (self.width * k) + replica * k + stage % k

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [self.global_rank(replica, s) for s in range(self.depth)]

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.global_rank(w, stage) for w in range(self.width)]


class ProcessGroups:
    """This rank's groups: its pipeline (stages of one replica) and its stage (across replicas).

    `new_group` is collective over the world, so every rank creates every group in one order.
    """

    def __init__(self, topology: Topology, rank: int, backend: Optional[str] = None, pipeline_backend: Optional[str] = None):
        """`pipeline_backend`: the pipelines' groups' own (NCCL where the world is gloo: pipelines sharing GPUs)."""
        self.topology, self.rank = topology, rank
        self.pipeline: Any = None
        self.stage: Any = None
        self._mesh: Any = None
        if topology.world_size == 1:
            return
        for w in range(topology.width):
            ranks = topology.pipeline_ranks(w)
            group = dist.new_group(ranks, backend=pipeline_backend or backend) if topology.width > 1 else dist.group.WORLD
            if rank in ranks:
                self.pipeline = group
        for s in range(topology.depth):
            ranks = topology.stage_ranks(s)
            group = dist.new_group(ranks, backend=backend) if topology.depth > 1 else dist.group.WORLD
            if rank in ranks:
                self.stage = group

    def mesh(self, device_type: str) -> Optional[Any]:
        """The run's `DeviceMesh` over these groups, dimensions ("pp", "dp"): mesh[s][w] is stage s of replica
        w, so ``mesh["dp"]`` is this rank's stage across the replicas (what FSDP2 shards over) and ``mesh["pp"]``
        its pipeline. Made from the groups that exist (no new ones); None in a one-process run."""
        if self.topology.world_size == 1:
            return None
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            t = self.topology
            ranks = [[t.global_rank(w, s) for w in range(t.width)] for s in range(t.depth)]
            self._mesh = DeviceMesh.from_group([self.pipeline, self.stage], device_type, mesh=ranks, mesh_dim_names=("pp", "dp"))
        return self._mesh

    def own_pipeline_group(self) -> Any:
        """A further group of this rank's pipeline, for traffic that must not meet the schedule's
        messages (a pair's point-to-point messages match in order on one communicator), on the
        pipeline group's backend. Collective: every rank makes every pipeline's, in one order."""
        if self.topology.world_size == 1:
            return None
        backend, mine = dist.get_backend(self.pipeline), None
        for w in range(self.topology.width):
            ranks = self.topology.pipeline_ranks(w)
            group = dist.new_group(ranks, backend=backend)
            if self.rank in ranks:
                mine = group
        return mine
