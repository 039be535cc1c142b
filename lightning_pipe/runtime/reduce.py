"""Gradient reduction across pipeline replicas (data-parallel width) and global-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor


def local(t: Tensor) -> Tensor:
    """A DTensor's shard on this rank (FSDP2's sharded gradients), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


BUCKET_BYTES = 25 * 2**20  # a flat buffer holds at most this much (DDP's default bucket): the copy a collective adds stays small


def buckets(tensors: Iterable[Tensor], cap: int = BUCKET_BYTES) -> Iterator[list[Tensor]]:
    """`tensors` in order, grouped by dtype into runs of at most `cap` bytes (a larger tensor alone)."""
    open_: dict[torch.dtype, tuple[list[Tensor], int]] = {}
    for t in tensors:
        group, size = open_.get(t.dtype, ([], 0))
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > cap:
            yield group
            group, size = [], 0
        open_[t.dtype] = (group + [t], size + nbytes)
    for group, _ in open_.values():
        if group:
            yield group


def collective_in_buckets(tensors: Iterable[Tensor], op: Callable[[Tensor], None]) -> None:
    """`op(buffer)` in place on every tensor of `tensors`, one bucket at a time: a lone contiguous tensor is
    its own buffer, a run of smaller ones is flattened and copied back."""
    for group in buckets(tensors):
        if len(group) == 1 and group[0].is_contiguous():
            op(group[0])
            continue
        flat = _flatten_dense_tensors(group)
        op(flat)
        for t, new in zip(group, _unflatten_dense_tensors(flat, group)):
            t.copy_(new)


def allreduce_mean(params: Iterable[torch.nn.Parameter], group: Any, size: int) -> None:
    """Average the gradients of `params` over the `size` ranks of `group`, in buckets (`collective_in_buckets`)."""
    if size <= 1:
        return
    grads = []
    for p in params:
        if p.grad is None:  # a parameter unused this step still takes part: the others may have a grad
            p.grad = torch.zeros_like(p)
        grads.append(local(p.grad))  # tensor parallelism: this rank's shard (the group holds the same shard's replicas)

    def mean(buffer: Tensor) -> None:
        dist.all_reduce(buffer, group=group)
        buffer.div_(size)

    collective_in_buckets(grads, mean)


def clip_grad_norm_global(params: Iterable[Tensor], max_norm: float, group: Optional[Any], skip_in_norm: frozenset = frozenset()) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` over all stages of a pipeline: the norm is the 2-norm of the
    gradients of every stage, summed as squares across `group`, so each stage scales by one factor.
    Parameters in `skip_in_norm` (ids; copies of a tied weight held elsewhere too) are scaled but not counted."""
    params = [p for p in params if p.grad is not None]
    grads = [local(p.grad) for p in params]  # shard="full": this rank's shard (the group spans the shards)
    counted = [local(p.grad) for p in params if id(p) not in skip_in_norm]
    device = grads[0].device if grads else torch.device("cpu")
    if counted:
        norms = torch.stack([torch.linalg.vector_norm(g, 2.0).to(torch.float64) for g in counted])
        squares = (norms * norms).sum()
    else:
        squares = torch.zeros((), dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if not math.isfinite(total.item()):
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
