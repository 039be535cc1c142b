"""Sharded checkpoints (checkpoint="sharded"): every rank writes its own stage, nothing is gathered.

A checkpoint is a directory. torch.distributed.checkpoint (DCP) writes a flat dict of tensors from
every rank: ``model/<key>`` (the stage's state dict, full-model keys) and
``optimizer_<i>/<name>/<state key>`` (the name-keyed optimizer state of `full`); a key held by
several ranks (a tied parameter's state, the copies of other replicas) is written once. Global
rank 0 adds ``meta.pt``: the rest of Lightning's checkpoint (loops, schedulers, callbacks,
hyper-parameters) with the optimizer states' names, groups, non-tensor values and the layout.

Resuming, at any depth: every rank reads its own stage's keys. `consolidate` turns the directory
into the single-file layout of checkpoint="full" (`load_from_checkpoint` works on that).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.cloud_io import _load
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...runtime.tensor_parallel import is_strided
from ..context import RankContext
from .full import gather_to_zero, layout, merge_named, parameter_names
from .keys import ALIASES

META = "meta.pt"
MODEL = "model/"


def is_sharded(path: Any) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, META))


def read_meta(path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    return _load(os.path.join(path, META), map_location="cpu", weights_only=weights_only)


def _optimizer_prefix(i: int) -> str:
    return f"optimizer_{i}/"


def _split(named: dict[str, Any], prefix: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(the tensors under flat keys, the rest: groups, aliases and non-tensor state values)."""
    tensors = {f"{prefix}{name}/{k}": v for name, s in named["state"].items() for k, v in s.items() if isinstance(v, Tensor)}
    state = {name: {k: v for k, v in s.items() if not isinstance(v, Tensor)} for name, s in named["state"].items()}
    return tensors, {**named, "state": state}


def save(ctx: RankContext, checkpoint: dict[str, Any], path: Any, run_state: dict[str, Any]) -> None:
    """Lightning's `checkpoint` of this rank (its stage's model and named optimizer states) into
    the directory `path`, the run's state beside them; collective over all ranks."""
    box = [str(path)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, 0)
    path = box[0]
    tensors = {MODEL + k: v for k, v in checkpoint.pop("state_dict").items()}
    skeletons = []
    for i, named in enumerate(checkpoint.pop("optimizer_states", [])):
        flat, rest = _split(named, _optimizer_prefix(i))
        tensors.update(flat)
        skeletons.append(gather_to_zero(ctx, rest))
    if ctx.global_rank == 0:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        os.makedirs(path)
    _barrier()
    # a strided shard (tensor parallelism's fused q, k, v) is stored whole: DCP stores contiguous chunks only
    dcp.save({k: v.full_tensor() if is_strided(v) else v for k, v in tensors.items()}, checkpoint_id=path)
    if ctx.global_rank == 0:
        prefix = ctx.cut.path + "."
        checkpoint["optimizer_states"] = [{**merge_named(parts, prefix), **layout(ctx, run_state)} for parts in skeletons]
        torch.save(checkpoint, os.path.join(path, META))
    _barrier()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _stored_tensors(path: str) -> dict[str, TensorStorageMetadata]:
    found = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: m for k, m in found.items() if isinstance(m, TensorStorageMetadata)}


def _empty(meta: TensorStorageMetadata) -> Tensor:
    return torch.empty(meta.size, dtype=meta.properties.dtype)


def _by_parameter(stored: dict[str, Any], prefix: str) -> dict[str, list[str]]:
    """name -> the state keys stored for it under `prefix`."""
    found: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith(prefix):
            name, _, k = key[len(prefix) :].rpartition("/")
            found.setdefault(name, []).append(k)
    return found


def load(module: Any, optimizers: list[Any], path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's checkpoint restricted to this rank's stage (`module` holds it): its model keys,
    and (fitting: `optimizers`) the named optimizer states of its parameters; collective over all ranks."""
    path = str(path)
    checkpoint, stored = read_meta(path, weights_only), _stored_tensors(path)
    wanted = {MODEL + k: _empty(stored[MODEL + k]) for k in module.state_dict() if MODEL + k in stored}
    mine: list[tuple[str, dict[str, Any], dict[str, list[str]]]] = []
    if optimizers and checkpoint.get("optimizer_states"):
        names = parameter_names(module)
        for i, (optimizer, named) in enumerate(zip(optimizers, checkpoint["optimizer_states"])):
            aliases, prefix, keys = named.get(ALIASES, {}), _optimizer_prefix(i), _by_parameter(stored, _optimizer_prefix(i))
            own = {aliases.get(names[id(p)][0], names[id(p)][0]) for g in optimizer.param_groups for p in g["params"]}
            wanted.update({f"{prefix}{n}/{k}": _empty(stored[f"{prefix}{n}/{k}"]) for n in own for k in keys.get(n, [])})
            mine.append((prefix, named, {n: keys.get(n, []) for n in own}))
    dcp.load(wanted, checkpoint_id=path)
    checkpoint["state_dict"] = {k[len(MODEL) :]: v for k, v in wanted.items() if k.startswith(MODEL)}
    for prefix, named, own in mine:
        state = {n: {**named["state"].get(n, {}), **{k: wanted[f"{prefix}{n}/{k}"] for k in ks}} for n, ks in own.items()}
        named["state"] = {n: s for n, s in state.items() if s}
    return checkpoint


def consolidate(path: Any, out: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Write the sharded checkpoint `path` as one file `out` in checkpoint="full"'s layout (and
    return it); runs in a plain process, no process group needed. `weights_only`: for torch.load."""
    path = str(path)
    checkpoint, stored = read_meta(path, weights_only), _stored_tensors(path)
    tensors = {k: _empty(m) for k, m in stored.items()}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=path, no_dist=True)
    checkpoint["state_dict"] = {k[len(MODEL) :]: v for k, v in tensors.items() if k.startswith(MODEL)}
    for i, named in enumerate(checkpoint.get("optimizer_states", [])):
        for name, ks in _by_parameter(tensors, _optimizer_prefix(i)).items():
            named["state"].setdefault(name, {}).update({k: tensors[f"{_optimizer_prefix(i)}{name}/{k}"] for k in ks})
    torch.save(checkpoint, out)
    return checkpoint
