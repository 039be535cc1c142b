"""The rank grid: `width` pipeline replicas x `depth` stages x `tensor` ranks, pipeline outermost.

Global rank ``r`` is stage ``r // (width * tensor)``, replica ``r // tensor % width``, tensor rank
``r % tensor``: the mesh ("pp", "dp", "tp") laid out in row-major order, as torchtitan and Megatron-LM
place it. Tensor parallelism's T ranks are consecutive (one node, the fastest links: two all-reduces a
block), then a stage's replicas (the data-parallel group: FSDP2's gathers every block, or the gradient
all-reduce, stay inside a node while width x tensor fits one, as PipeDream-2BW's planner assumes), and
the pipeline's hops, one activation per micro-batch, are what crosses nodes.

AvgPipe's shared devices (`node_stages`, the paper's layout): each node holds `node_stages`
consecutive stages of *every* pipeline, N processes per device. Lightning numbers a node's processes
after the node's (``node * processes + local``), so there the ranks go node by node, pipeline by
pipeline within a node: local rank ``n * node_stages + k`` is stage ``node * node_stages + k`` of
pipeline n, on the node's device k. The pipeline-outermost grid is the same rule with one stage per
block (``node_stages`` 0 means 1).

Each tensor rank runs its own copy of the pipeline's messages and its own data-parallel group (the ranks
with its stage and its tensor rank), so the stages' runtime and the replicas' reductions are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    width: int
    node_stages: int = 0  # stages per node when the pipelines share the nodes' devices; 0: pipeline outermost
    tensor: int = 1  # tensor-parallel ranks per stage (innermost)

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.world_size % self.tensor:
            divisors = [t for t in range(1, self.world_size + 1) if self.world_size % t == 0]
            raise ValueError(
                f"tensor={self.tensor} does not divide the world size {self.world_size} (devices x nodes); allowed values: {divisors}"
            )
        if self.width < 1:
            raise ValueError(f"width={self.width}: the number of pipeline replicas must be >= 1")
        groups = self.world_size // self.tensor
        if groups % self.width:
            divisors = [w for w in range(1, groups + 1) if groups % w == 0]
            per = f" / tensor={self.tensor}" if self.tensor > 1 else ""
            raise ValueError(
                f"width={self.width} does not divide the world size {self.world_size}{per} (devices x nodes); allowed widths: {divisors}"
            )

        if self.node_stages and self.depth % self.node_stages:
            raise ValueError(f"{self.node_stages} stages per node do not divide the depth {self.depth}")

    @property
    def depth(self) -> int:
        return self.world_size // (self.width * self.tensor)

    @property
    def _per_node(self) -> int:
        return self.node_stages or 1

    def stage_of(self, rank: int) -> int:
        k, q = self._per_node, rank // self.tensor
        return q // (self.width * k) * k + q % k

    def replica_of(self, rank: int) -> int:
        k, q = self._per_node, rank // self.tensor
        return q % (self.width * k) // k

    def tensor_of(self, rank: int) -> int:
        return rank % self.tensor

    def global_rank(self, replica: int, stage: int, tensor: int = 0) -> int:
        k = self._per_node
        return (stage // k * (self.width * k) + replica * k + stage % k) * self.tensor + tensor

    def pipeline_ranks(self, replica: int, tensor: int = 0) -> list[int]:
        return [self.global_rank(replica, s, tensor) for s in range(self.depth)]

    def stage_ranks(self, stage: int, tensor: int = 0) -> list[int]:
        """The data-parallel group: `stage` of every replica, at one tensor rank."""
        return [self.global_rank(w, stage, tensor) for w in range(self.width)]

    def tensor_ranks(self, replica: int, stage: int) -> list[int]:
        return [self.global_rank(replica, stage, t) for t in range(self.tensor)]


class ProcessGroups:
    """This rank's groups: its pipeline (stages of one replica, at its tensor rank), its stage (across replicas,
    at its tensor rank: the data-parallel group) and, with tensor parallelism, its tensor group (one stage of
    one replica).

    `new_group` is collective over the world, so every rank creates every group in one order.
    """

    def __init__(self, topology: Topology, rank: int, backend: Optional[str] = None, pipeline_backend: Optional[str] = None):
        """`pipeline_backend`: the pipelines' groups' own (NCCL where the world is gloo: pipelines sharing GPUs)."""
        self.topology, self.rank = topology, rank
        self.pipeline: Any = None
        self.stage: Any = None
        self.tensor: Any = None
        self._mesh: Any = None
        if topology.world_size == 1:
            return
        t = topology
        for ranks in _lanes(t):
            group = dist.new_group(ranks, backend=pipeline_backend or backend) if t.width * t.tensor > 1 else dist.group.WORLD
            if rank in ranks:
                self.pipeline = group
        for s in range(t.depth):
            for k in range(t.tensor):
                ranks = t.stage_ranks(s, k)
                group = dist.new_group(ranks, backend=backend) if t.depth * t.tensor > 1 else dist.group.WORLD
                if rank in ranks:
                    self.stage = group
        if t.tensor > 1:
            for w in range(t.width):
                for s in range(t.depth):
                    ranks = t.tensor_ranks(w, s)
                    group = dist.new_group(ranks, backend=backend) if len(ranks) < t.world_size else dist.group.WORLD
                    if rank in ranks:
                        self.tensor = group

    def mesh(self, device_type: str) -> Optional[Any]:
        """The run's `DeviceMesh` over these groups, dimensions ("pp", "dp"), and "tp" innermost with tensor
        parallelism: mesh[s][w][t] is tensor rank t of stage s of replica w, so ``mesh["dp"]`` is this rank's
        stage across the replicas (what FSDP2 shards over), ``mesh["tp"]`` what a block's weights are split
        over and ``mesh["pp"]`` its pipeline. Made from the groups that exist (no new ones); None in a
        one-process run."""
        if self.topology.world_size == 1:
            return None
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            t = self.topology
            if t.tensor == 1:
                ranks: Any = [[t.global_rank(w, s) for w in range(t.width)] for s in range(t.depth)]
                groups, names = [self.pipeline, self.stage], ("pp", "dp")
            else:
                ranks = [[t.tensor_ranks(w, s) for w in range(t.width)] for s in range(t.depth)]
                groups, names = [self.pipeline, self.stage, self.tensor], ("pp", "dp", "tp")
            self._mesh = DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)
        return self._mesh

    def own_pipeline_group(self) -> Any:
        """A further group of this rank's pipeline, for traffic that must not meet the schedule's
        messages (a pair's point-to-point messages match in order on one communicator), on the
        pipeline group's backend. Collective: every rank makes every pipeline's, in one order."""
        if self.topology.world_size == 1:
            return None
        backend, mine = dist.get_backend(self.pipeline), None
        for ranks in _lanes(self.topology):
            group = dist.new_group(ranks, backend=backend)
            if self.rank in ranks:
                mine = group
        return mine


def _lanes(topology: Topology) -> list[list[int]]:
    """Every pipeline's ranks: one per replica and tensor rank."""
    return [topology.pipeline_ranks(w, k) for w in range(topology.width) for k in range(topology.tensor)]
