"""The full checkpoint: the model in single-process layout, optimizer states by parameter name.

The model's state dict is gathered to global rank 0 from replica 0's stages, one stage and one
tensor at a time into memory-mapped files (`gather_to_zero`; its keys are the full model's), so a
checkpoint loads into the unchanged LightningModule on one process. Optimizer states
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

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..context import RankContext
from .dtensors import full_tensors, like
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
    """`obj` (tensors anywhere in it, on this rank's device) from the stages of replica 0, in stage
    order, on global rank 0 with every tensor on the CPU (others: None).

    Streamed, so rank 0 never holds the stages' states in its own memory: one stage at a time, its
    structure as a small object and each tensor point to point (no pickled copy on either side, no
    single gather padded to the largest message), received into a memory-mapped file in the run
    folder that is unlinked at once. What rank 0 then holds of the other stages are file pages,
    which the kernel writes back and may drop while torch.save copies them into the checkpoint."""
    if ctx.depth == 1:
        return [_to_cpu(obj)] if ctx.global_rank == 0 else None
    if ctx.replica_index != 0 or ctx.tensor_index != 0:
        return None
    group, device = ctx.groups.pipeline, ctx.device
    transfer = device if device.type == "cuda" else None  # NCCL moves everything through device memory
    if ctx.stage_index != 0:
        tensors: dict[int, _Slot] = {}
        dist.send_object_list([_flatten(obj, tensors)], dst=ctx.pipeline_rank(0), group=group, device=transfer)
        for t in (slot.tensor for slot in tensors.values() if slot.tensor.numel() > 0):  # an empty one needs no message
            dist.send(t.detach().to(device).contiguous(), dst=ctx.pipeline_rank(0), group=group)
        return None
    parts = [_to_cpu(obj)]
    for stage in range(1, ctx.depth):
        box: list[Any] = [None]
        src = ctx.pipeline_rank(stage)
        dist.recv_object_list(box, src=src, group=group, device=transfer)
        parts.append(_receive_part(box[0], src, group, device, ctx.out_dir))
    return parts


class _Slot:
    """Where a tensor was in a streamed object: its shape and dtype (the tensor is sent on its own)."""

    def __init__(self, index: int, t: Tensor):
        self.index, self.shape, self.dtype, self.tensor = index, tuple(t.shape), t.dtype, t

    def __getstate__(self) -> dict[str, Any]:
        return {"index": self.index, "shape": self.shape, "dtype": self.dtype, "tensor": None}


def _flatten(obj: Any, tensors: dict[int, _Slot]) -> Any:
    if isinstance(obj, Tensor):
        if id(obj) not in tensors:
            tensors[id(obj)] = _Slot(len(tensors), obj)
        return tensors[id(obj)]
    if isinstance(obj, dict):
        return type(obj)((k, _flatten(v, tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj: Any, fill: Callable[[_Slot], Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return fill(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _unflatten(v, fill)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unflatten(v, fill) for v in obj)
    return obj


def _receive_part(skeleton: Any, src: int, group: Any, device: torch.device, folder: Path) -> Any:
    received: dict[int, Tensor] = {}  # a tensor that appears twice (a tied weight) comes once

    def fill(slot: _Slot) -> Tensor:
        if slot.index not in received:
            received[slot.index] = _receive(slot, src, group, device, folder)
        return received[slot.index]

    return _unflatten(skeleton, fill)


def _receive(slot: _Slot, src: int, group: Any, device: torch.device, folder: Path) -> Tensor:
    """One tensor from `src`, into a CPU tensor backed by a file that is gone once mapped."""
    numel = math.prod(slot.shape)
    if numel == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".checkpoint-part-", dir=folder)
    os.close(fd)
    try:
        out = torch.from_file(name, shared=True, size=numel, dtype=slot.dtype).view(slot.shape)
    finally:
        os.unlink(name)  # the mapping stays valid; nothing is left behind
    if device.type == "cpu":
        dist.recv(out, src=src, group=group)
    else:
        buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.recv(buffer, src=src, group=group)
        out.copy_(buffer)
    return out


def full_state_dict(ctx: RankContext) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in gather_to_zero(ctx, full_tensors(ctx.module.state_dict())) or []:  # every rank: DTensors made whole
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
    raw = full_tensors(optimizer.state_dict())  # shard="full": every rank of the mesh takes part
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
    parts = gather_to_zero(ctx, stage_named_state(ctx, optimizer, extras))
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
                own = {k: like(v, p) for k, v in named["state"][name].items() if not is_ours(k)}
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
    local = module.state_dict()
    local_keys = local.keys()
    state = {k: like(v, local[k]) for k, v in checkpoint["state_dict"].items() if k in local_keys}
    if strict:
        missing = [k for k in local_keys if k not in state]
        if missing:
            raise KeyError(f"the checkpoint lacks this stage's keys: {missing[:5]}")
    module.load_state_dict(state, strict=strict)
