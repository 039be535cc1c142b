"""Gradient reduction across pipeline replicas (data-parallel width) and global-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def allreduce_mean(params: Iterable[torch.nn.Parameter], group: Any, size: int) -> None:
    """Average the gradients of `params` over the `size` ranks of `group`, one flat buffer per dtype."""
    if size <= 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.grad is None:  # a parameter unused this step still takes part: the others may have a grad
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


def clip_grad_norm_global(params: Iterable[Tensor], max_norm: float, group: Optional[Any], skip_in_norm: frozenset = frozenset()) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` over all stages of a pipeline: the norm is the 2-norm of the
    gradients of every stage, summed as squares across `group`, so each stage scales by one factor.
    Parameters in `skip_in_norm` (ids; copies of a tied weight held elsewhere too) are scaled but not counted."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    counted = [p.grad for p in params if id(p) not in skip_in_norm]
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
