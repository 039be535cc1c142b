"""Planners: how blocks are divided among stages.

`partition_blocks` resolves a configured partition (uniform / explicit sizes) for the strategy;
`plan` chooses one by a cost model with a named partitioner (uniform, parameters, dp, autopipe,
autopipe+refine, exhaustive) and simulates it; `transformer_costs` gives analytic GPT / BERT cost profiles.
"""

from .flops import PROFILE_MODELS, transformer_costs
from .partition import Partition, partition_blocks
from .partitioners import PARTITIONERS
from .planner import Plan, plan

__all__ = ["PARTITIONERS", "PROFILE_MODELS", "Partition", "Plan", "partition_blocks", "plan", "transformer_costs"]
