"""The training order: a shuffle that is a function of (seed, epoch) and a position that is saved in
checkpoints, so a resumed run draws the same batches as an uninterrupted one, mid-epoch or not."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """torch's DistributedSampler (a permutation per epoch seeded by seed + epoch, sharded over the
    pipeline replicas) whose iterator is stateful: torchdata's StatefulDataLoader saves the epoch and
    the position of the running epoch and restores both.

    Why the iterator carries the epoch: on resume Lightning loads the loader's state before it calls
    `set_epoch`, so a loader that fast-forwards a plain sampler would skip into the order of epoch 0.
    A DistributedSampler subclass also tells Lightning the data is already sharded by replica (it
    would otherwise swap in its own sampler, which has the same problem).
    """

    def __init__(self, data_source: Sized, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(data_source, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)

    def indices(self, epoch: int) -> list[int]:
        current, self.epoch = self.epoch, epoch
        try:
            return list(super().__iter__())
        finally:
            self.epoch = current

    def __iter__(self) -> Iterator[int]:
        return _EpochIterator(self, self.epoch)


class _EpochIterator(Iterator[int]):
    def __init__(self, sampler: ResumableSampler, epoch: int, position: int = 0) -> None:
        self.sampler, self.epoch, self.position = sampler, epoch, position
        self.order = sampler.indices(epoch)

    def __next__(self) -> int:
        if self.position >= len(self.order):
            raise StopIteration
        self.position += 1
        return self.order[self.position - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(self.sampler, state["epoch"], state["position"])
