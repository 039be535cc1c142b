"""Parameters shared by blocks that land on different stages (tied embeddings).

GPT's token embedding and LM head are one weight. Cut into stages, the first and the last stage
each hold a copy; as DeepSpeed's TiedLayerSpec and Megatron do, their gradients are summed across
those stages every step, so both copies take the same update and training equals one process.
Detection is automatic: any parameter object reachable from blocks on two or more stages is tied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .reduce import local


@dataclass(frozen=True)
class TiedParameter:
    index: int  # position among the pipeline's tied parameters (same on every rank)
    stages: tuple[int, ...]  # stages holding a copy, ascending; the first one owns it for norms
    parameter: nn.Parameter  # this process's copy (valid on the stages in `stages`)


def find_tied_parameters(
    pipeline: nn.Sequential, bounds: tuple[tuple[int, int], ...], chunk_rank: Optional[tuple[int, ...]] = None
) -> list[TiedParameter]:
    """`bounds[c]` are chunk c's blocks, on rank ``chunk_rank[c]`` (default: chunk c on rank c)."""
    owner = chunk_rank if chunk_rank is not None else tuple(range(len(bounds)))
    stage_of_block = {b: owner[c] for c, (start, stop) in enumerate(bounds) for b in range(start, stop)}
    holders: dict[int, set[int]] = {}
    objects: dict[int, nn.Parameter] = {}
    order: list[int] = []
    for b, block in enumerate(pipeline):
        for p in block.parameters():
            if id(p) not in holders:
                holders[id(p)] = set()
                objects[id(p)] = p
                order.append(id(p))
            holders[id(p)].add(stage_of_block[b])
    tied = [pid for pid in order if len(holders[pid]) > 1]
    return [TiedParameter(i, tuple(sorted(holders[pid])), objects[pid]) for i, pid in enumerate(tied)]


def allreduce_tied(tied: list[TiedParameter], groups: dict[int, object], stage: int) -> None:
    """Sum the gradients of the tied parameters this stage holds over the stages holding them."""
    for t in tied:
        if stage not in t.stages:
            continue
        p = t.parameter
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        # a DTensor's shard (shard="full"): every holder shards the weight alike over its replicas, so the
        # shards of one replica index are the same slice on every stage
        dist.all_reduce(local(p.grad), group=groups[t.index])


TieGroup = tuple[tuple[int, str], ...]  # (block index, parameter name inside the block) sharing one weight


def tie_groups(pipeline: nn.Sequential) -> list[TieGroup]:
    """Every parameter reachable from two or more blocks, as the (block, name) pairs naming it, in
    module order. Unlike object identity, this survives cutting: a rank that never held a block can
    still tell which of its parameters a received block must share (adaptive re-partitioning)."""
    members: dict[int, list[tuple[int, str]]] = {}
    for b, block in enumerate(pipeline):
        for name, p in block.named_parameters(remove_duplicate=False):
            members.setdefault(id(p), []).append((b, name))
    return [tuple(m) for m in members.values() if len({b for b, _ in m}) > 1]


def tied_blocks(pipeline: nn.Sequential) -> list[list[int]]:
    """The blocks of each `tie_groups` group (a tied embedding and head: [0, n - 1])."""
    return [sorted({b for b, _ in group}) for group in tie_groups(pipeline)]


def tied_from_groups(
    groups: list[TieGroup], bounds: tuple[tuple[int, int], ...], chunk_rank: tuple[int, ...], me: int, blocks: dict[int, nn.Module]
) -> list[TiedParameter]:
    """`find_tied_parameters` for a cut model: the tie groups spanning several stages under `bounds`,
    numbered as every rank numbers them, with this rank's copy (`blocks`: the blocks it holds)."""
    stage_of_block = {b: chunk_rank[c] for c, (start, stop) in enumerate(bounds) for b in range(start, stop)}
    out: list[TiedParameter] = []
    for group in groups:
        stages = tuple(sorted({stage_of_block[b] for b, _ in group}))
        if len(stages) < 2:
            continue
        held = [blocks[b].get_parameter(name) for b, name in group if b in blocks]
        parameter = held[0] if me in stages else None
        out.append(TiedParameter(len(out), stages, parameter))  # type: ignore[arg-type]
    return out
