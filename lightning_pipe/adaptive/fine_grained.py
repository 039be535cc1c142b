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
from .switch import Bounds, Move, _homes, plan_moves, skeleton


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


def keeps_running_statistics(block: nn.Module) -> bool:
    """Whether a forward updates the block's buffers (BatchNorm's running statistics): micro-batches on
    two workers would update two copies, where one process updates one in micro-batch order."""
    norms = (nn.modules.batchnorm._NormBase,)
    return any(isinstance(m, norms) and m.track_running_stats for m in block.modules())


def _params(blocks: dict[int, nn.Module], move: Move) -> list[tuple[str, nn.Parameter]]:
    return [(f"{b}.{n}", p) for b in move.blocks for n, p in blocks[b].named_parameters()]


def _block_tensors(block: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameters, then buffers, each once (a skeleton lists them in the same order)."""
    return [(n, t) for n, t in [*block.named_parameters(), *block.named_buffers()] if t is not None]


def _spec(t: Tensor) -> tuple:
    return tuple(t.shape), str(t.dtype), t.device.type == "cpu"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


class Outgoing:
    """The old worker's side: stream the blocks out, send the partial gradients after micro-batch
    k-1's backward, and drop the blocks once the iteration is done. Tensors go as they are (no
    packing copy on the critical path): none of them changes before `finish` waits for the sends."""

    def __init__(
        self, blocks: dict[int, nn.Module], move: Move, peer: int, optimizers: Sequence[Any], early: int, device: torch.device, group: Any
    ):
        self.blocks, self.move, self.peer, self.group, self.device = blocks, move, peer, group, device
        self.optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        self.early, self.done, self.sent_bytes = early, 0, 0
        self.params = _params(blocks, move)
        self._grads: Optional[list[Tensor]] = None  # the partial gradients, once sent
        homes = _homes(self.optimizers)
        state: list[tuple[str, str, Tensor]] = []
        groups, plain = {}, {}
        for key, p in self.params:
            if id(p) in homes:
                groups[key] = homes[id(p)]
                entries = self.optimizers[homes[id(p)][0]].state.get(p, {})
                state += [(key, k, v) for k, v in entries.items() if isinstance(v, Tensor)]
                plain[key] = {k: v for k, v in entries.items() if not isinstance(v, Tensor)}
        tensors = {b: _block_tensors(blocks[b]) for b in move.blocks}
        header = {
            "blocks": {b: [(n, *_spec(t)) for n, t in items] for b, items in tensors.items()},
            "state": [(key, k, *_spec(v)) for key, k, v in state],
            "groups": groups,
            "plain": plain,
            "early": early,
        }
        dist.send_object_list([header], peer, group=group, device=device if device.type == "cuda" else None)
        self.works: list[Any] = []
        self._kept: list[Tensor] = []  # a send's tensor must live until it completes
        for b in move.blocks:  # block by block, in the order the new worker runs them
            self._send([t for _, t in tensors[b]])
        self._send([v for _, _, v in state])

    def _send(self, tensors: list[Tensor]) -> None:
        for t in tensors:
            t = t.detach().to(self.device).contiguous()
            self._kept.append(t)
            self.works.append(dist.isend(t, self.peer, group=self.group))
            self.sent_bytes += t.numel() * t.element_size()

    def backward_done(self, microbatch: int, count: int) -> None:
        """After this rank's weight gradients of `microbatch` (of `count` in the batch) are accumulated."""
        if microbatch < self.early:
            self.done += 1
            if self.done == min(self.early, count):  # a short batch: all its micro-batches are early ones
                present = torch.tensor([p.grad is not None for _, p in self.params], dtype=torch.uint8, device=self.device)
                self._grads = [present] + [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.params]
                self._send(self._grads)
                self.sent_bytes -= present.numel()

    def finish(self, skeletons: dict[int, nn.Module]) -> int:
        """After the iteration's backward: every send done; the blocks and their optimizer entries leave."""
        if self.early and self._grads is None:
            raise RuntimeError(f"fine-grained switch: only {self.done} of the {self.early} early micro-batches ran their backward here")
        for work in self.works:
            work.wait()
        self._kept = []
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
    """The new worker's side: the blocks exist from the iteration's start (empty) and receive straight
    into their own tensors; a block is waited for when it first runs here; the partial gradients are
    added before the REDUCE; the optimizer entries at the end."""

    def __init__(
        self, blocks: dict[int, nn.Module], skeletons: dict[int, nn.Module], move: Move, peer: int, device: torch.device, group: Any
    ):
        self.move, self.peer, self.group, self.device = move, peer, group, device
        box: list[Any] = [None]
        dist.recv_object_list(box, peer, group=group, device=device if device.type == "cuda" else None)
        self.header = header = box[0]
        self.early = header["early"]
        self.arriving: dict[int, list[Any]] = {}
        for b in move.blocks:
            block = blocks[b] = skeletons.pop(b).to_empty(device=device)
            targets = []
            for (name, current), (_, shape, dtype, _) in zip(_block_tensors(block), header["blocks"][b]):
                if current.dtype != _dtype(dtype):  # the sender's dtype (a precision plugin may have cast it)
                    fresh = torch.empty(shape, dtype=_dtype(dtype), device=device)
                    if isinstance(current, nn.Parameter):
                        current.data = fresh
                    else:
                        owner, _, leaf = name.rpartition(".")
                        (block.get_submodule(owner) if owner else block)._buffers[leaf] = current = fresh
                targets.append(current.detach())
            self.arriving[b] = self._recv(targets)
        self.state = [torch.empty(shape, dtype=_dtype(dtype), device=device) for _, _, shape, dtype, _ in header["state"]]
        self.state_works = self._recv(self.state)
        self.blocks = blocks
        self.params = _params(blocks, move)
        self.grads: list[Tensor] = []
        self.grad_works: list[Any] = []
        if self.early:
            self.grads = [torch.empty(len(self.params), dtype=torch.uint8, device=device)] + [torch.empty_like(p) for _, p in self.params]
            self.grad_works = self._recv(self.grads)
        self.waited = 0.0  # seconds this rank's compute waited for the transfers

    def _recv(self, tensors: list[Tensor]) -> list[Any]:
        return [dist.irecv(t, self.peer, group=self.group) for t in tensors]

    def _wait(self, works: list[Any]) -> None:
        started = time.perf_counter()
        for work in works:
            work.wait()
        self.waited += time.perf_counter() - started

    def fill(self, b: int) -> None:
        """Before block `b` first runs here: wait for its weights (only its own)."""
        works = self.arriving.pop(b, None)
        if works is not None:
            self._wait(works)

    def add_partial(self) -> None:
        """Before the REDUCE of the chunk holding the moved blocks: the old worker's gradients of
        micro-batches < k join this rank's of micro-batches >= k."""
        for b in list(self.arriving):  # k = M: the blocks never ran here this iteration
            self.fill(b)
        if not self.grad_works:
            return
        self._wait(self.grad_works)
        self.grad_works = []
        present, parts = self.grads[0].tolist(), self.grads[1:]
        for (_, p), part, there in zip(self.params, parts, present):
            if there:
                p.grad = part if p.grad is None else p.grad + part
        self.grads = []

    def finish(self, optimizers: Sequence[Any]) -> None:
        """After the iteration's backward: the moved parameters join the optimizers, with their state."""
        self.add_partial()
        self._wait(self.state_works)
        optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        entries: dict[str, dict[str, Any]] = {}
        for (key, name, _, _, on_cpu), value in zip(self.header["state"], self.state):
            entries.setdefault(key, {})[name] = value.cpu() if on_cpu else value
        for key, p in self.params:
            if key not in self.header["groups"]:
                continue
            o, g = self.header["groups"][key]
            optimizers[o].param_groups[g]["params"].append(p)
            state = dict(entries.get(key, {}), **self.header["plain"].get(key, {}))
            if state:
                optimizers[o].state[p] = state


def early_microbatches(moved_bytes: float, bandwidth: float, forward_s: float, microbatches: int) -> int:
    """k: the micro-batches the old worker keeps, those the new worker would reach before the
    weights have arrived (at least 1: the paper's earlier work finishes where it is)."""
    if forward_s <= 0 or bandwidth <= 0:
        return min(1, microbatches)
    return max(1, min(microbatches, int(-(-moved_bytes / bandwidth // forward_s))))
