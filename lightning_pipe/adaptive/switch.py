"""The live switch (AutoPipe-RL §4.4): move blocks between pipeline ranks while training.

At an iteration boundary every rank of the pipeline calls `switch_blocks` with the same old and new
bounds. Each block whose owner changes travels from its old rank to its new one with everything
training needs to continue exactly: its parameters and buffers, each parameter's optimizer state
(and its param group), a gradient being accumulated, and what the caller adds per parameter (2BW's
stashed weight version). Per pair of ranks one pickled header (names, shapes, dtypes) and one flat
buffer per dtype cross (the paper's "aggregate into one large tensor" for few, large messages).

A rank that receives a block it never held builds it from a *skeleton*: a meta-device copy of the
block taken when the model was cut, so no rank keeps weights it does not own. Weights shared by
blocks (a tied embedding and LM head) are re-tied by name afterwards (`TieGroup`): two blocks that
now live on one rank share one Parameter again, and the optimizer steps it once.

Nothing here knows Lightning; the strategy rebuilds its gradient groups and schedule afterwards.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..runtime.tied import TieGroup

Bounds = tuple[tuple[int, int], ...]


def skeleton(block: nn.Module) -> nn.Module:
    """A copy of `block` on the meta device: its structure, no storage; `block` is untouched (its
    tensors may be shared with other blocks)."""
    memo: dict[int, Any] = {}
    for _, p in block.named_parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for _, b in block.named_buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(block, memo)


def owners(bounds: Bounds, chunk_rank: Sequence[int]) -> dict[int, int]:
    """block -> the pipeline rank holding it."""
    return {b: chunk_rank[c] for c, (start, stop) in enumerate(bounds) for b in range(start, stop)}


def check_bounds(bounds: Any, num_blocks: int, chunk_rank: Sequence[int]) -> Bounds:
    """Contiguous, in order, covering every block, every chunk (so every worker) at least one block."""
    try:
        out = tuple((int(a), int(b)) for a, b in bounds)
    except (TypeError, ValueError):
        raise ValueError(f"a partition is a list of [start, stop) block ranges, one per model chunk; got {bounds!r}") from None
    if len(out) != len(chunk_rank):
        raise ValueError(f"partition {[list(b) for b in out]} has {len(out)} chunks; this schedule runs {len(chunk_rank)}")
    empty = [c for c, (a, b) in enumerate(out) if b <= a]
    if empty:
        ranks = sorted({chunk_rank[c] for c in empty})
        raise ValueError(
            f"partition {[list(b) for b in out]} would leave model chunk(s) {empty} (on worker(s) {ranks}) with no block: "
            "every worker keeps at least one block of each of its chunks"
        )
    if out[0][0] != 0 or out[-1][1] != num_blocks or any(out[c][1] != out[c + 1][0] for c in range(len(out) - 1)):
        raise ValueError(f"partition {[list(b) for b in out]} must cover blocks 0..{num_blocks} contiguously, in order")
    return out


@dataclass
class Move:
    src: int
    dst: int
    blocks: list[int]


def plan_moves(old: Bounds, new: Bounds, chunk_rank: Sequence[int]) -> list[Move]:
    """The blocks changing owner, grouped by (from, to) and in one global order every rank follows
    (blocking transfers in the same order cannot deadlock)."""
    before, after = owners(old, chunk_rank), owners(new, chunk_rank)
    pairs: dict[tuple[int, int], list[int]] = {}
    for b in sorted(before):
        if before[b] != after[b]:
            pairs.setdefault((before[b], after[b]), []).append(b)
    return [Move(s, d, blocks) for (s, d), blocks in sorted(pairs.items())]


@dataclass
class SwitchResult:
    moved_blocks: list[int] = field(default_factory=list)
    sent_bytes: int = 0
    received_bytes: int = 0
    seconds: float = 0.0
    received_extras: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # id(parameter) -> caller's entries


def _homes(optimizers: Sequence[Any]) -> dict[int, tuple[int, int]]:
    """id(parameter) -> (optimizer, param group) holding it."""
    return {id(p): (o, g) for o, opt in enumerate(optimizers) for g, group in enumerate(opt.param_groups) for p in group["params"]}


def _tensors(block: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameters and buffers, persistent or not (a skeleton's storage is garbage until filled)."""
    named = list(block.named_parameters(remove_duplicate=False)) + list(block.named_buffers(remove_duplicate=False))
    return [(n, t) for n, t in named if t is not None]


def _pack(items: list[tuple[str, Tensor]], device: torch.device) -> tuple[list[tuple], list[Tensor]]:
    """Header entries (key, shape, dtype, on_cpu) and one flat buffer per dtype, on `device`."""
    header, flat = [], {}
    for key, t in items:
        header.append((key, tuple(t.shape), str(t.dtype), t.device.type == "cpu"))
        flat.setdefault(t.dtype, []).append(t.detach().reshape(-1).to(device))
    dtypes = sorted(flat, key=str)
    return header, [torch.cat(flat[d]) if flat[d] else torch.empty(0, dtype=d, device=device) for d in dtypes]


def _unpack(header: list[tuple], buffers: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    offsets = {d: 0 for d in buffers}
    out = {}
    for key, shape, dtype, on_cpu in header:
        n = 1
        for s in shape:
            n *= s
        flat = buffers[dtype]
        t = flat[offsets[dtype] : offsets[dtype] + n].view(shape).clone()
        offsets[dtype] += n
        out[key] = t.cpu() if on_cpu else t.to(device)
    return out


def _send(payload: dict[str, Any], items: list[tuple[str, Tensor]], dst: int, device: torch.device) -> int:
    header, flat = _pack(items, device)
    box = [dict(payload, header=header, dtypes=[str(t.dtype) for t in flat], sizes=[t.numel() for t in flat])]
    dist.send_object_list(box, dst, device=device if device.type == "cuda" else None)
    for t in flat:
        dist.send(t, dst)
    return sum(t.numel() * t.element_size() for t in flat)


def _recv(src: int, device: torch.device) -> tuple[dict[str, Any], dict[str, Tensor], int]:
    box = [None]
    dist.recv_object_list(box, src, device=device if device.type == "cuda" else None)
    payload = box[0]
    buffers = {}
    for dtype, size in zip(payload["dtypes"], payload["sizes"]):
        t = torch.empty(size, dtype=getattr(torch, dtype.replace("torch.", "")), device=device)
        dist.recv(t, src)
        buffers[dtype] = t
    return payload, _unpack(payload["header"], buffers, device), sum(t.numel() * t.element_size() for t in buffers.values())


def switch_blocks(
    blocks: dict[int, nn.Module],
    skeletons: dict[int, nn.Module],
    old: Bounds,
    new: Bounds,
    chunk_rank: Sequence[int],
    me: int,
    to_global: Callable[[int], int],
    optimizers: Sequence[Any],
    ties: list[TieGroup],
    device: torch.device,
    extras: Optional[Callable[[nn.Parameter], dict[str, Tensor]]] = None,
) -> SwitchResult:
    """Move the blocks whose owner differs between `old` and `new`; edit `blocks` (this rank's,
    by index), `skeletons` and the `optimizers` in place. `extras(p)`: more per-parameter tensors to
    carry (returned by id of the receiving parameter in `received_extras`)."""
    started = time.perf_counter()
    result = SwitchResult()
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    for move in plan_moves(old, new, chunk_rank):
        result.moved_blocks += move.blocks
        if me == move.src:
            result.sent_bytes += _give(blocks, skeletons, move, to_global(move.dst), optimizers, device, extras)
        elif me == move.dst:
            result.received_bytes += _take(blocks, skeletons, move, to_global(move.src), optimizers, ties, device, result)
    _retie(blocks, ties, optimizers)
    result.seconds = time.perf_counter() - started
    return result


def _give(blocks, skeletons, move: Move, dst: int, optimizers, device, extras) -> int:
    items: list[tuple[str, Tensor]] = []
    groups: dict[str, tuple[int, int]] = {}
    plain: dict[str, dict[str, Any]] = {}  # optimizer state entries that are not tensors (None, numbers)
    seen: set[int] = set()
    homes = _homes(optimizers)
    for b in move.blocks:
        block = blocks[b]
        items += [(f"{b}.{name}", t.detach()) for name, t in _tensors(block)]
        for name, p in block.named_parameters(remove_duplicate=False):
            if id(p) in seen:  # shared inside the move: sent once, re-tied on arrival
                continue
            seen.add(id(p))
            key = f"{b}.{name}"
            if id(p) in homes:  # its group and optimizer state
                groups[key] = homes[id(p)]
                state = optimizers[homes[id(p)][0]].state.get(p, {})
                items += [(f"{key}\0state\0{k}", v) for k, v in state.items() if isinstance(v, Tensor)]
                plain[key] = {k: v for k, v in state.items() if not isinstance(v, Tensor)}
            if p.grad is not None:  # a gradient being accumulated
                items.append((f"{key}\0grad", p.grad))
            for k, v in (extras(p) if extras is not None else {}).items():
                items.append((f"{key}\0extra\0{k}", v))
    sent = _send({"blocks": move.blocks, "groups": groups, "plain": plain}, items, dst, device)
    kept = {id(p) for i, blk in blocks.items() if i not in move.blocks for p in blk.parameters()}
    for b in move.blocks:
        block = blocks.pop(b)
        skeletons[b] = skeleton(block)
        for p in block.parameters():
            if id(p) in kept:  # still held through a tie with a block that stays
                continue
            for opt in optimizers:
                for group in opt.param_groups:
                    group["params"] = [q for q in group["params"] if q is not p]
                opt.state.pop(p, None)
    return sent


def _take(blocks, skeletons, move: Move, src: int, optimizers, ties, device, result: SwitchResult) -> int:
    payload, tensors, received = _recv(src, device)
    new_params: list[tuple[str, nn.Parameter]] = []
    for b in payload["blocks"]:
        block = skeletons.pop(b).to_empty(device=device)
        for name, current in _tensors(block):
            value = tensors[f"{b}.{name}"]  # the sender's dtype and values (a precision plugin may have cast it)
            if isinstance(current, nn.Parameter):
                current.data = value
            else:
                owner, _, leaf = name.rpartition(".")
                (block.get_submodule(owner) if owner else block)._buffers[leaf] = value
        for name, p in block.named_parameters(remove_duplicate=True):
            new_params.append((f"{b}.{name}", p))
        blocks[b] = block
    # a received parameter tied to one this rank already holds is that one: no second optimizer entry
    held_alias = _tie_targets(blocks, ties, exclude=set(payload["blocks"]))
    for key, p in new_params:
        grad = tensors.get(f"{key}\0grad")
        if grad is not None:
            p.grad = grad
        extra = {k.split("\0", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{key}\0extra\0")}
        if extra:
            result.received_extras[id(p)] = extra
        if key in held_alias or key not in payload["groups"]:
            continue
        o, g = payload["groups"][key]
        opt = optimizers[o]
        opt.param_groups[g]["params"].append(p)
        prefix = f"{key}\0state\0"
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        state.update(payload["plain"].get(key, {}))
        if state:
            opt.state[p] = state
    return received


def _tie_targets(blocks: dict[int, nn.Module], ties: list[TieGroup], exclude: set[int]) -> set[str]:
    """Names ("block.param") of received parameters that a tie makes one already held here."""
    out = set()
    for group in ties:
        if any(b in blocks and b not in exclude for b, _ in group):
            out.update(f"{b}.{n}" for b, n in group if b in exclude)
    return out


def _retie(blocks: dict[int, nn.Module], ties: list[TieGroup], optimizers: Sequence[Any]) -> None:
    """Blocks of one tie group on this rank share one Parameter: the first in optimizer (else module) order."""
    in_optimizer = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    for group in ties:
        here = [(b, n) for b, n in group if b in blocks]
        if len(here) < 2:
            continue
        params = [blocks[b].get_parameter(n) for b, n in here]
        keep = next((p for p in params if id(p) in in_optimizer), params[0])
        for (b, n), p in zip(here, params):
            if p is not keep:
                owner, _, leaf = n.rpartition(".")
                setattr(blocks[b].get_submodule(owner) if owner else blocks[b], leaf, keep)
