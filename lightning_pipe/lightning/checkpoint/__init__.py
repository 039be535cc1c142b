"""Checkpoints of a cut model (the bridge's; the layers hand their state in).

- `keys`: every `autopipe_*` key, and the mapping from the layers' state to them;
- `full`: the full model in single-process layout, optimizer states by parameter name (any depth);
- `sharded`: checkpoint="sharded", each rank writes its stage with torch.distributed.checkpoint;
- `resume`: reading a checkpoint's layout ahead of Lightning, so a resumed run cuts as it did.
"""

from .full import full_optimizer_state, full_state_dict, load_optimizer_states, load_stage_state, stage_named_state
from .resume import ResumedLayout, resumed_layout, resumed_state
from .sharded import consolidate, is_sharded

__all__ = [
    "ResumedLayout",
    "consolidate",
    "full_optimizer_state",
    "full_state_dict",
    "is_sharded",
    "load_optimizer_states",
    "load_stage_state",
    "resumed_layout",
    "resumed_state",
    "stage_named_state",
]
