"""Run one rank's action list with real tensors.

The executor is an interpreter over the action language; what a forward *means* (which blocks,
how the loss is computed, which hooks run) is the `StageHost`'s business, so the same executor
serves plain PyTorch (tests, benchmarks) and the Lightning strategy.

- A RECV action posts the receive; the compute that consumes the data waits for it. With
  `prefetch`, the next receive is posted before each compute (Hanayo §4.2), so data moves while
  this rank computes. Receives are always posted in list order, which the validator has checked
  against the peers' send order.
- Adjacent sends and receives are issued as one group (`batch_isend_irecv` on NCCL), so two
  neighbours exchanging at once cannot deadlock.
- Each chunk's boundary is a fresh leaf tensor: backward stops there and the input gradient is
  handed to the previous chunk explicitly, by message or locally when it lives on this rank.
"""

from __future__ import annotations

import time
from typing import Any, Hashable, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ..schedules.actions import Op, PipelineSchedule
from .p2p import Activation, PendingRecv, Transport


class StageHost(Protocol):
    def forward(self, chunk: int, microbatch: int, inputs: Optional[Activation]) -> Any:
        """Run `chunk` on micro-batch `microbatch`. Chunk 0 gets ``inputs=None`` and reads its own
        micro-batch. The last chunk returns the (weighted, possibly scaled) loss to backpropagate,
        or None in a forward-only schedule; other chunks return their output activation."""

    def reduce_gradients(self, chunk: int) -> None:
        """The gradients of `chunk` are final for this step."""


def _as_tuple(value: Activation) -> tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _needs_grad(value: Activation) -> list[Tensor]:
    return [t for t in _as_tuple(value) if t.requires_grad]


def _local_leaf(value: Activation) -> Activation:
    leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in _as_tuple(value))
    return leaves if isinstance(value, tuple) else leaves[0]


class Executor:
    def __init__(self, schedule: PipelineSchedule, rank: int, transport: Transport, prefetch: bool = True, trace: bool = False):
        self.schedule, self.rank, self.transport, self.prefetch = schedule, rank, transport, prefetch
        self.actions = schedule.actions[rank]
        self.last_chunk = schedule.num_chunks - 1
        # trace: (action index, start, end) of each compute and send of the last run, perf_counter
        # seconds. A compute starts once its input is taken (the wait for a receive is idle time,
        # not compute); on CUDA the device is synchronised around each compute, which costs overlap.
        self.trace = trace
        self.records: list[tuple[int, float, float]] = []

    def run(self, host: StageHost, keys: Sequence[Hashable]) -> None:
        """Execute the action list once. ``keys[i]`` is micro-batch i's signature (see p2p)."""
        actions, transport = self.actions, self.transport
        stash_in: dict[tuple[int, int], Optional[Activation]] = {}
        stash_out: dict[tuple[int, int], Any] = {}
        outbox: dict[tuple[str, int, int], Any] = {}  # produced, waiting for its SEND action
        local: dict[tuple[str, int, int], Any] = {}  # hand-over between chunks on this rank
        inbox: dict[tuple[Op, int, int], PendingRecv] = {}  # posted receives by (op, chunk, mb)
        send_works: list = []
        posted = [False] * len(actions)
        next_recv = 0  # first receive index not yet posted (receives are posted in list order)

        def issue(ops: list, pendings: list[tuple[PendingRecv, int, int]]) -> None:
            works = transport.issue(ops)
            if len(works) == len(ops):  # one work per op: each receive waits for its own ops only
                taken = set()
                for pending, lo, hi in pendings:
                    pending.works = works[lo:hi]
                    taken.update(range(lo, hi))
                send_works.extend(w for k, w in enumerate(works) if k not in taken)
            else:  # coalesced (NCCL group): one work stands for the whole group
                for pending, _, _ in pendings:
                    pending.works = list(works)
                send_works.extend(works)

        def post(index: int, ops: list, pendings: list) -> None:
            nonlocal next_recv
            a = actions[index]
            if a.op is Op.RECV_ACT:
                pending, recv_ops = transport.recv_activation(a.peer, a.chunk, keys[a.microbatch])
            else:
                pending, recv_ops = transport.recv_gradients(a.peer, _needs_grad(stash_out[(a.chunk, a.microbatch)]))
            pendings.append((pending, len(ops), len(ops) + len(recv_ops)))
            ops += recv_ops
            inbox[(a.op, a.chunk, a.microbatch)] = pending
            posted[index] = True
            next_recv = index + 1
            while next_recv < len(actions) and not actions[next_recv].op.is_recv:
                next_recv += 1

        def prefetch() -> None:
            """Post the next receive early, unless it would block (header) or lacks its buffers yet."""
            j = next_recv
            if j >= len(actions) or posted[j]:
                return
            a = actions[j]
            if a.op is Op.RECV_ACT and transport.needs_header(a.peer, a.chunk, keys[a.microbatch]):
                return
            if a.op is Op.RECV_GRAD and (a.chunk, a.microbatch) not in stash_out:
                return
            ops: list = []
            pendings: list = []
            post(j, ops, pendings)
            issue(ops, pendings)

        def take(op: Op, chunk: int, mb: int) -> Any:
            """The activation (or gradients) a compute consumes, waiting if still in flight."""
            key = (op, chunk, mb)
            if key in local:
                return local.pop(key)
            pending = inbox.pop(key)
            return pending.activation() if op is Op.RECV_ACT else pending.value()

        while next_recv < len(actions) and not actions[next_recv].op.is_recv:
            next_recv += 1
        records = self.records = []
        sync = self.trace and transport.device.type == "cuda"

        def start_clock() -> float:
            # called once the compute's input is taken: waiting for it is not compute time
            if sync:
                torch.cuda.synchronize(transport.device)
            return time.perf_counter()

        i = 0
        while i < len(actions):
            a = actions[i]
            if a.op.is_send or a.op.is_recv:
                ops: list = []
                pendings: list = []
                first = i
                while i < len(actions) and (actions[i].op.is_send or actions[i].op.is_recv):
                    c = actions[i]
                    if c.op is Op.SEND_ACT:
                        ops += transport.send_activation(
                            c.peer, c.chunk, keys[c.microbatch], outbox.pop(("activation", c.chunk, c.microbatch))
                        )
                    elif c.op is Op.SEND_GRAD:
                        ops += transport.send_gradients(c.peer, outbox.pop(("gradient", c.chunk, c.microbatch)))
                    elif not posted[i]:
                        if c.op is Op.RECV_ACT and transport.needs_header(c.peer, c.chunk, keys[c.microbatch]):
                            # the header is read blocking: first issue what this group holds, or a
                            # peer waiting for one of these sends could never send the header
                            issue(ops, pendings)
                            ops, pendings = [], []
                        post(i, ops, pendings)
                    i += 1
                if self.trace:  # a send is issued (not completed) here: a point in time
                    now = time.perf_counter()
                    records.extend((j, now, now) for j in range(first, i) if actions[j].op.is_send)
                issue(ops, pendings)
                continue
            if a.op.is_compute and self.prefetch:
                prefetch()
            c, mb = a.chunk, a.microbatch
            if a.op is Op.FORWARD:
                inputs = take(Op.RECV_ACT, c, mb) if c > 0 else None
                if self.trace:
                    started = start_clock()
                with torch.set_grad_enabled(self.schedule.backward):
                    out = host.forward(c, mb, inputs)
                if self.schedule.backward:
                    stash_in[(c, mb)], stash_out[(c, mb)] = inputs, out
                if c < self.last_chunk:
                    if self.schedule.chunk_rank[c + 1] == self.rank:
                        local[(Op.RECV_ACT, c + 1, mb)] = _local_leaf(out)
                    else:
                        outbox[("activation", c, mb)] = out
            elif a.op is Op.BACKWARD:
                out, inputs = stash_out.pop((c, mb)), stash_in.pop((c, mb))
                received = take(Op.RECV_GRAD, c, mb) if c != self.last_chunk else None
                if self.trace:
                    started = start_clock()
                if c == self.last_chunk:
                    if out is not None and out.requires_grad:
                        torch.autograd.backward(out)
                else:
                    torch.autograd.backward(_needs_grad(out), received)
                if c > 0:
                    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in _needs_grad(inputs)]
                    if self.schedule.chunk_rank[c - 1] == self.rank:
                        local[(Op.RECV_GRAD, c - 1, mb)] = grads
                    else:
                        outbox[("gradient", c, mb)] = grads
            elif a.op is Op.REDUCE_GRAD:
                host.reduce_gradients(c)
            if self.trace and a.op.is_compute:
                if sync:
                    torch.cuda.synchronize(transport.device)
                records.append((i, started, time.perf_counter()))
            i += 1

        for work in send_works:
            work.wait()
        transport.release_headers()
