"""Combine the per-micro-batch outputs of an evaluation step into one batch output."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def merge_outputs(outputs: list[Any]) -> Any:
    """Tensors with a batch dimension are concatenated, dicts and tuples merged key by key;
    anything else comes back as the list of micro-batch outputs."""
    if not outputs:
        return None
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if all(isinstance(o, Tensor) and o.dim() > 0 for o in outputs):
        return torch.cat(outputs, dim=0)
    if all(isinstance(o, Mapping) for o in outputs) and all(o.keys() == first.keys() for o in outputs):
        return {k: merge_outputs([o[k] for o in outputs]) for k in first}
    if all(isinstance(o, (tuple, list)) and len(o) == len(first) for o in outputs):
        return type(first)(merge_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return outputs
