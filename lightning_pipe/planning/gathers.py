"""FSDP2's all-gathers in the costs `schedule="auto"` plans on (ours), for shard="full".

Under shard="full" each rank holds 1/width of every block's weights, and FSDP2 all-gathers a block's
weights over the stage's `width` replicas before it computes. The gathers wait on the rank's own
thread of work (their start is where the block's compute would begin), so they are charged to the
block's compute, as `two_bw_mesh.mesh_costs` charges them for the 2BW planner:

- reshard="microbatch" (FSDP2's default): the weights are freed after each micro-batch's forward and
  gathered again for its backward, so one gather is added to every forward and one to every backward
  (to the input-gradient half, BI, of a split backward; a W that finds the weights freed by a forward
  since its BI gathers them again, which is not charged: zero bubble's figure is a lower bound).
- reshard="step": one gather per block and step, before its first forward; the simulator charges each
  micro-batch alike, so the gather is spread over the step's `microbatches` forwards.

The step's reduce-scatter of the gradients is the same for every schedule and is not charged (as the
replicas' all-reduce under shard="none" is not). The time of a gather is `CollectiveCosts.time` of the
block's whole weights over the replicas: measured on the run's own data-parallel group in training
(`profiling.collectives`), a ring over the link model in the plan command. No torch.
"""

from __future__ import annotations

import dataclasses

from ..simulation.costs import CostModel
from .collectives import CollectiveCosts


def gather_times(costs: CostModel, width: int, collectives: CollectiveCosts) -> list[float]:
    """Seconds to all-gather each block's weights over `width` replicas (0 without weight sizes)."""
    params = costs.param_bytes or (0.0,) * costs.num_blocks
    return [collectives.time("all_gather", p, width) for p in params]


def with_gathers(costs: CostModel, width: int, reshard: str, microbatches: int, collectives: CollectiveCosts) -> CostModel:
    """`costs` with FSDP2's all-gathers of each block's weights charged to its computes (unchanged at width 1)."""
    if reshard not in ("microbatch", "step"):
        raise ValueError(f"reshard={reshard!r}: 'microbatch' or 'step'")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r}: an integer >= 1")
    if width <= 1:
        return costs
    gather = gather_times(costs, width, collectives)
    before_forward = [g / microbatches for g in gather] if reshard == "step" else gather
    before_backward = [0.0] * len(gather) if reshard == "step" else gather

    def plus(values: tuple[float, ...], extra: list[float]) -> tuple[float, ...]:
        return tuple(v + e for v, e in zip(values, extra)) if values else values

    return dataclasses.replace(
        costs,
        forward=plus(costs.forward, before_forward),
        backward=plus(costs.backward, before_backward),
        backward_input=plus(costs.backward_input, before_backward),
    )
