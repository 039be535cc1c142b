"""Simulation: the cost model, the simulator that replays action lists on it, timelines to look at.

No torch.distributed, no Lightning: planners, tuners and the adaptive scorer ask it.
"""

from .costs import CostModel
from .simulator import (
    Event,
    Timeline,
    chunk_costs,
    done_key,
    input_source,
    master_stage,
    message_of,
    produced_by,
    simulate,
    split_costs,
    trace_critical_path,
)
from .timelines import chrome_trace, gantt, traced_timeline

__all__ = [
    "CostModel",
    "Event",
    "Timeline",
    "chrome_trace",
    "chunk_costs",
    "done_key",
    "gantt",
    "input_source",
    "master_stage",
    "message_of",
    "produced_by",
    "simulate",
    "split_costs",
    "trace_critical_path",
    "traced_timeline",
]
