"""Checkpoints of a cut model: the full model in single-process layout, optimizer states by name.

The model's state dict is gathered to global rank 0 from replica 0's stages (its keys are the full
model's), so a checkpoint loads into the unchanged LightningModule on one process. Optimizer states
are keyed by each parameter's full-model name rather than by a stage optimizer's indices, so a
checkpoint resumes on any number of stages and any partition, exactly:

    {"state": {name: that parameter's state}, "param_groups": [{hyper-parameters, "params": [names]}],
     "autopipe_aliases": {other name: name}, "autopipe_depth", "autopipe_bounds", "autopipe_sliced",
     "autopipe_schedule"}

A parameter with several names (a tied embedding and LM head, held by the first and the last stage)
is stored once, under its first name in the full model; its other names are aliases. The run's
layout (partition, slicer count, schedule) is reused by a resumed run with the same depth.
Checkpoints written before (per-stage index states, `autopipe_stage_states`) resume at their depth
and partition. With checkpoint="sharded" the same states are written per rank (checkpoint_sharded).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from ..schedules import ScheduleSpec

ALIASES = "autopipe_aliases"  # marks the name-keyed layout
OLD_STATES = "autopipe_stage_states"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def gather_to_zero(strategy: Any, obj: Any) -> Optional[list[Any]]:
    """Gather `obj` from the stages of replica 0 onto global rank 0 (others: None)."""
    if strategy.topology.depth == 1:
        return [obj] if strategy.global_rank == 0 else None
    if strategy.replica_index != 0:
        return None
    parts = [None] * strategy.topology.depth if strategy.global_rank == 0 else None
    dist.gather_object(obj, parts, dst=0, group=strategy.process_groups.pipeline)
    return parts


def full_state_dict(strategy: Any) -> dict[str, Any]:
    local = {k: v.detach().cpu() for k, v in strategy.lightning_module.state_dict().items()}
    merged: dict[str, Any] = {}
    for part in gather_to_zero(strategy, local) or []:
        merged.update(part)
    return merged


# ---- names -----------------------------------------------------------------------------------------
def parameter_names(module: Any) -> dict[int, list[str]]:
    """id(parameter) -> all its names in `module`, in module order."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _block(name: str, prefix: str) -> int:
    return int(name[len(prefix) :].split(".", 1)[0]) if name.startswith(prefix) else -1


def _stored_names(strategy: Any, names: dict[int, list[str]]) -> dict[int, str]:
    """id(parameter) -> the name its state is stored under: its first name in the full model, i.e.
    the lowest block, then module order. A tied parameter's other holders are asked for theirs."""
    prefix = strategy.cut.path + "."
    order = {pid: min((_block(n, prefix), i, n) for i, n in enumerate(ns)) for pid, ns in names.items()}
    tied = {id(t.parameter): t.index for t in strategy.cut.tied if strategy.stage_index in t.stages}
    first = {tied[pid]: order[pid] for pid in tied}
    if strategy.topology.depth > 1 and strategy.cut.tied:
        parts: list[Any] = [None] * strategy.topology.depth
        dist.all_gather_object(parts, first, group=strategy.process_groups.pipeline)
        first = {t: min(p[t] for p in parts if t in p) for t in first}
    return {pid: (first[tied[pid]] if pid in tied else order[pid])[2] for pid in names}


# ---- saving ------------------------------------------------------------------------------------
def stage_named_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    """This stage's optimizer state keyed by parameter names (collective over the pipeline when
    parameters are tied)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    names = parameter_names(strategy.lightning_module)
    stored = _stored_names(strategy, names)
    raw = optimizer.state_dict()
    state, groups = {}, []
    for group, saved in zip(optimizer.param_groups, raw["param_groups"]):
        members = [stored[id(p)] for p in group["params"]]
        state.update({stored[id(p)]: raw["state"][i] for p, i in zip(group["params"], saved["params"]) if i in raw["state"]})
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": members})
    aliases = {n: stored[pid] for pid, ns in names.items() for n in ns if n != stored[pid]}
    if strategy.config.mode == "2bw":  # the stashed previous version travels with each parameter's state
        from .two_bw import stash_state

        for name, extra in stash_state(strategy, stored).items():
            state[name] = {**state.get(name, {}), **extra}
    if strategy.config.mode == "avgpipe":  # every pipeline's weights and state, the pending references
        from .avgpipe import stash_state as avg_state

        for name, extra in avg_state(strategy, stored, state).items():
            state[name] = {**state.get(name, {}), **extra}
    return {"state": state, "param_groups": groups, ALIASES: aliases}


def merge_named(parts: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """The stages' name-keyed states as one (a tied parameter's state once), groups in model order."""
    if len({len(p["param_groups"]) for p in parts}) > 1:
        counts = [len(p["param_groups"]) for p in parts]
        raise ValueError(f"the stages' optimizers have different numbers of param groups ({counts}); every stage needs the same groups")
    merged: dict[str, Any] = {"state": {}, "param_groups": [], ALIASES: {}}
    for part in parts:
        for name, value in part["state"].items():
            merged["state"].setdefault(name, value)
        merged[ALIASES].update(part[ALIASES])
    for groups in zip(*(p["param_groups"] for p in parts)):
        members = list(dict.fromkeys(n for g in groups for n in g["params"]))
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        merged["param_groups"].append({**hyper, "params": sorted(members, key=lambda n: _block(n, prefix))})
    return merged


def layout(strategy: Any) -> dict[str, Any]:
    mode = strategy.mode.state_dict()
    out = {
        "autopipe_depth": strategy.topology.depth,
        "autopipe_bounds": [list(b) for b in strategy.cut.bounds],
        "autopipe_sliced": mode["sliced"],
        "autopipe_schedule": mode["schedule"],
    }
    if "applied" in mode:  # 2BW: updates the weights hold (the stash is W(applied - 1))
        out["autopipe_2bw_applied"] = mode["applied"]
    if "advance" in mode:  # AvgPipe's advance rule: where Algorithm 1 stands (resumed, not re-explored)
        out["autopipe_advance"] = mode["advance"]
    if strategy.cut.switched:  # the partition changed while training: a resumed run continues on it
        out["autopipe_switched"] = True
    if getattr(strategy, "adaptive", None) is not None and strategy.adaptive.enabled:
        out["autopipe_adaptive"] = strategy.adaptive.state_dict()
    if getattr(strategy, "two_bw", None) is not None:  # planner=2bw: a resumed run keeps the chosen shape
        out["autopipe_2bw_plan"] = dataclasses.asdict(strategy.two_bw)
    if "iteration" in mode:  # AvgPipe: iterations applied (the reference is W_ref(iteration))
        out["autopipe_avg_iteration"] = mode["iteration"]
    return out


def full_optimizer_state(strategy: Any, optimizer: Any) -> dict[str, Any]:
    """The name-keyed state of all stages on global rank 0 (others: {})."""
    parts = gather_to_zero(strategy, _to_cpu(stage_named_state(strategy, optimizer)))
    if parts is None:
        return {}
    return {**merge_named(parts, strategy.cut.path + "."), **layout(strategy)}


# ---- loading -----------------------------------------------------------------------------------
def load_named_state(optimizer: Any, named: dict[str, Any], module: Any) -> dict[int, dict[str, Any]]:
    """Load a name-keyed state into `optimizer` over (some of) `module`'s parameters: a stage's
    optimizer, or a plain one over the whole model. Hyper-parameters come from the checkpoint.
    Returns the entries that are the strategy's, not the optimizer's (``autopipe_*``, e.g. 2BW's
    stashed weights) by id(parameter)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    aliases, names = named.get(ALIASES, {}), parameter_names(module)
    if len(named["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(named['param_groups'])} param groups and this one {len(optimizer.param_groups)}"
        )
    home = {n: g for g, group in enumerate(named["param_groups"]) for n in group["params"]}
    state, groups, index = {}, [], 0
    extras: dict[int, dict[str, Any]] = {}
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, named["param_groups"])):
        ids = []
        for p in group["params"]:
            name = aliases.get(names[id(p)][0], names[id(p)][0])
            if home.get(name) != g:
                where = f"in param group {home[name]}" if name in home else "not"
                raise ValueError(f"parameter {name!r} is in param group {g} of the optimizer but {where} in the checkpoint")
            if name in named["state"]:
                own = {k: v for k, v in named["state"][name].items() if not str(k).startswith("autopipe_")}
                extra = {k: v for k, v in named["state"][name].items() if str(k).startswith("autopipe_")}
                if own:
                    state[index] = own
                if extra:
                    extras[id(p)] = extra
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return extras


def load_optimizer_states(strategy: Any, checkpoint: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every optimizer's state; returns the strategy's own per-parameter entries (see load_named_state)."""
    states = checkpoint["optimizer_states"]
    extras: dict[int, dict[str, Any]] = {}
    if len(states) != len(strategy.optimizers):
        raise ValueError(f"the checkpoint holds {len(states)} optimizer states and the module configures {len(strategy.optimizers)}")
    for optimizer, state in zip(strategy.optimizers, states):
        if ALIASES in state:
            extras.update(load_named_state(optimizer, state, strategy.lightning_module))
        elif OLD_STATES in state:  # written before names: index states of the same depth and partition
            if state["autopipe_depth"] != strategy.topology.depth or [list(b) for b in strategy.cut.bounds] != state["autopipe_bounds"]:
                raise ValueError(
                    f"this checkpoint stores optimizer states per stage of its {state['autopipe_depth']}-stage pipeline "
                    f"(partition {state['autopipe_bounds']}): resume it with that depth and partition"
                )
            optimizer.load_state_dict(state[OLD_STATES][strategy.stage_index])
        else:
            raise ValueError(
                "this checkpoint's optimizer state was not written by AutoPipeStrategy; resume it with the strategy that wrote it"
            )
    return extras


def load_stage_state(module: Any, checkpoint: dict[str, Any], strict: bool = True) -> None:
    """This stage's keys of a full-model state dict."""
    local_keys = module.state_dict().keys()
    state = {k: v for k, v in checkpoint["state_dict"].items() if k in local_keys}
    if strict:
        missing = [k for k in local_keys if k not in state]
        if missing:
            raise KeyError(f"the checkpoint lacks this stage's keys: {missing[:5]}")
    module.load_state_dict(state, strict=strict)


# ---- the layout a resumed run reuses ---------------------------------------------------------------
@dataclass(frozen=True)
class ResumedLayout:
    """How the checkpoint's run cut and scheduled the model."""

    bounds: Optional[tuple[tuple[int, int], ...]]  # None: the checkpoint holds none
    sliced: int
    schedule: Optional[ScheduleSpec]


def resumed_state(strategy: Any, path: Optional[str]) -> dict[str, Any]:
    """The layout keys of the checkpoint `fit(ckpt_path=path)` resumes ({} if none can be read ahead)."""
    from .checkpoint_sharded import is_sharded, read_meta

    if path is None:
        return {}
    if is_sharded(path):
        checkpoint = read_meta(path)
    elif os.path.isfile(path):
        checkpoint = strategy.checkpoint_io.load_checkpoint(path)
    else:
        return {}
    return (checkpoint.get("optimizer_states") or [{}])[0]


def resumed_layout(strategy: Any, path: Optional[str]) -> Optional[ResumedLayout]:
    """The layout of the checkpoint `fit(ckpt_path=path)` resumes, to cut and schedule exactly as
    its run did rather than by a new (noisy) plan; Lightning loads the checkpoint only after setup,
    so the launcher noted the path and this reads ahead. None when the run plans its own: another
    depth, or a listed partition (the optimizer states follow the parameters' names anywhere)."""
    state = resumed_state(strategy, path)
    if state.get("autopipe_depth") != strategy.topology.depth:
        return None
    if not isinstance(strategy.config.partition, str) and not state.get("autopipe_switched"):
        return None  # a listed partition wins, unless the checkpoint's run had switched away from it
    bounds, chosen = state.get("autopipe_bounds"), state.get("autopipe_schedule")
    spec = ScheduleSpec.of(chosen[0], **dict(chosen[1])) if chosen is not None else None
    bounds = tuple(tuple(b) for b in bounds) if bounds is not None else None
    return ResumedLayout(bounds, int(state.get("autopipe_sliced", 0)), spec)
