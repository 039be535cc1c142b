"""Point-to-point transport between pipeline ranks, with shape negotiation.

An activation is a tensor or a tuple of tensors of any dtype; tensors that need no gradient
(masks, position ids, integer tensors) travel without one and get no gradient back.

Negotiation costs nothing in the steady state. Every stage of a pipeline holds the same batch, so
both ends know each micro-batch's `signature` (its shapes and dtypes), and activations' shapes
are a function of it. The first time a (peer, chunk, signature) is seen, the sender puts a small
header (count, dtypes, shapes, requires-grad flags) in front of the data and the receiver reads it
before allocating buffers; both ends cache it and later messages are raw data only. A new shape
(the last short batch of an epoch, another sequence length) is a new signature, so it is
negotiated again. Gradients need no header: their shapes are those of the activation sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

Activation = Union[Tensor, tuple[Tensor, ...]]

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class ActivationSpec:
    is_tuple: bool
    tensors: tuple[TensorSpec, ...]

    @staticmethod
    def of(value: Activation) -> "ActivationSpec":
        items = value if isinstance(value, tuple) else (value,)
        for t in items:
            if not isinstance(t, Tensor):
                raise TypeError(f"a pipeline stage must output a tensor or a tuple of tensors, got an element of type {type(t).__name__}")
        return ActivationSpec(isinstance(value, tuple), tuple(TensorSpec(tuple(t.shape), t.dtype, t.requires_grad) for t in items))

    def encode(self, device: torch.device) -> Tensor:
        data = [int(self.is_tuple), len(self.tensors)]
        for t in self.tensors:
            if t.dtype not in _CODE:
                raise TypeError(f"dtype {t.dtype} cannot be sent between pipeline stages; supported: {_DTYPES}")
            data += [_CODE[t.dtype], int(t.requires_grad), len(t.shape), *t.shape]
        return torch.tensor(data, dtype=torch.int64, device=device)

    @staticmethod
    def decode(header: Tensor) -> "ActivationSpec":
        data = header.tolist()
        is_tuple, count, pos, specs = bool(data[0]), data[1], 2, []
        for _ in range(count):
            code, grad, ndim = data[pos : pos + 3]
            specs.append(TensorSpec(tuple(data[pos + 3 : pos + 3 + ndim]), _DTYPES[code], bool(grad)))
            pos += 3 + ndim
        return ActivationSpec(is_tuple, tuple(specs))


class PendingRecv:
    """Receive buffers with their in-flight work; `value()` waits and returns them."""

    def __init__(self, buffers: list[Tensor], spec: Optional[ActivationSpec]):
        self.buffers, self.spec, self.works = buffers, spec, []
        self.action = -1  # the receive action's index in the rank's list

    def ready(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def value(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        self.works = []
        return self.buffers

    def activation(self) -> Activation:
        """Received tensors as the stage's next input: fresh leaves, requiring grad where the sender's did."""
        tensors = self.value()
        for t, s in zip(tensors, self.spec.tensors):
            t.requires_grad_(s.requires_grad)
        return tuple(tensors) if self.spec.is_tuple else tensors[0]


class Transport:
    """Sends and receives between pipeline ranks of one pipeline (peers are pipeline ranks)."""

    def __init__(self, to_global: Callable[[int], int], device: torch.device, batch_ops: Optional[bool] = None):
        self.to_global, self.device = to_global, device
        # NCCL runs the sends and receives between two ranks in order on one stream, so a send and a
        # receive that a neighbour issues in the other order deadlock unless they go in one group.
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        self.batch_ops = (backend != "gloo") if batch_ops is None else batch_ops
        self._sent: set[Hashable] = set()
        self._specs: dict[Hashable, ActivationSpec] = {}
        self._pinned: list[Tensor] = []  # headers in flight
        self.moved_bytes, self.messages = 0, 0  # what this rank sent and received (AvgPipe's tuner reads them)
        self.meter: Optional[Any] = None  # the adaptive monitor's StepMeter while it measures a step

    # ---- activations -------------------------------------------------------------------------
    def send_activation(self, peer: int, chunk: int, key: Hashable, value: Activation) -> list[dist.P2POp]:
        spec = ActivationSpec.of(value)
        dst = self.to_global(peer)
        ops = []
        if (peer, chunk, key) not in self._sent:
            header = spec.encode(self.device)
            length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
            self._pinned += [length, header]
            ops += [dist.P2POp(dist.isend, length, dst), dist.P2POp(dist.isend, header, dst)]
            self._sent.add((peer, chunk, key))
        items = value if isinstance(value, tuple) else (value,)
        ops += [dist.P2POp(dist.isend, t.detach().contiguous(), dst) for t in items]
        return ops

    def needs_header(self, peer: int, chunk: int, key: Hashable) -> bool:
        return (peer, chunk, key) not in self._specs

    def recv_activation(self, peer: int, chunk: int, key: Hashable) -> tuple[PendingRecv, list[dist.P2POp]]:
        """Buffers and the receive ops to issue; reads the header first (blocking) if not yet negotiated."""
        src = self.to_global(peer)
        spec = self._specs.get((peer, chunk, key))
        if spec is None:
            length = torch.empty(1, dtype=torch.int64, device=self.device)
            dist.recv(length, src)
            header = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
            dist.recv(header, src)
            spec = self._specs[(peer, chunk, key)] = ActivationSpec.decode(header)
        buffers = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in spec.tensors]
        return PendingRecv(buffers, spec), [dist.P2POp(dist.irecv, b, src) for b in buffers]

    # ---- gradients ---------------------------------------------------------------------------
    def send_gradients(self, peer: int, grads: Sequence[Tensor]) -> list[dist.P2POp]:
        dst = self.to_global(peer)
        return [dist.P2POp(dist.isend, g.contiguous(), dst) for g in grads]

    def recv_gradients(self, peer: int, like: Sequence[Tensor]) -> tuple[PendingRecv, list[dist.P2POp]]:
        src = self.to_global(peer)
        buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        return PendingRecv(buffers, None), [dist.P2POp(dist.irecv, b, src) for b in buffers]

    # ---- issuing -----------------------------------------------------------------------------
    def issue(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        if not ops:
            return []
        self.messages += len(ops)
        self.moved_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        if self.batch_ops:
            return dist.batch_isend_irecv(ops)
        return [op.op(op.tensor, op.peer) for op in ops]

    def release_headers(self) -> None:
        self._pinned.clear()


class GroupRecv(PendingRecv):
    """A receive of a tensor-parallel group: its first rank receives the message, then every rank of the group
    takes it from there in one broadcast (when the value is first needed: the group's ranks run the same
    actions in the same order, so their broadcasts pair up)."""

    def __init__(self, buffers: list[Tensor], spec: Optional[ActivationSpec], group: Any, root: int):
        super().__init__(buffers, spec)
        self.group, self.root, self.shared = group, root, False

    def value(self) -> list[Tensor]:
        buffers = super().value()
        if not self.shared:
            for b in buffers:
                dist.broadcast(b, self.root, group=self.group)
            self.shared = True
        return buffers


class GroupTransport(Transport):
    """tensor > 1: a stage's input and output are whole on every rank of its tensor group, so one message per
    group crosses a cut. Its first rank (`root`, a global rank) sends and receives for the group, the others
    send nothing and take what it received by a broadcast inside the group (on GPUs: within the node)."""

    def __init__(self, to_global: Callable[[int], int], device: torch.device, group: Any, root: int, batch_ops: Optional[bool] = None):
        super().__init__(to_global, device, batch_ops)
        self.group, self.root = group, root
        self.is_root = dist.get_rank() == root
        self._shared: set[Hashable] = set()  # keys whose header the group has had

    def send_activation(self, peer: int, chunk: int, key: Hashable, value: Activation) -> list[dist.P2POp]:
        return super().send_activation(peer, chunk, key, value) if self.is_root else []

    def send_gradients(self, peer: int, grads: Sequence[Tensor]) -> list[dist.P2POp]:
        return super().send_gradients(peer, grads) if self.is_root else []

    def recv_activation(self, peer: int, chunk: int, key: Hashable) -> tuple[PendingRecv, list[dist.P2POp]]:
        if self.is_root:
            pending, ops = super().recv_activation(peer, chunk, key)  # reads the header first if not yet negotiated
            if (peer, chunk, key) not in self._shared:
                self._share_spec(pending.spec)
                self._shared.add((peer, chunk, key))
            return GroupRecv(pending.buffers, pending.spec, self.group, self.root), ops
        spec = self._specs.get((peer, chunk, key))
        if spec is None:
            spec = self._specs[(peer, chunk, key)] = self._share_spec(None)
        buffers = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in spec.tensors]
        return GroupRecv(buffers, spec, self.group, self.root), []

    def recv_gradients(self, peer: int, like: Sequence[Tensor]) -> tuple[PendingRecv, list[dist.P2POp]]:
        if self.is_root:
            pending, ops = super().recv_gradients(peer, like)
            return GroupRecv(pending.buffers, None, self.group, self.root), ops
        buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        return GroupRecv(buffers, None, self.group, self.root), []

    def _share_spec(self, spec: Optional[ActivationSpec]) -> ActivationSpec:
        """The first receive of a key: the root's negotiated header to the group (the others allocate from it)."""
        header = spec.encode(self.device) if spec is not None else None
        length = torch.tensor([header.numel() if header is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(length, self.root, group=self.group)
        if header is None:
            header = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
        dist.broadcast(header, self.root, group=self.group)
        return spec if spec is not None else ActivationSpec.decode(header)
