"""The 2BW planner's search over tensor parallelism and sharding (ours, beside the paper's Algorithm 1).

With `plan_2bw(..., mesh=True)` every candidate also has a tensor-parallel degree T (the mesh's innermost
"tp": T consecutive ranks, one node's, so T divides the devices per node) and a shard mode over its
`width` replicas (none, optimizer: ZeRO-1, full: FSDP2 per block). This module prices a block at them:

- tensor T (Megatron): a split block (attention, ffn, layer: `tensor.SPLIT_KINDS`) holds and computes
  1/T of its weights and work, and all-reduces its output activation over the tp group once per
  half-layer (twice per layer) in the forward and as often in the backward (a recomputed backward
  runs the forward's too). Saved activations stay whole (an upper bound, as `tensor.py`).
- shard full: every block's weights are all-gathered over the replicas before its forward and again
  before its backward (FSDP2 frees them after each micro-batch); the step's gradient all-reduce becomes
  a reduce-scatter (`two_bw_costs.allreduce_time`). Memory: parameters, gradients and optimizer state / width,
  plus one gathered block (`two_bw_costs.memory`).
- shard optimizer: costs as none; memory and the owners' broadcast are `two_bw_costs`' (`shard_optimizer`).

The collectives are priced by `Hardware.collectives` (measured, else the ring model on the link's
bandwidth). Which combinations exist is `options`: every tensor degree with every shard (ZeRO-1 over split
weights: each rank's moments of its tensor share / width); shard full with 1f1b, gpipe and 2bw (whose second
weight version is sharded too: `two_bw_costs.memory`).
No torch, no Lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from .sized import BlockCosts
from .tensor import SPLIT_KINDS
from .two_bw_costs import Hardware

SHARDS = ("none", "optimizer", "full")
FULL_SCHEDULES = ("1f1b", "gpipe", "2bw")  # what shard='full' runs among the planner's schedules (2bw: each rank stashes its shard)
ALL_REDUCES = {"attention": 1, "ffn": 1, "layer": 2}  # Megatron: one per attention, one per MLP, per direction


def tensor_degrees(hw: Hardware, kinds: Optional[Sequence[str]]) -> list[int]:
    """T among the divisors of the devices per node that divide the devices (1 alone if no block splits)."""
    if not kinds or not any(k in SPLIT_KINDS for k in kinds):
        return [1]
    per_node = hw.devices_per_node
    return [t for t in range(1, per_node + 1) if per_node % t == 0 and hw.devices % t == 0]


def options(hw: Hardware, kinds: Optional[Sequence[str]], schedules: Sequence[str]) -> list[tuple[int, str]]:
    """The (tensor, shard) pairs the search tries."""
    found = []
    for t in tensor_degrees(hw, kinds):
        for shard in SHARDS:
            if shard == "full" and not set(schedules) & set(FULL_SCHEDULES):
                continue
            found.append((t, shard))
    return found


def mesh_costs(costs: BlockCosts, kinds: Optional[Sequence[str]], tensor: int, shard: str, width: int, hw: Hardware) -> BlockCosts:
    """`costs` as one rank of a (width, tensor, shard) mesh sees its blocks: its tensor share plus the
    collectives each block's forward and backward wait for."""
    if tensor == 1 and (shard != "full" or width == 1):
        return costs
    n = len(costs.forward)
    kinds = list(kinds) if kinds and tensor > 1 else ["block"] * n
    share = [1.0 / tensor if k in SPLIT_KINDS else 1.0 for k in kinds]
    tp, dp = hw.collectives(tensor), hw.collectives(width * tensor)
    reduce = [
        ALL_REDUCES.get(k, 0) * tp.time("all_reduce", out, tensor) if s < 1 else 0.0 for k, out, s in zip(kinds, costs.output_bytes, share)
    ]
    params = tuple(p * s for p, s in zip(costs.param_bytes, share))
    gather = [dp.time("all_gather", p, width) if shard == "full" else 0.0 for p in params]
    return dataclasses.replace(
        costs,
        forward=tuple(f * s + r + g for f, s, r, g in zip(costs.forward, share, reduce, gather)),
        backward=tuple(b * s + r + g for b, s, r, g in zip(costs.backward, share, reduce, gather)),
        recompute_backward=tuple(b * s + 2 * r + g for b, s, r, g in zip(costs.recompute_backward, share, reduce, gather)),
        param_bytes=params,
    )
