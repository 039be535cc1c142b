"""Every `autopipe_*` key a checkpoint holds, in one place.

Layers hand their state in under their own short names; this module writes and reads them under the
checkpoint's keys, so a key is named once and no layer spells a checkpoint format. Two kinds:

- the run's state, beside the first optimizer's name-keyed state (`RUN`);
- per-parameter extras inside that parameter's optimizer-state entry (`PARAMETER`), which follow the
  parameter to whichever stage holds it when resuming at another depth.
"""

from __future__ import annotations

from typing import Any

PREFIX = "autopipe_"
ALIASES = "autopipe_aliases"  # marks the name-keyed layout: {other name: stored name}
OLD_STATES = "autopipe_stage_states"  # written before names: per-stage index states

RUN = {
    "depth": "autopipe_depth",  # pipeline stages of the run
    "bounds": "autopipe_bounds",  # block range of every model chunk
    "sliced": "autopipe_sliced",  # the slicer's halved warm-up micro-batches
    "schedule": "autopipe_schedule",  # [name, options] that ran (schedule="auto": the one chosen)
    "switched": "autopipe_switched",  # the partition changed while training (resume keeps it)
    "adaptive": "autopipe_adaptive",  # the switch rule's (and the learned or paper decider's) state
    "plan_2bw": "autopipe_2bw_plan",  # planner=2bw: the chosen shape (a resume keeps it)
    "applied": "autopipe_2bw_applied",  # PipeDream-2BW: updates the weights hold
    "advance": "autopipe_advance",  # AvgPipe's advance rule: where Algorithm 1 stands
    "iteration": "autopipe_avg_iteration",  # AvgPipe: iterations applied (the reference is W_ref(iteration))
}
PARAMETER = {
    "stash": "autopipe_2bw_previous",  # PipeDream-2BW: W(applied - 1)
    "pipelines": "autopipe_avg_pipelines",  # AvgPipe: [{"weight", "state"}] of every pipeline
    "refs": "autopipe_avg_refs",  # AvgPipe: {j: W_ref(j)} the coming pulls need
}


def is_ours(key: Any) -> bool:
    return str(key).startswith(PREFIX)


def _encode(table: dict[str, str], state: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(state) - set(table))
    if unknown:
        raise KeyError(f"no checkpoint key for layer state {unknown}; add it to lightning_pipe/lightning/checkpoint/keys.py")
    return {table[name]: value for name, value in state.items()}


def _decode(table: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
    return {name: saved[key] for name, key in table.items() if key in saved}


def encode_run(state: dict[str, Any]) -> dict[str, Any]:
    return _encode(RUN, state)


def decode_run(saved: dict[str, Any]) -> dict[str, Any]:
    """The run's state by short name ({} for a checkpoint of another strategy)."""
    return _decode(RUN, saved) if isinstance(saved, dict) else {}


def encode_parameter(extras: dict[str, Any]) -> dict[str, Any]:
    return _encode(PARAMETER, extras)


def decode_parameter(entry: dict[str, Any]) -> dict[str, Any]:
    return _decode(PARAMETER, entry)
