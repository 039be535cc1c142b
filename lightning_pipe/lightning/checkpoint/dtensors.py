"""DTensors (shard="full": FSDP2's sharded parameters and optimizer state) in and out of checkpoints.

Checkpoints keep the single-process layout: a DTensor is written as its full tensor (a collective over
its mesh, so every rank holding a shard converts), and a full tensor read back for a DTensor
parameter becomes this rank's shard of it (each rank takes its own part: no communication).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


def full_tensors(obj: Any) -> Any:
    """`obj` (a state dict, an optimizer state, nested dicts and lists) with every DTensor made whole."""
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_tensors(v) for v in obj)
    return obj


def like(value: Any, param: Tensor) -> Any:
    """`value` (a tensor of `param`'s shape, e.g. its weights or an Adam moment) as `param` is laid out:
    this rank's shard where `param` is a DTensor; anything else as it is."""
    if isinstance(param, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value
