"""Weights of a traced model's blocks: created on one rank only, read from a Hugging Face directory,
or released where another rank holds them.

Under empty init (`trainer.init_module(empty_init=True)` or `configure_model()` on the meta device)
each rank creates only its blocks. Their initial values are the model's own initialisation for
each sub-module (Hugging Face's `_init_weights`, else every layer's `reset_parameters()`), under a
seed per block; when the model's `config._name_or_path` is a local directory of safetensors files
(a config read with `AutoConfig.from_pretrained(dir)`), the block's tensors are read from those
files instead, each rank reading only its own.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..adaptive.switch import skeleton
from ..models.init import materialize, reset_block
from .pipeline import TracedPipeline, _user_key

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"


def pretrained_dir(root: nn.Module) -> Optional[str]:
    """The local directory the model's config was read from, if it holds safetensors weights."""
    path = getattr(getattr(root, "config", None), "_name_or_path", None)
    if not path or not os.path.isdir(path):
        return None
    files = (SAFETENSORS_INDEX, SAFETENSORS_FILE)
    return path if any(os.path.isfile(os.path.join(path, f)) for f in files) else None


def read_tensors(directory: str, names: Iterable[str]) -> dict[str, Tensor]:
    """The named tensors of a safetensors checkpoint directory (one file or an index of shards);
    only those are read. Missing names are left out."""
    from safetensors import safe_open

    wanted = list(names)
    index = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = {n: SAFETENSORS_FILE for n in wanted}
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        if n in weight_map:
            by_file.setdefault(weight_map[n], []).append(n)
    out: dict[str, Tensor] = {}
    for file, keys in by_file.items():
        with safe_open(os.path.join(directory, file), framework="pt") as handle:
            present = set(handle.keys())
            out.update({k: handle.get_tensor(k) for k in keys if k in present})
    return out


def init_traced_block(pipeline: TracedPipeline, seeded: Callable[[int], Any]) -> Callable[[int, nn.Module], None]:
    """The initialiser of block `index` of `pipeline` (`seeded(index)`: the block's random numbers).
    A tensor tied to an earlier block (a head sharing the embedding) takes that block's values, so
    every rank holding a copy starts from the same numbers."""
    root = pipeline.original
    own_init = getattr(root, "_init_weights", None)
    directory = pretrained_dir(root)

    def tensor_maps() -> tuple[dict[int, int], dict[int, list[str]]]:
        # by id of the tensors as they are when a block is initialised: `materialize` has just put
        # new tensors in the meta ones' slots, so maps made beforehand would find none of them
        first_holder: dict[int, int] = {}
        for index, block in enumerate(pipeline):
            for t in _tensors(block):
                first_holder.setdefault(id(t), index)
        aliases: dict[int, list[str]] = {}
        for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
            aliases.setdefault(id(t), []).append(name)
        return first_holder, aliases

    def fresh(block: nn.Module) -> None:
        if callable(own_init):
            for m in block.modules():
                own_init(m)
        else:
            reset_block(block)

    def init(index: int, block: nn.Module) -> None:
        first_holder, aliases = tensor_maps()
        with seeded(index):
            fresh(block)
        earlier = {first_holder.get(id(t), index) for t in [*block.parameters(), *block.buffers()]} - {index}
        for j in sorted(earlier):  # tied to block j: its values, made on a throw-away copy of block j
            copy = skeleton(pipeline[j])
            materialize({j: copy}, lambda _i, b, j=j: _seeded_fresh(seeded, j, fresh, b))
            theirs = dict(zip([id(t) for t in _tensors(pipeline[j])], _tensors(copy)))
            with torch.no_grad():
                for t in _tensors(block):
                    if first_holder.get(id(t)) == j and id(t) in theirs:
                        t.copy_(theirs[id(t)])
        if directory is None:
            return
        local = block.state_dict(keep_vars=True)
        names = {key: aliases.get(id(t), [_user_key(key)]) for key, t in local.items()}
        found = read_tensors(directory, {n for ns in names.values() for n in ns})
        with torch.no_grad():
            for key, candidates in names.items():
                hit = next((found[n] for n in candidates if n in found), None)
                if hit is not None:
                    local[key].copy_(hit)

    return init


def _tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]


def _seeded_fresh(seeded: Callable[[int], Any], index: int, fresh: Callable[[nn.Module], None], block: nn.Module) -> None:
    with seeded(index):
        fresh(block)


def release_others(pipeline: TracedPipeline, held: Iterable[nn.Module]) -> None:
    """Keep only the shapes (meta tensors) of the model's parts this rank does not hold: its
    forward still reaches them, its last block computes on them on the meta device."""
    keep = {id(t) for block in held for t in [*block.parameters(), *block.buffers()]}
    made: dict[int, Any] = {}
    for module in pipeline.original.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or id(t) in keep or t.is_meta:
                    continue
                if id(t) not in made:
                    meta = torch.empty_like(t, device="meta")
                    made[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
                table[name] = made[id(t)]


class ZerosForMeta(TorchFunctionMode):
    """Runs a model created empty (meta tensors): every operation on a meta tensor gets zeros of its
    shape on the data's device instead. The trace needs real values: a model's forward branches on
    data (Hugging Face's masks call `.all()`) and mixes its weights with the batch; zeros made per
    operation cost no more memory than the operation's own output."""

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        self.device = next((t.device for t in leaves if not t.is_meta), self.device)
        if not any(t.is_meta for t in leaves):
            return func(*args, **kwargs)
        if func is Tensor.device.__get__:  # code placing new tensors "on the model's device": the data's
            return self.device
        if getattr(func, "__name__", "") == "__get__":  # shape, dtype ...: the meta tensor's own
            return func(*args, **kwargs)
        real = pytree.tree_map_only(
            Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device) if t.is_meta else t, (args, kwargs)
        )
        real_args, real_kwargs = real
        return func(*real_args, **real_kwargs)
