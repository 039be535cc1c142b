"""Weight versions for PipeDream-2BW over FSDP2-sharded blocks (shard="full"): each rank stashes its shard.

FSDP2 gathers a block's weights from each parameter's padded shard (`FSDPParam._sharded_param_data`) before
the block's forward, and, since it frees them after the forward, again before its backward. A version here is
that shard buffer per parameter; running a micro-batch on a version points FSDP2's gather at the version's
buffers for the forward *and* the backward (`use`), then back at the live ones, which the optimizer steps in
place. So a stage holds two versions of its 1/width share, as `WeightVersions` holds two of a whole stage.

Gradients: 2BW's order runs all of one batch's backwards on a stage before the next batch's first, so the
batches share FSDP2's unsharded accumulators and reduce-scatter at each batch's last backward (the engine marks
it). The reduced shards land in the sharded parameters' ``.grad``, where a batch completed in its own step would
meet the one before it, still waiting for its update: each version keeps its batch's reduced gradients
(`backward`), and `collect` hands them to the parameters for the update, as `WeightVersions` does.

FSDP2 has no public way to gather from another buffer, so this reaches its private state: `fully_shard.state`'s
parameter groups, each `FSDPParam`'s padded shard, and the sharded parameter's local tensor (which FSDP2's own
`reset_sharded_param` re-points the same way).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from .versions import storage


class Version(dict):
    """id(live sharded parameter) -> its padded shard buffer in this version; `grads`: the batch's reduced
    gradient shards so far."""

    def __init__(self, buffers: dict[int, Tensor]):
        super().__init__(buffers)
        self.grads: dict[int, Optional[Tensor]] = {}


def _states(module: nn.Module) -> list:
    return [fully_shard.state(block) for block in module.modules() if isinstance(block, FSDPModule)]  # type: ignore[attr-defined]


def fsdp_params(module: nn.Module) -> list:
    """The FSDP2 parameters (`FSDPParam`) of `module`'s sharded blocks, in module order."""
    return [fp for state in _states(module) for group in state._fsdp_param_groups for fp in group.fsdp_params]


class ShardedVersions:
    """`WeightVersions`' interface over FSDP2's shards; `gathers`: the backward reads the version too."""

    gathers = True

    def __init__(self, module: nn.Module):
        self.params = fsdp_params(module)
        covered = {id(fp.sharded_param) for fp in self.params}
        loose = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in covered]
        if loose:
            raise ValueError(f"2BW over FSDP2: parameter {loose[0]!r} of the stage is in no sharded block")
        for fp in self.params:
            if fp.fsdp_placement.dim != 0 or fp.offload_to_cpu:
                raise ValueError("2BW over FSDP2 stashes dim-0 shards on the device: no shard_placement_fn or CPU offload")
        self.live = [fp.sharded_param for fp in self.params]
        self._uninitialized = _states(module)  # FSDP2 initializes a block at its first forward, see `use`

    def version(self, stashed: Optional[dict[int, Tensor]] = None) -> Version:
        """A new version reading the live shards, or the `stashed` buffers."""
        return Version(
            {id(fp.sharded_param): stashed[id(fp.sharded_param)] if stashed is not None else fp._sharded_param_data for fp in self.params}
        )

    def aliases_live(self, version: Version) -> bool:
        fp = self.params[0] if self.params else None
        return fp is not None and storage(version[id(fp.sharded_param)]) == storage(fp._sharded_param_data)

    def snapshot(self) -> dict[int, Tensor]:
        """A copy of the live shards (the version the next batch reads after a drain)."""
        return {id(fp.sharded_param): fp._sharded_param_data.detach().clone() for fp in self.params}

    def detach_live(self) -> None:
        """The live shards move to fresh buffers (same values) before the optimizer writes them, so a version
        reading the old ones keeps its weights: FSDP2's gather input and the parameter's local tensor both."""
        with torch.no_grad():
            for fp in self.params:
                fresh = fp._sharded_param_data.clone()
                length = fp.sharded_param._local_tensor.size(0)
                fp._sharded_param_data = fresh
                fp.sharded_param._local_tensor = fresh.view(fp.padded_sharded_param_size).narrow(0, 0, length)

    @contextmanager
    def use(self, version: Version) -> Iterator[None]:
        """FSDP2 gathers `version`'s shards for what runs inside (a forward, or a backward's re-gather)."""
        if self.aliases_live(version):
            yield
            return
        # FSDP2's lazy initialization at a block's first forward re-points the gather at the parameter's local
        # tensor (the live shard): done first where a run starts on the stash (a resumed run's first batch)
        for state in self._uninitialized:
            state._lazy_init()
        self._uninitialized = []
        live = [fp._sharded_param_data for fp in self.params]
        for fp in self.params:
            fp._sharded_param_data = version[id(fp.sharded_param)]
        try:
            yield
        finally:
            for fp, data in zip(self.params, live):
                fp._sharded_param_data = data

    @contextmanager
    def backward(self, version: Version) -> Iterator[None]:
        """A backward of `version`'s batch: gathers its shards, and FSDP2 accumulates into its gradients."""
        with self.use(version):
            held = [p.grad for p in self.live]
            for p in self.live:
                p.grad = version.grads.get(id(p))
            try:
                yield
            finally:
                version.grads = {id(p): p.grad for p in self.live}
                for p, grad in zip(self.live, held):
                    p.grad = grad

    def collect(self, version: Version) -> None:
        """The batch's reduced gradients become the live shards' (for the update); the version's are released."""
        for p in self.live:
            p.grad = version.grads.get(id(p))
        version.grads = {}

    # ---- checkpoints: whole tensors, as the rest of a shard="full" checkpoint ------------------------
    def whole(self, stashed: dict[int, Tensor]) -> dict[int, Tensor]:
        """The stashed version as whole tensors (collective over each block's replicas)."""
        out = {}
        for fp in self.params:
            p, local = fp.sharded_param, fp.sharded_param._local_tensor
            shard = stashed[id(p)].view(fp.padded_sharded_param_size).narrow(0, 0, local.size(0))
            out[id(p)] = DTensor.from_local(
                shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            ).full_tensor()
        return out

    def from_whole(self, whole: dict[int, Tensor]) -> dict[int, Tensor]:
        """This rank's padded shard buffers of whole stashed tensors (each rank takes its part: no communication)."""
        out = {}
        for fp in self.params:
            p = fp.sharded_param
            local = distribute_tensor(whole[id(p)].to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None).to_local()
            padded = torch.zeros(fp.padded_sharded_param_size, dtype=p.dtype, device=p.device)
            padded.narrow(0, 0, local.size(0)).copy_(local)
            out[id(p)] = padded.view(-1)
        return out
