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
- A split backward (zero-bubble) runs BI, the input gradient only, and later W, the weight
  gradients (`split_backward`); the micro-batch's graph and activations live until its W.

`Executor.run` walks the list and dispatches each action to the handler of its op (`_handlers`);
what one run accumulates (stashes, posted receives, the group being built, trace records) lives
in a `_Run`, so nothing of a step outlives it — unless the schedule spans several runs
(PipeDream-2BW): then a `Carry` hands the stashes of micro-batches still in flight, and the sends
whose receive is in the peer's next run, from one run to the next.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ..schedules.actions import Action, Op, PipelineSchedule
from .p2p import Activation, PendingRecv, Transport
from .split_backward import Deferred, backward_input, backward_weight


class StageHost(Protocol):
    def forward(self, chunk: int, microbatch: int, inputs: Optional[Activation]) -> Any:
        """Run `chunk` on micro-batch `microbatch`. Chunk 0 gets ``inputs=None`` and reads its own
        micro-batch. The last chunk returns the (weighted, possibly scaled) loss to backpropagate,
        or None in a forward-only schedule; other chunks return their output activation."""

    def reduce_gradients(self, chunk: int) -> None:
        """The gradients of `chunk` are final for this step."""

    # optional: before_backward(chunk, last), before a backward (whole or W) of `chunk` runs; `last`: the
    # chunk's gradients are complete after it (a sharded stage reduces them once, in that one);
    # weight_gradients_done(chunk, microbatch), after a micro-batch's weight gradients of
    # `chunk` are accumulated (a fine-grained switch sends the old worker's partial gradients then);
    # idle(), before a compute waits for a receive still in flight (not while a meter measures the
    # waits): work of the host's own that would otherwise wait for the step's end;
    # backward_scope(chunk, microbatch), a context the whole backward runs in (2BW over FSDP2: the
    # micro-batch's weight version, which the backward gathers again)


def _as_tuple(value: Activation) -> tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _needs_grad(value: Activation) -> list[Tensor]:
    return [t for t in _as_tuple(value) if t.requires_grad]


def _local_leaf(value: Activation) -> Activation:
    leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in _as_tuple(value))
    return leaves if isinstance(value, tuple) else leaves[0]


class Carry:
    """What a schedule spanning several runs keeps between them: the inputs and outputs of
    micro-batches forwarded but not yet backwarded, and sends the peer receives in its next run
    (waited at the end of that run). Micro-batch i of a run is i - m in the next one."""

    def __init__(self) -> None:
        self.stash_in: dict[tuple[int, int], Optional[Activation]] = {}
        self.stash_out: dict[tuple[int, int], Any] = {}
        self.send_works: list = []

    @property
    def in_flight(self) -> int:
        return len(self.stash_out)

    def shift(self, microbatches: int) -> None:
        self.stash_in = {(c, mb - microbatches): v for (c, mb), v in self.stash_in.items()}
        self.stash_out = {(c, mb - microbatches): v for (c, mb), v in self.stash_out.items()}


class _Run:
    """State of one `Executor.run`, dropped when it returns (no tensor outlives the step but those
    a `Carry` takes on)."""

    def __init__(self, host: StageHost, keys: Sequence[Hashable], length: int, trace: bool, sync: bool, carry: Optional[Carry]):
        self.host, self.keys = host, keys
        self.stash_in: dict[tuple[int, int], Optional[Activation]] = carry.stash_in if carry is not None else {}
        self.stash_out: dict[tuple[int, int], Any] = carry.stash_out if carry is not None else {}
        self.outbox: dict[tuple[str, int, int], Any] = {}  # produced, waiting for its SEND action
        self.local: dict[tuple[Op, int, int], Any] = {}  # hand-over between chunks on this rank
        self.deferred: dict[tuple[int, int], Deferred] = {}  # (chunk, mb) -> what its W needs, after its BI
        self.inbox: dict[tuple[Op, int, int], PendingRecv] = {}  # posted receives by (op, chunk, mb)
        self.send_works: list = []
        self.crossing_works: list = []  # sends received in the peer's next run: not waited in this one
        self.posted = [False] * length
        self.next_recv = 0  # first receive index not yet posted (receives are posted in list order)
        # the p2p group being built: ops, and (receive, slice of ops) for each receive in it
        self.ops: list = []
        self.op_actions: list[int] = []  # the action index of each op in `ops`
        self.pendings: list[tuple[PendingRecv, int, int]] = []
        self.trace, self.sync = trace, sync
        self.records: list[tuple[int, float, float]] = []
        self.idle: Optional[Callable[[], None]] = getattr(host, "idle", None)
        self.backward_scope: Optional[Callable[[int, int], Any]] = getattr(host, "backward_scope", None)


class Executor:
    def __init__(self, schedule: PipelineSchedule, rank: int, transport: Transport, prefetch: bool = True, trace: bool = False):
        self.schedule, self.rank, self.transport, self.prefetch = schedule, rank, transport, prefetch
        self.actions = schedule.actions[rank]
        self.last_chunk = schedule.num_chunks - 1
        self.crossing = _crossing_sends(schedule, rank)
        weights = (Op.BACKWARD, Op.BACKWARD_WEIGHT)  # the actions that accumulate a chunk's weight gradients
        # the backwards after which a chunk's gradients are complete: the run's last of each chunk (a runner
        # spanning runs marks its own, e.g. 2BW each batch's last)
        self.gradients_complete = set({a.chunk: i for i, a in enumerate(self.actions) if a.op in weights}.values())
        # trace: (action index, start, end) of each compute and send of the last run, perf_counter
        # seconds. A compute starts once its input is taken (the wait for a receive is idle time,
        # not compute); on CUDA the device is synchronised around each compute, which costs overlap.
        self.trace = trace
        self.records: list[tuple[int, float, float]] = []
        # one handler per op (as DeepSpeed's pipe engine maps instructions to methods); a comm
        # handler only adds its ops to the group being built, `run` issues the group
        self._handlers: dict[Op, Callable[[_Run, int, Action], None]] = {
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.REDUCE_GRAD: self._reduce,
            Op.SEND_ACT: self._send_activation,
            Op.SEND_GRAD: self._send_gradients,
            Op.RECV_ACT: self._recv,
            Op.RECV_GRAD: self._recv,
        }

    @property
    def meter(self) -> Optional[Any]:
        """The adaptive monitor's per-step timings (adaptive.meter.StepMeter) while it measures, else None."""
        return getattr(self.transport, "meter", None)  # a stand-in transport (tests) may have none

    def run(self, host: StageHost, keys: Sequence[Hashable], carry: Optional[Carry] = None) -> None:
        """Execute the action list once. ``keys[i]`` is micro-batch i's signature (see p2p).
        With a `carry`, start from its stashes and leave in it what is still in flight."""
        if self.crossing and carry is None:
            raise ValueError(f"{self.schedule.name}: sends received in a later run need a Carry to outlive this one")
        actions, handlers = self.actions, self._handlers
        if torch.autograd.profiler._is_profiler_enabled:  # a user's torch.profiler records: every action labelled
            handlers = {op: _labelled(handler) for op, handler in handlers.items()}
        trace = self.trace  # read once: a caller may switch tracing on between runs
        st = _Run(host, keys, len(actions), trace, trace and self.transport.device.type == "cuda", carry)
        self.records = st.records
        self._skip_to_recv(st, 0)
        i = 0
        while i < len(actions):
            a = actions[i]
            if a.op.is_send or a.op.is_recv:
                # consecutive comm actions go out as one group, so two neighbours exchanging at
                # once cannot deadlock on NCCL's in-order streams
                while i < len(actions) and (actions[i].op.is_send or actions[i].op.is_recv):
                    handlers[actions[i].op](st, i, actions[i])
                    i += 1
                self._flush(st)
                continue
            if a.op.is_compute and self.prefetch:
                self._prefetch(st)
            handlers[a.op](st, i, a)
            i += 1
        for work in st.send_works:
            work.wait()
        self.transport.release_headers()
        if carry is not None:
            for work in carry.send_works:  # the previous run's crossing sends: received in this run
                work.wait()
            carry.send_works = st.crossing_works
            carry.shift(len(keys))

    # ---- communication ---------------------------------------------------------------------
    def _send_activation(self, st: _Run, index: int, a: Action) -> None:
        value = st.outbox.pop(("activation", a.chunk, a.microbatch))
        self._add(st, index, self.transport.send_activation(a.peer, a.chunk, st.keys[a.microbatch], value))

    def _send_gradients(self, st: _Run, index: int, a: Action) -> None:
        self._add(st, index, self.transport.send_gradients(a.peer, st.outbox.pop(("gradient", a.chunk, a.microbatch))))

    def _add(self, st: _Run, index: int, ops: list) -> None:
        st.ops += ops
        st.op_actions += [index] * len(ops)

    def _recv(self, st: _Run, index: int, a: Action) -> None:
        if st.posted[index]:  # prefetched
            return
        if a.op is Op.RECV_ACT and self.transport.needs_header(a.peer, a.chunk, st.keys[a.microbatch]):
            # the header is read blocking: first issue what this group holds, or a peer waiting for
            # one of these sends could never send the header
            self._flush(st)
        self._post(st, index)

    def _post(self, st: _Run, index: int) -> None:
        """Add receive `index` to the group being built (its buffers, and its ops)."""
        a = self.actions[index]
        if a.op is Op.RECV_ACT:
            pending, recv_ops = self.transport.recv_activation(a.peer, a.chunk, st.keys[a.microbatch])
        else:
            pending, recv_ops = self.transport.recv_gradients(a.peer, _needs_grad(st.stash_out[(a.chunk, a.microbatch)]))
        pending.action = index  # for the monitor's per-message stamps
        st.pendings.append((pending, len(st.ops), len(st.ops) + len(recv_ops)))
        self._add(st, index, recv_ops)
        st.inbox[(a.op, a.chunk, a.microbatch)] = pending
        st.posted[index] = True
        self._skip_to_recv(st, index + 1)

    def _skip_to_recv(self, st: _Run, start: int) -> None:
        j, actions = start, self.actions
        while j < len(actions) and not actions[j].op.is_recv:
            j += 1
        st.next_recv = j

    def _flush(self, st: _Run) -> None:
        """Issue the group being built and start a new one."""
        ops, pendings, owners = st.ops, st.pendings, st.op_actions
        st.ops, st.pendings, st.op_actions = [], [], []
        if st.trace:  # a send is issued (not completed) here: a point in time. Stamped per group, since
            # a receive that must read a header first issues the group's sends before it blocks.
            now = time.perf_counter()
            st.records.extend((j, now, now) for j in dict.fromkeys(owners) if self.actions[j].op.is_send)
        if self.meter is not None:
            self.meter.sent(owners, ops)
        works = self.transport.issue(ops)
        if len(works) == len(ops):  # one work per op: each receive waits for its own ops only
            taken = set()
            for pending, lo, hi in pendings:
                pending.works = works[lo:hi]
                taken.update(range(lo, hi))
            for k, w in enumerate(works):
                if k not in taken:
                    (st.crossing_works if owners[k] in self.crossing else st.send_works).append(w)
        else:  # coalesced (NCCL group): one work stands for the whole group
            for pending, _, _ in pendings:
                pending.works = list(works)
            (st.crossing_works if any(k in self.crossing for k in owners) else st.send_works).extend(works)

    def _prefetch(self, st: _Run) -> None:
        """Post the next receive early, unless it would block (header) or lacks its buffers yet."""
        j = st.next_recv
        if j >= len(self.actions) or st.posted[j]:
            return
        a = self.actions[j]
        if a.op is Op.RECV_ACT and self.transport.needs_header(a.peer, a.chunk, st.keys[a.microbatch]):
            return
        if a.op is Op.RECV_GRAD and (a.chunk, a.microbatch) not in st.stash_out:
            return
        self._post(st, j)  # called between groups only: the group is empty here
        self._flush(st)

    def _take(self, st: _Run, op: Op, chunk: int, mb: int) -> Any:
        """The activation (or gradients) a compute consumes, waiting if still in flight."""
        key = (op, chunk, mb)
        if key in st.local:
            return st.local.pop(key)
        pending = st.inbox.pop(key)
        if self.meter is not None:
            self.meter.waiting(pending)
        elif st.idle is not None and not pending.ready():
            st.idle()  # the host's own work, in time this rank would spend waiting
        return pending.activation() if op is Op.RECV_ACT else pending.value()

    # ---- computation -----------------------------------------------------------------------
    def _clock(self, st: _Run) -> float:
        # called once the compute's input is taken: waiting for it is not compute time
        if st.sync:
            torch.cuda.synchronize(self.transport.device)
        return time.perf_counter()

    def _record(self, st: _Run, index: int, started: float) -> None:
        if st.sync:
            torch.cuda.synchronize(self.transport.device)
        st.records.append((index, started, time.perf_counter()))

    def _forward(self, st: _Run, index: int, a: Action) -> None:
        c, mb = a.chunk, a.microbatch
        inputs = self._take(st, Op.RECV_ACT, c, mb) if c > 0 else None
        started = self._clock(st) if st.trace else 0.0
        timer = self.meter.start() if self.meter is not None else None
        with torch.set_grad_enabled(self.schedule.backward):
            out = st.host.forward(c, mb, inputs)
        if timer is not None:
            self.meter.stop(timer, forward=True)
        if self.schedule.backward:
            st.stash_in[(c, mb)], st.stash_out[(c, mb)] = inputs, out
        if c < self.last_chunk:
            if self.schedule.chunk_rank[c + 1] == self.rank:
                st.local[(Op.RECV_ACT, c + 1, mb)] = _local_leaf(out)
            else:
                st.outbox[("activation", c, mb)] = out
        if st.trace:
            self._record(st, index, started)

    def _backward_inputs(self, st: _Run, c: int, mb: int) -> tuple[Any, Any, Any]:
        """What a backward (whole or BI) of chunk c, micro-batch mb starts from: its stashed output and
        input, and the output gradient received (None on the last chunk: the loss starts it)."""
        out, inputs = st.stash_out.pop((c, mb)), st.stash_in.pop((c, mb))
        return out, inputs, self._take(st, Op.RECV_GRAD, c, mb) if c != self.last_chunk else None

    def _before_backward(self, st: _Run, index: int, c: int) -> None:
        before = getattr(st.host, "before_backward", None)
        if before is not None:
            before(c, index in self.gradients_complete)

    def _backward(self, st: _Run, index: int, a: Action) -> None:
        c, mb = a.chunk, a.microbatch
        out, inputs, received = self._backward_inputs(st, c, mb)
        self._before_backward(st, index, c)
        started = self._clock(st) if st.trace else 0.0
        timer = self.meter.start() if self.meter is not None else None
        if st.backward_scope is None:
            self._autograd(c, out, received)
        else:
            with st.backward_scope(c, mb):
                self._autograd(c, out, received)
        if timer is not None:
            self.meter.stop(timer, forward=False)
        self._weights_done(st, c, mb)
        if c > 0:
            self._hand_back(st, c, mb, [t.grad if t.grad is not None else torch.zeros_like(t) for t in _needs_grad(inputs)])
        if st.trace:
            self._record(st, index, started)

    def _autograd(self, c: int, out: Any, received: Any) -> None:
        if c == self.last_chunk:
            if out is not None and out.requires_grad:
                torch.autograd.backward(out)
        else:
            torch.autograd.backward(_needs_grad(out), received)

    def _hand_back(self, st: _Run, c: int, mb: int, grads: list) -> None:
        """Chunk c's input gradients go to chunk c - 1: locally, or by its SEND action."""
        if self.schedule.chunk_rank[c - 1] == self.rank:
            st.local[(Op.RECV_GRAD, c - 1, mb)] = grads
        else:
            st.outbox[("gradient", c, mb)] = grads

    def _backward_input(self, st: _Run, index: int, a: Action) -> None:
        """BI: the input gradient only; the graph is kept for the micro-batch's W."""
        c, mb = a.chunk, a.microbatch
        out, inputs, received = self._backward_inputs(st, c, mb)
        started = self._clock(st) if st.trace else 0.0
        timer = self.meter.start() if self.meter is not None else None
        if c == self.last_chunk:
            outputs = [out] if out is not None and out.requires_grad else []
            grads = [None] * len(outputs)
        else:
            outputs, grads = _needs_grad(out), list(received)
        leaves = _needs_grad(inputs) if c > 0 and inputs is not None else []
        input_grads, st.deferred[(c, mb)] = backward_input(outputs, grads, leaves)
        if timer is not None:
            self.meter.stop(timer, forward=False)
        if c > 0:
            self._hand_back(st, c, mb, input_grads)
        if st.trace:
            self._record(st, index, started)

    def _backward_weight(self, st: _Run, index: int, a: Action) -> None:
        """W: the weight gradients of a micro-batch whose BI has run (accumulated into ``.grad``)."""
        deferred = st.deferred.pop((a.chunk, a.microbatch))
        self._before_backward(st, index, a.chunk)
        started = self._clock(st) if st.trace else 0.0
        timer = self.meter.start() if self.meter is not None else None
        backward_weight(deferred)
        if timer is not None:
            self.meter.stop(timer, forward=False)
        self._weights_done(st, a.chunk, a.microbatch)
        if st.trace:
            self._record(st, index, started)

    @staticmethod
    def _weights_done(st: _Run, c: int, mb: int) -> None:
        done = getattr(st.host, "weight_gradients_done", None)
        if done is not None:
            done(c, mb)

    def _reduce(self, st: _Run, index: int, a: Action) -> None:
        st.host.reduce_gradients(a.chunk)


def _crossing_sends(schedule: PipelineSchedule, rank: int) -> frozenset[int]:
    """Indices of this rank's sends that no receive in the peer's list matches: a schedule run one
    step at a time (2BW) hands them to the peer's next run."""
    received: set[tuple] = set()
    for peer_actions in schedule.actions:
        for a in peer_actions:
            if a.op is Op.RECV_ACT and a.peer == rank:
                received.add(("act", a.chunk - 1, a.microbatch))
            elif a.op is Op.RECV_GRAD and a.peer == rank:
                received.add(("grad", a.chunk + 1, a.microbatch))
    out = set()
    for i, a in enumerate(schedule.actions[rank]):
        if a.op is Op.SEND_ACT and ("act", a.chunk, a.microbatch) not in received:
            out.add(i)
        elif a.op is Op.SEND_GRAD and ("grad", a.chunk, a.microbatch) not in received:
            out.add(i)
    return frozenset(out)


def _labelled(handler: Callable[[_Run, int, Action], None]) -> Callable[[_Run, int, Action], None]:
    """`handler` inside a `record_function` naming the action, so a profiler trace shows the schedule
    (a communication action's label covers adding it to its group; the group is issued after)."""

    def run(st: _Run, index: int, a: Action) -> None:
        with torch.profiler.record_function(f"lightning_pipe/{a.op.value} chunk={a.chunk} mb={a.microbatch}"):
            handler(st, index, a)

    return run
