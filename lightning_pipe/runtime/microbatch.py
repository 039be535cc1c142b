"""Split a batch of any structure into micro-batches along dim 0.

Sizes follow `torch.tensor_split`: with ``n`` samples and ``m`` micro-batches the first
``n % m`` micro-batches hold one sample more. Each micro-batch's loss is weighted by its share
``n_i / n`` of the samples, so the summed gradient equals the gradient of the mean loss of the
whole batch, even when ``m`` does not divide ``n``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def _tensors(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def batch_size(batch: Any) -> int:
    """The common dim-0 size of every tensor in `batch`."""
    tensors = [t for t in _tensors(batch) if t.dim() > 0]
    if not tensors:
        raise ValueError("the batch holds no tensor with a batch dimension to split into micro-batches")
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors disagree on their dim-0 (batch) size: {sorted(sizes)}")
    return sizes.pop()


def _split(batch: Any, sizes: list[int]) -> list[Any]:
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            return [batch] * len(sizes)
        return list(torch.split(batch, sizes, dim=0))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, sizes) for k, v in batch.items()}
        cls = type(batch) if isinstance(batch, dict) else dict
        return [cls((k, parts[k][i]) for k in batch) for i in range(len(sizes))]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        parts = [_split(v, sizes) for v in batch]
        return [type(batch)(*(p[i] for p in parts)) for i in range(len(sizes))]
    if isinstance(batch, (list, tuple)):
        parts = [_split(v, sizes) for v in batch]
        return [type(batch)(p[i] for p in parts) for i in range(len(sizes))]
    return [batch] * len(sizes)  # numbers, strings, None: every micro-batch gets the same value


def microbatch_sizes(n: int, microbatches: int) -> list[int]:
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches}: must be >= 1")
    if n < microbatches:
        raise ValueError(
            f"a batch of {n} samples cannot be split into microbatches={microbatches}: use a batch size >= "
            f"{microbatches}, fewer micro-batches, or drop_last=True in the DataLoader"
        )
    base, extra = divmod(n, microbatches)
    return [base + 1 if i < extra else base for i in range(microbatches)]


def sliced_sizes(sizes: list[int], sliced: int) -> list[int]:
    """AutoPipe's slicer: the first `sliced` micro-batches are cut in two halves each, so the
    pipeline fills in half the time (a half is ready for the next stage twice as early)."""
    if not 0 <= sliced <= len(sizes):
        raise ValueError(f"sliced={sliced}: must be between 0 and the number of micro-batches ({len(sizes)})")
    out: list[int] = []
    for i, size in enumerate(sizes):
        if i < sliced and size >= 2:
            out += [size - size // 2, size // 2]
        else:
            out.append(size)
    return out


def split_microbatches(batch: Any, microbatches: int, sliced: int = 0) -> tuple[list[Any], list[float]]:
    """Return the micro-batches and their loss weights (shares of the samples, summing to 1).
    With `sliced`, the first `sliced` micro-batches come as two halves each (see `sliced_sizes`)."""
    n = batch_size(batch)
    sizes = sliced_sizes(microbatch_sizes(n, microbatches), sliced)
    return _split(batch, sizes), [s / n for s in sizes]


def signature(batch: Any) -> tuple:
    """Shapes and dtypes of a (micro-)batch: activations' shapes are a function of it."""
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(batch))
