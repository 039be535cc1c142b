"""The full checkpoint: the model in single-process layout, optimizer states by parameter name.

The model's state dict is gathered to global rank 0 from replica 0's stages (its keys are the full
model's), so a checkpoint loads into the unchanged LightningModule on one process. Optimizer states
are keyed by each parameter's full-model name rather than by a stage optimizer's indices, so a
checkpoint resumes on any number of stages and any partition, exactly:

    {"state": {name: that parameter's state}, "param_groups": [{hyper-parameters, "params": [names]}],
     "autopipe_aliases": {other name: name}, the run's state (keys.RUN)}

A parameter with several names (a tied embedding and LM head, held by the first and the last stage)
is stored once, under its first name in the full model; its other names are aliases. The run's
layout (partition, slicer count, schedule) is reused by a resumed run with the same depth.
Checkpoints written before (per-stage index states, `autopipe_stage_states`) resume at their depth
and partition. With checkpoint="sharded" the same states are written per rank (`sharded`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import Tensor

from ..context import RankContext
from .keys import ALIASES, OLD_STATES, RUN, decode_parameter, encode_parameter, encode_run, is_ours

# (stored names by id(parameter), this stage's name-keyed optimizer state) -> the layers' per-parameter extras
ParameterExtras = Callable[[dict[int, str], dict[str, Any]], dict[str, dict[str, Any]]]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def gather_to_zero(ctx: RankContext, obj: Any) -> Optional[list[Any]]:
    """Gather `obj` from the stages of replica 0 onto global rank 0 (others: None)."""
    if ctx.depth == 1:
        return [obj] if ctx.global_rank == 0 else None
    if ctx.replica_index != 0:
        return None
    parts = [None] * ctx.depth if ctx.global_rank == 0 else None
    dist.gather_object(obj, parts, dst=0, group=ctx.groups.pipeline)
    return parts


def full_state_dict(ctx: RankContext) -> dict[str, Any]:
    local = {k: v.detach().cpu() for k, v in ctx.module.state_dict().items()}
    merged: dict[str, Any] = {}
    for part in gather_to_zero(ctx, local) or []:
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


def _stored_names(ctx: RankContext, names: dict[int, list[str]]) -> dict[int, str]:
    """id(parameter) -> the name its state is stored under: its first name in the full model, i.e.
    the lowest block, then module order. A tied parameter's other holders are asked for theirs."""
    prefix = ctx.cut.path + "."
    order = {pid: min((_block(n, prefix), i, n) for i, n in enumerate(ns)) for pid, ns in names.items()}
    tied = {id(t.parameter): t.index for t in ctx.cut.tied if ctx.stage_index in t.stages}
    first = {tied[pid]: order[pid] for pid in tied}
    if ctx.depth > 1 and ctx.cut.tied:
        parts: list[Any] = [None] * ctx.depth
        dist.all_gather_object(parts, first, group=ctx.groups.pipeline)
        first = {t: min(p[t] for p in parts if t in p) for t in first}
    return {pid: (first[tied[pid]] if pid in tied else order[pid])[2] for pid in names}


# ---- saving ------------------------------------------------------------------------------------
def stage_named_state(ctx: RankContext, optimizer: Any, extras: Optional[ParameterExtras] = None) -> dict[str, Any]:
    """This stage's optimizer state keyed by parameter names (collective over the pipeline when
    parameters are tied), with the layers' per-parameter `extras` (collective as they need)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    names = parameter_names(ctx.module)
    stored = _stored_names(ctx, names)
    raw = optimizer.state_dict()
    state, groups = {}, []
    for group, saved in zip(optimizer.param_groups, raw["param_groups"]):
        members = [stored[id(p)] for p in group["params"]]
        state.update({stored[id(p)]: raw["state"][i] for p, i in zip(group["params"], saved["params"]) if i in raw["state"]})
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": members})
    aliases = {n: stored[pid] for pid, ns in names.items() for n in ns if n != stored[pid]}
    for name, extra in (extras(stored, state) if extras is not None else {}).items():
        state[name] = {**state.get(name, {}), **encode_parameter(extra)}
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


def layout(ctx: RankContext, run_state: dict[str, Any]) -> dict[str, Any]:
    """The run's state under its checkpoint keys: depth and partition, and what the layers handed in."""
    return encode_run({"depth": ctx.depth, "bounds": [list(b) for b in ctx.cut.bounds], **run_state})


def full_optimizer_state(ctx: RankContext, optimizer: Any, run_state: dict[str, Any], extras: Optional[ParameterExtras]) -> dict[str, Any]:
    """The name-keyed state of all stages on global rank 0 (others: {})."""
    parts = gather_to_zero(ctx, _to_cpu(stage_named_state(ctx, optimizer, extras)))
    if parts is None:
        return {}
    return {**merge_named(parts, ctx.cut.path + "."), **layout(ctx, run_state)}


# ---- loading -----------------------------------------------------------------------------------
def load_named_state(optimizer: Any, named: dict[str, Any], module: Any) -> dict[int, dict[str, Any]]:
    """Load a name-keyed state into `optimizer` over (some of) `module`'s parameters: a stage's
    optimizer, or a plain one over the whole model. Hyper-parameters come from the checkpoint.
    Returns the layers' per-parameter extras (keys.PARAMETER, by short name, e.g. 2BW's "stash")
    by id(parameter)."""
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
                own = {k: v for k, v in named["state"][name].items() if not is_ours(k)}
                extra = decode_parameter(named["state"][name])
                if own:
                    state[index] = own
                if extra:
                    extras[id(p)] = extra
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return extras


def load_optimizer_states(ctx: RankContext, checkpoint: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every optimizer's state; returns the layers' per-parameter extras (see load_named_state)."""
    states = checkpoint["optimizer_states"]
    extras: dict[int, dict[str, Any]] = {}
    if len(states) != len(ctx.optimizers):
        raise ValueError(f"the checkpoint holds {len(states)} optimizer states and the module configures {len(ctx.optimizers)}")
    for optimizer, state in zip(ctx.optimizers, states):
        if ALIASES in state:
            extras.update(load_named_state(optimizer, state, ctx.module))
        elif OLD_STATES in state:  # written before names: index states of the same depth and partition
            if state[RUN["depth"]] != ctx.depth or [list(b) for b in ctx.cut.bounds] != state[RUN["bounds"]]:
                raise ValueError(
                    f"this checkpoint stores optimizer states per stage of its {state['autopipe_depth']}-stage pipeline "
                    f"(partition {state['autopipe_bounds']}): resume it with that depth and partition"
                )
            optimizer.load_state_dict(state[OLD_STATES][ctx.stage_index])
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
