"""Partitions: which contiguous blocks each stage holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

PartitionSpec = Union[str, Sequence[int]]
PARTITION_METHODS = ("uniform",)


@dataclass(frozen=True)
class Partition:
    """``bounds[s]`` is the half-open block range ``(start, stop)`` of stage s."""

    bounds: tuple[tuple[int, int], ...]

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in self.bounds]

    @staticmethod
    def from_sizes(sizes: Sequence[int]) -> "Partition":
        bounds, start = [], 0
        for n in sizes:
            bounds.append((start, start + n))
            start += n
        return Partition(tuple(bounds))


def check_partition_spec(spec: PartitionSpec) -> None:
    """Reject a malformed setting before any process starts (the block count comes later)."""
    if isinstance(spec, str):
        if spec not in PARTITION_METHODS:
            raise ValueError(f"partition={spec!r} is not a known method; allowed: {list(PARTITION_METHODS)} or a list of blocks per stage")
        return
    sizes = list(spec)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"partition={sizes}: a list of blocks per stage must hold integers >= 1, one per stage")


def partition_blocks(spec: PartitionSpec, num_blocks: int, stages: int) -> Partition:
    """Resolve a partition setting into block ranges for `stages` stages of `num_blocks` blocks."""
    check_partition_spec(spec)
    if stages > num_blocks:
        raise ValueError(
            f"the pipeline has {stages} stages but the model only {num_blocks} blocks: use at most {num_blocks} "
            "stages (devices x nodes / width) or split the model into more blocks"
        )
    if isinstance(spec, str):  # uniform: equal block counts, the remainder to the last stages
        base, extra = divmod(num_blocks, stages)
        return Partition.from_sizes([base + (1 if s >= stages - extra else 0) for s in range(stages)])
    sizes = list(spec)
    if len(sizes) != stages:
        raise ValueError(f"partition={sizes} lists {len(sizes)} stages but the pipeline has {stages} stages")
    if sum(sizes) != num_blocks:
        raise ValueError(f"partition={sizes} sums to {sum(sizes)} blocks but the model has {num_blocks} blocks")
    return Partition.from_sizes(sizes)
