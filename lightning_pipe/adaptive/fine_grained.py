"""Fine-grained state switching (AutoPipe-RL §4.4): move blocks while the next iteration runs.

The paper keeps the pipeline running through a switch: only the two workers whose tasks change are
involved, the moved layers travel layer by layer and the new worker computes a layer as soon as it
has arrived (PipeSwitch's pipelined switching), and the weights of the *later* active work are
migrated first while earlier work finishes where it is. In a flush pipeline (one weight version per
iteration) that becomes one *transition iteration*:

- micro-batches 0..k-1 run the moved blocks on their old worker, k..M-1 on the new one;
- the blocks' weights stream to the new worker block by block, in the order it runs them, from the
  iteration's start; it waits for a block only when its first micro-batch reaches that block;
- their optimizer state follows (the optimizer step at the iteration's end is its first use);
- the old worker's partial gradients (micro-batches < k) leave as soon as its backward of those
  micro-batches is done; the new worker adds them before its REDUCE, so the step sees the whole
  batch's gradient, as in one process.

The stop-and-move switch (`switch.switch_blocks`, at the iteration boundary) stays for what this
does not cover (several chunks per rank, tied blocks, layers with per-parameter state to carry).
Nothing here knows Lightning. The transfers use their own process group, so they never queue
behind (or match) the schedule's messages between the same two ranks.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..runtime.tied import TieGroup
from .switch import Bounds, Move, _homes, _pack, _tensors, _unpack, plan_moves, skeleton


def fine_grained_move(old: Bounds, new: Bounds, chunk_rank: Sequence[int], ties: list[TieGroup]) -> tuple[Optional[Move], str]:
    """The one move a fine-grained switch makes, or None and why the switch must stop the pipeline."""
    if len(set(chunk_rank)) != len(chunk_rank):
        return None, "several chunks per rank"
    moves = plan_moves(old, new, chunk_rank)
    if len(moves) != 1:
        return None, f"{len(moves)} pairs of workers change blocks (the paper's switch involves two)"
    move = moves[0]  # one chunk per rank, contiguous bounds: the two workers are neighbours
    if any(b in move.blocks for group in ties for b, _ in group):
        return None, "a moved block shares a tied weight"
    return move, ""


def _params(blocks: dict[int, nn.Module], move: Move) -> list[tuple[str, nn.Parameter]]:
    return [(f"{b}.{n}", p) for b in move.blocks for n, p in blocks[b].named_parameters()]


def _isend(tensors: list[Tensor], peer: int, group: Any) -> list[Any]:
    return [dist.isend(t, peer, group=group) for t in tensors]


def _irecv(buffers: list[Tensor], peer: int, group: Any) -> list[Any]:
    return [dist.irecv(t, peer, group=group) for t in buffers]


def _buffers(dtypes: list[str], sizes: list[int], device: torch.device) -> dict[str, Tensor]:
    return {d: torch.empty(n, dtype=getattr(torch, d.replace("torch.", "")), device=device) for d, n in zip(dtypes, sizes)}


def _grad_layout(params: list[tuple[str, nn.Parameter]]) -> tuple[list[str], list[int]]:
    """The dtypes and sizes of the flat gradient buffers (one per dtype, zeros where a gradient is None)."""
    sizes: dict[str, int] = {}
    for _, p in params:
        sizes[str(p.dtype)] = sizes.get(str(p.dtype), 0) + p.numel()
    dtypes = sorted(sizes)
    return dtypes, [sizes[d] for d in dtypes]


class Outgoing:
    """The old worker's side: stream the blocks out, send the partial gradients after micro-batch
    k-1's backward, and drop the blocks once the iteration is done."""

    def __init__(
        self, blocks: dict[int, nn.Module], move: Move, peer: int, optimizers: Sequence[Any], early: int, device: torch.device, group: Any
    ):
        self.blocks, self.move, self.peer, self.group, self.device = blocks, move, peer, group, device
        self.optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        self.early, self.done, self.sent_bytes = early, 0, 0
        self._grads: Optional[tuple[Tensor, list[Tensor]]] = None  # the partial gradients, once sent
        self.params = _params(blocks, move)
        homes = _homes(self.optimizers)
        state_items, groups, plain = [], {}, {}
        for key, p in self.params:
            if id(p) in homes:
                groups[key] = homes[id(p)]
                state = self.optimizers[homes[id(p)][0]].state.get(p, {})
                state_items += [(f"{key}\0{k}", v) for k, v in state.items() if isinstance(v, Tensor)]
                plain[key] = {k: v for k, v in state.items() if not isinstance(v, Tensor)}
        packs = [_pack([(f"{b}.{n}", t) for n, t in _tensors(blocks[b])], device) for b in move.blocks]
        state_header, state_flat = _pack(state_items, device)
        header = {
            "blocks": {b: (h, [str(t.dtype) for t in flat], [t.numel() for t in flat]) for b, (h, flat) in zip(move.blocks, packs)},
            "state": (state_header, [str(t.dtype) for t in state_flat], [t.numel() for t in state_flat]),
            "groups": groups,
            "plain": plain,
            "early": early,
        }
        dist.send_object_list([header], peer, group=group, device=device if device.type == "cuda" else None)
        self.works = []
        for _, flat in packs:  # block by block, in the order the new worker runs them
            self.works += _isend(flat, peer, group)
            self.sent_bytes += sum(t.numel() * t.element_size() for t in flat)
        self.works += _isend(state_flat, peer, group)
        self.sent_bytes += sum(t.numel() * t.element_size() for t in state_flat)
        self._kept = packs, state_flat  # a send's tensor must live until it completes

    def backward_done(self, microbatch: int, count: int) -> None:
        """After this rank's weight gradients of `microbatch` (of `count` in the batch) are accumulated."""
        if microbatch < self.early:
            self.done += 1
            if self.done == min(self.early, count):  # a short batch: all its micro-batches are early ones
                self._send_gradients()

    def _send_gradients(self) -> None:
        present = torch.tensor([p.grad is not None for _, p in self.params], dtype=torch.uint8, device=self.device)
        dtypes, _ = _grad_layout(self.params)
        flat = [
            torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for _, p in self.params if str(p.dtype) == d]
            )
            for d in dtypes
        ]
        self.works += _isend([present, *flat], self.peer, self.group)
        self.sent_bytes += sum(t.numel() * t.element_size() for t in flat)
        self._grads = present, flat

    def finish(self, skeletons: dict[int, nn.Module]) -> int:
        """After the iteration's backward: every send done; the blocks and their optimizer entries leave."""
        if self.early and self._grads is None:
            raise RuntimeError(f"fine-grained switch: only {self.done} of the {self.early} early micro-batches ran their backward here")
        for work in self.works:
            work.wait()
        moved = {id(p) for _, p in self.params}
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["params"] = [q for q in group["params"] if id(q) not in moved]
            for _, p in self.params:
                opt.state.pop(p, None)
        for b in self.move.blocks:
            skeletons[b] = skeleton(self.blocks.pop(b))
        return self.sent_bytes


class Incoming:
    """The new worker's side: the blocks exist from the iteration's start (empty), each filled when
    its weights have arrived; the partial gradients are added before the REDUCE; the optimizer
    entries at the end."""

    def __init__(
        self, blocks: dict[int, nn.Module], skeletons: dict[int, nn.Module], move: Move, peer: int, device: torch.device, group: Any
    ):
        self.move, self.peer, self.group, self.device = move, peer, group, device
        box: list[Any] = [None]
        dist.recv_object_list(box, peer, group=group, device=device if device.type == "cuda" else None)
        self.header = header = box[0]
        self.early = header["early"]
        self.arriving: dict[int, tuple[list[Any], dict[str, Tensor]]] = {}
        for b in move.blocks:
            blocks[b] = skeletons.pop(b).to_empty(device=device)
            _, dtypes, sizes = header["blocks"][b]
            buffers = _buffers(dtypes, sizes, device)
            self.arriving[b] = (_irecv([buffers[d] for d in dtypes], peer, group), buffers)
        _, dtypes, sizes = header["state"]
        self.state_buffers = _buffers(dtypes, sizes, device)
        self.state_works = _irecv([self.state_buffers[d] for d in dtypes], peer, group)
        self.blocks = blocks
        self.params = _params(blocks, move)
        self.grad_works: list[Any] = []
        if self.early:
            gdtypes, gsizes = _grad_layout(self.params)
            self.present = torch.empty(len(self.params), dtype=torch.uint8, device=device)
            self.grad_buffers = _buffers(gdtypes, gsizes, device)
            self.grad_works = _irecv([self.present, *(self.grad_buffers[d] for d in gdtypes)], peer, group)
        self.waited = 0.0  # seconds this rank's compute waited for the transfers

    def _wait(self, works: list[Any]) -> None:
        started = time.perf_counter()
        for work in works:
            work.wait()
        self.waited += time.perf_counter() - started

    def fill(self, b: int) -> None:
        """Before block `b` first runs here: wait for its weights (only its own) and put them in."""
        if b not in self.arriving:
            return
        works, buffers = self.arriving.pop(b)
        self._wait(works)
        block = self.blocks[b]
        values = _unpack(self.header["blocks"][b][0], buffers, self.device)
        for name, current in _tensors(block):
            value = values[f"{b}.{name}"]
            if isinstance(current, nn.Parameter):
                current.data = value
            else:
                owner, _, leaf = name.rpartition(".")
                (block.get_submodule(owner) if owner else block)._buffers[leaf] = value

    def add_partial(self) -> None:
        """Before the REDUCE of the chunk holding the moved blocks: the old worker's gradients of
        micro-batches < k join this rank's of micro-batches >= k."""
        for b in list(self.arriving):  # k = M: the blocks never ran here this iteration
            self.fill(b)
        if not self.early or not self.grad_works:
            return
        self._wait(self.grad_works)
        self.grad_works = []
        offsets = dict.fromkeys(self.grad_buffers, 0)
        for (_, p), present in zip(self.params, self.present.tolist()):
            d = str(p.dtype)
            part = self.grad_buffers[d][offsets[d] : offsets[d] + p.numel()].view_as(p)
            offsets[d] += p.numel()
            if present:
                p.grad = part.clone() if p.grad is None else p.grad + part

    def finish(self, optimizers: Sequence[Any]) -> None:
        """After the iteration's backward: the moved parameters join the optimizers, with their state."""
        self.add_partial()
        self._wait(self.state_works)
        optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        state = _unpack(self.header["state"][0], self.state_buffers, self.device)
        for key, p in self.params:
            if key not in self.header["groups"]:
                continue
            o, g = self.header["groups"][key]
            optimizers[o].param_groups[g]["params"].append(p)
            entries = {k.split("\0", 1)[1]: v for k, v in state.items() if k.startswith(f"{key}\0")}
            entries.update(self.header["plain"].get(key, {}))
            if entries:
                optimizers[o].state[p] = entries


def early_microbatches(moved_bytes: float, bandwidth: float, forward_s: float, microbatches: int) -> int:
    """k: the micro-batches the old worker keeps, those the new worker would reach before the
    weights have arrived (at least 1: the paper's earlier work finishes where it is)."""
    if forward_s <= 0 or bandwidth <= 0:
        return min(1, microbatches)
    return max(1, min(microbatches, int(-(-moved_bytes / bandwidth // forward_s))))
