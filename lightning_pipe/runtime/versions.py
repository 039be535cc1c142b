"""Weight versions for PipeDream-2BW's weight stashing on one stage.

A version is a set of parameter tensors that *alias* a buffer (the live parameters', or a stashed
copy's) without sharing its autograd version counter, so one batch's forward and backward run on
"its" version while the optimizer later writes the live parameters in place. Before the live
parameters change while a version still aliases them, `detach_live` moves the live parameters to a
fresh buffer and leaves the old one to the version: two buffers, never three.

Each batch gets its own version objects (its own ``.grad`` accumulators), even when two consecutive
batches read the same weights (batches 0 and 1 both use W(0)).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

Version = dict[int, nn.Parameter]  # id(live parameter) -> that parameter in this version


def _view(buffer: Tensor) -> Tensor:
    view = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    with torch.no_grad():
        view.set_(buffer.untyped_storage(), buffer.storage_offset(), buffer.size(), buffer.stride())
    return view


def _alias(buffer: Tensor) -> nn.Parameter:
    """A leaf parameter reading `buffer`'s storage, with an autograd version counter of its own (a DTensor's:
    its local shard's storage, laid out over the same mesh)."""
    if isinstance(buffer, DTensor):
        local = DTensor.from_local(
            _view(buffer.to_local()), buffer.device_mesh, buffer.placements, run_check=False, shape=buffer.shape, stride=buffer.stride()
        )
        return nn.Parameter(local, requires_grad=True)
    return nn.Parameter(_view(buffer), requires_grad=True)


def storage(t: Tensor) -> int:
    """Where `t`'s values live (a DTensor's: its local shard's buffer)."""
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


class WeightVersions:
    gathers = False  # a batch's backward reads the version its forward's graph holds: nothing to swap back in

    def __init__(self, module: nn.Module):
        # every place a trainable parameter is registered (a tied weight has several)
        self.slots = [
            (owner, name, p) for owner in module.modules() for name, p in owner._parameters.items() if p is not None and p.requires_grad
        ]
        self.live = list({id(p): p for _, _, p in self.slots}.values())

    def version(self, stashed: Optional[dict[int, Tensor]] = None) -> Version:
        """A new version reading the live parameters, or the `stashed` buffers."""
        return {id(p): _alias(stashed[id(p)] if stashed is not None else p.detach()) for p in self.live}

    def aliases_live(self, version: Version) -> bool:
        p = self.live[0] if self.live else None
        return p is not None and storage(version[id(p)]) == storage(p)

    def snapshot(self) -> dict[int, Tensor]:
        """A copy of the live weights (the version the next batch reads after a drain)."""
        return {id(p): p.detach().clone() for p in self.live}

    def detach_live(self) -> None:
        """Give the live parameters fresh buffers (same values) before the optimizer writes them, so
        a version aliasing the old ones keeps its weights. The live parameters are in no graph."""
        with torch.no_grad():
            for p in self.live:
                if isinstance(p, DTensor):  # `.data =` keeps a DTensor's local buffer: swap in a parameter holding a copy
                    fresh = DTensor.from_local(p.to_local().clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                    fresh = nn.Parameter(fresh, requires_grad=p.requires_grad)
                    fresh.grad = p.grad  # the swap moves everything the object holds: the gradient stays
                    torch.utils.swap_tensors(p, fresh)
                else:
                    p.data = p.data.clone()

    @contextmanager
    def use(self, version: Version) -> Iterator[None]:
        """Run the module with `version`'s parameters in place of the live ones."""
        for owner, name, p in self.slots:
            owner._parameters[name] = version[id(p)]
        try:
            yield
        finally:
            for owner, name, p in self.slots:
                owner._parameters[name] = p

    def collect(self, version: Version) -> None:
        """The gradients a batch accumulated in its version become the live parameters' (for the
        reduction and the optimizer step); the version's are released."""
        for p in self.live:
            grad = version[id(p)].grad
            p.grad = grad
            version[id(p)].grad = None

    # ---- checkpoints: whole tensors (a tensor-parallel weight's shards made whole) ----------------------
    def whole(self, stashed: dict[int, Tensor]) -> dict[int, Tensor]:
        """The stashed version as whole tensors (collective over each split weight's tensor ranks)."""
        return {pid: t.full_tensor() if isinstance(t, DTensor) else t for pid, t in stashed.items()}

    def from_whole(self, whole: dict[int, Tensor]) -> dict[int, Tensor]:
        """Stash buffers laid out as the live parameters (this rank's shard of a split weight)."""
        out = {}
        for p in self.live:
            t = whole[id(p)].to(p.device, p.dtype)
            out[id(p)] = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else t
        return out
