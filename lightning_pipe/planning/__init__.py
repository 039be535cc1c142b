"""Planners: how blocks are divided among stages (more to come: DP, AutoPipe heuristic)."""

from .partition import Partition, partition_blocks

__all__ = ["Partition", "partition_blocks"]
