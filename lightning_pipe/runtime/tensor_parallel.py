"""Tensor parallelism inside a stage: each block's weights split over the mesh's "tp" dimension by its plan
(torch's `parallelize_module` and its styles), plus the one style our fused attention needs. No Lightning.

Activations between blocks stay whole on every rank of a tensor group (a plan's row-parallel halves end in
an all-reduce), so a stage's input and output, and the pipeline's messages, are what one process has.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

Plan = Mapping[str, ParallelStyle]  # submodule name -> style, as `parallelize_module` takes it


class FusedColwise(ParallelStyle):
    """A Linear whose output is `parts` equal projections side by side (a fused q, k, v): each rank holds
    its columns of every part, so its output is its heads' q, k and v side by side. The weight is a strided
    shard (split into `parts`, then each part over the ranks): `full_tensor()` and checkpoints give back the
    single-process layout. Its input is whole on every rank (its gradient all-reduced in backward)."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedColwise splits an nn.Linear, not {type(module).__name__}")
        if module.out_features % (self.parts * device_mesh.size()):
            raise ValueError(
                f"a fused projection of {module.out_features} features does not split into {self.parts} parts over "
                f"{device_mesh.size()} tensor-parallel ranks"
            )
        placement = [_StridedShard(0, split_factor=self.parts)]
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), device_mesh, placement, src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(_whole_input(device_mesh))
        module.register_forward_hook(_local_output)
        return module


def _whole_input(mesh) -> Callable:
    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *rest) if not isinstance(x, DTensor) else args

    return hook


def _local_output(module: nn.Module, args: tuple, output):
    return output.to_local() if isinstance(output, DTensor) else output


def is_strided(t) -> bool:
    """A DTensor split as a strided shard (a `FusedColwise` weight): stores that take contiguous chunks
    (torch.distributed.checkpoint, FSDP2 on top) cannot take it as it is."""
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def parallelize_blocks(blocks: Mapping[int, nn.Module], mesh, plan_for: Callable[[int, nn.Module], Optional[Plan]]) -> None:
    """Each block's weights split over `mesh` (1-D, the "tp" dimension) by `plan_for(index, block)`; an empty
    plan leaves the block whole on every rank. A block already split (an earlier fit's) is left as it is."""
    for index, block in blocks.items():
        if any(isinstance(p, DTensor) for p in block.parameters()):
            continue
        plan = plan_for(index, block)
        if plan:
            parallelize_module(block, mesh, dict(plan))
