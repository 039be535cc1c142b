"""A stage's gradient duties beyond autograd, and the hand-over of gradients to Lightning.

- `StageGradients`: REDUCE(chunk) averages a chunk's gradients over the replicas, and after the
  rank's last chunk sums tied weights over the stages holding them (both linear: any order);
  the global norm for clipping; fp16's overflow agreed on by every rank.
- `GradientStash`: Lightning zeroes gradients *after* ``training_step``, so the gradients the
  schedule produced inside the step are set aside there and put back in ``backward``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..runtime.reduce import allreduce_mean, clip_grad_norm_global
from ..runtime.reduce import local as local_shard
from ..runtime.tied import TiedParameter, allreduce_tied
from ..topology import ProcessGroups, Topology
from .stage import PipelineStage

log = logging.getLogger(__name__)
_announced: set[tuple[tuple[int, ...], ...]] = set()


def _announce_ties(stages: list[tuple[int, ...]], rank: int) -> None:
    """One line on global rank 0 per layout of ties (not again for a live switch that keeps it)."""
    layout = tuple(stages)
    if not layout or rank != 0 or layout in _announced:
        return
    _announced.add(layout)
    where = "; ".join(f"stages {', '.join(map(str, s))}" for s in layout)
    log.info(f"{len(layout)} weight(s) tied across stages ({where}): their gradients are summed every step")


class StageGradients:
    def __init__(
        self,
        stage: PipelineStage,
        chunk_blocks: dict[int, list[int]],
        topology: Topology,
        groups: ProcessGroups,
        rank: int,
        tied: list[TiedParameter],
        average_replicas: bool = True,
        norm_over_replicas: bool = False,
    ):
        self.stage, self.chunk_blocks, self.topology, self.groups = stage, chunk_blocks, topology, groups
        self.average_replicas = average_replicas  # False for AvgPipe: each pipeline keeps its own gradients
        self.norm_over_replicas = norm_over_replicas  # ZeRO-1 / FSDP2: each replica clips the share it steps
        self.stage_index, self.replica_index = topology.stage_of(rank), topology.replica_of(rank)
        self.tensor_index = topology.tensor_of(rank)
        self.tied = tied
        self._tied_groups = self._tie(rank)
        self._reduced: set[int] = set()
        self.before_reduce: Optional[Any] = None  # a fine-grained switch's new worker: add the old one's partial gradients

    def _tie(self, rank: int) -> dict[int, Any]:
        """One group per tied parameter and replica (new_group is collective: every rank, same
        order); the copies start from the first holding stage's values."""
        topo, groups = self.topology, {}
        for t in self.tied:
            for w in range(topo.width):
                for k in range(topo.tensor):
                    ranks = [topo.global_rank(w, s, k) for s in t.stages]
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        groups[t.index] = group
            if self.stage_index in t.stages:
                src = topo.global_rank(self.replica_index, t.stages[0], self.tensor_index)
                dist.broadcast(t.parameter.data, src, group=groups[t.index])
        _announce_ties([t.stages for t in self.tied], rank)
        return groups

    def sync_replicas(self) -> None:
        """Replicas of a stage start from replica 0's weights (as DDP syncs from rank 0)."""
        if self.topology.width == 1:
            return
        src = self.topology.global_rank(0, self.stage_index, self.tensor_index)
        for tensor in list(self.stage.parameters()) + list(self.stage.buffers()):
            dist.broadcast(tensor.data, src, group=self.groups.stage)

    def reduce_chunk(self, chunk: int) -> None:
        """The schedule's REDUCE(chunk)."""
        if self.before_reduce is not None:
            self.before_reduce()
        self._sum_sequence_parts(chunk)
        if self.average_replicas:
            params = {id(p): p for i in self.chunk_blocks[chunk] for p in self.stage._modules[str(i)].parameters()}
            allreduce_mean(params.values(), self.groups.stage, self.topology.width)
        self._reduced.add(chunk)
        if self._reduced >= set(self.chunk_blocks):
            allreduce_tied(self.tied, self._tied_groups, self.stage_index)
            self._reduced = set()

    def _sum_sequence_parts(self, chunk: int) -> None:
        """Sequence parallelism: the whole weights of a block run on a part of the sequence (its norm) hold that
        part's gradient on each tensor rank: summed over the tensor group, they are one process's."""
        for i in self.chunk_blocks[chunk]:
            block = self.stage._modules[str(i)]
            if getattr(block, "sequence_parallel", None) is None:
                continue
            for p in block.parameters():
                if isinstance(p, DTensor) or not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.groups.tensor)

    def clip_grad_norm(self, params: Iterable[Tensor], max_norm: float) -> Tensor:
        """`clip_grad_norm_` over the whole pipeline; a tied weight's (equal) gradient counts once,
        on the first stage holding it. With the optimizer sharded, `params` are this replica's share of
        its stage's (equal, all-reduced) gradients: the shares of all ranks make up the model once."""
        params = list(params)
        if self.norm_over_replicas:
            group = dist.group.WORLD
        else:
            group = self.groups.pipeline if self.topology.depth > 1 else None
        copies = frozenset(id(t.parameter) for t in self.tied if t.stages[0] != self.stage_index)
        if self.topology.tensor > 1:  # the norm spans the tensor groups too; what a group holds whole counts once
            group = dist.group.WORLD
            copies |= {id(p) for p in params if not self._counted_here(p)}
        return clip_grad_norm_global(params, max_norm, group, skip_in_norm=frozenset(copies))

    def _counted_here(self, p: Tensor) -> bool:
        """tensor > 1: whether this rank adds `p`'s gradient to the world's norm. A tensor whole on every rank of a
        tensor group (not split over "tp") counts on its first rank; equal replicas (not sharded) on replica 0."""
        split = isinstance(p, DTensor) and any(
            name == "tp" and not placement.is_replicate() for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements)
        )
        return (split or self.tensor_index == 0) and (self.norm_over_replicas or self.replica_index == 0)

    def stage_device(self) -> torch.device:
        return next(iter(self.stage.parameters())).device

    def agree_on_overflow(self, params: Iterable[Tensor]) -> None:
        """fp16: every rank must skip the same steps. Before the scaler unscales, any rank's
        non-finite gradient is made every rank's (one inf written into a local gradient), so each
        scaler's own check finds it, skips the step and backs off its scale alike."""
        grads = [local_shard(p.grad) for p in params if p.grad is not None]
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if grads:
            local = torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in grads]).any()
        else:  # nothing to step here (a replica owning no parameter): still takes part in the agreement
            local = torch.zeros((), dtype=torch.bool, device=self.stage_device())
        found = local.to(torch.float32).reshape(1)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found.item() > 0 and not local.item() and grads:
            grads[0].view(-1)[0] = float("inf")


class GradientStash:
    """Gradients made inside ``training_step``, kept aside from Lightning's ``zero_grad``."""

    def __init__(self) -> None:
        self._new: list[Optional[Tensor]] = []

    def around_step(self, params: list[nn.Parameter], step: Any) -> Any:
        saved = [p.grad for p in params]  # stale or accumulated: Lightning zeroes or keeps them after the step
        for p in params:
            p.grad = None
        try:
            return step()
        finally:
            self._new = [p.grad for p in params]
            for p, g in zip(params, saved):
                p.grad = g

    def put_back(self, params: list[nn.Parameter], accumulate: int) -> None:
        """Add the step's gradients to what is there, divided as Lightning divides the closure loss."""
        for p, g in zip(params, self._new):
            if g is None:
                continue
            if accumulate > 1:
                g = g / accumulate
            p.grad = g if p.grad is None else p.grad + g
        self._new = []
