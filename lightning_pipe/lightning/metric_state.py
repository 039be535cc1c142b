"""torchmetrics `Metric` objects through the pipeline: updated where the loss is computed, held on every rank.

A `Metric` is an attribute of the LightningModule, so every rank has one, but only the last stage's
step calls it (once per micro-batch). Lightning reads a logged Metric on every rank: its
``_forward_cache`` for the step value and ``compute()`` at the epoch's end (on global rank 0, the
first stage, for the loggers). So each step the last stage

1. sets every metric's state aside and resets it (`begin`), so the micro-batches' updates build the
   *batch's* state: its ``compute()`` is the step value one process gets from ``metric(batch)``
   (torchmetrics' own contract: updates over the parts of a batch equal one update over it);
2. sends that batch state with the logs (`payload`), and every rank (the last one too) merges it into
   the state set aside (`merge`), with the reduction each state declares (sum, cat, min, max, mean).

Every rank of a pipeline then holds the same state, and a metric syncs at ``compute()`` over the
ranks of its stage across replicas and AvgPipe pipelines (`attach`), as data parallelism does: the
ranks of one pipeline hold copies, so they must not be summed together.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_mean

# one tensor per state; a list state (a "cat" state) travels concatenated and comes back as a one-element list
Layout = tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]  # (attr, shape, dtype, was_list)


def metrics_of(module: Any) -> dict[str, Metric]:
    """The module's metrics by attribute path (the same on every rank: they are not in the cut model)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric) and name}


def attach(module: Any, stage_group: Optional[Any], width: int) -> None:
    """Sync at compute() over this stage's ranks across replicas (none with one replica)."""
    for metric in metrics_of(module).values():
        if width > 1:
            metric.process_group = stage_group
        else:
            metric.dist_sync_fn = _no_gather  # the pipeline's ranks hold copies: nothing to gather


def check_metrics(module: Any) -> None:
    """Before any process starts: a metric made on the meta device cannot be moved or reset."""
    for path, metric in metrics_of(module).items():
        if any(isinstance(v, Tensor) and v.is_meta for v in metric._defaults.values()):
            raise ValueError(
                f"the metric {path!r} was created on the meta device (trainer.init_module(empty_init=True) or "
                "configure_model()), so its initial state is lost: create it under `with torch.device('cpu'):`"
            )


@contextmanager
def untouched(module: Any) -> Iterator[None]:
    """Metrics as before, whatever runs the user's step inside (the profiler's runs are not training)."""
    saved = {path: (m._copy_state_dict(), m._update_count) for path, m in metrics_of(module).items()}
    try:
        yield
    finally:
        for path, metric in metrics_of(module).items():
            _set_state(metric, *saved[path])


def _no_gather(tensor: Tensor, group: Any = None) -> list[Tensor]:
    return [tensor]


class MetricSteps:
    """The last stage's side: the state set aside at the step's start, the batch state at its end."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.saved: dict[str, tuple[dict[str, Any], int]] = {}

    def begin(self) -> None:
        self.saved = {}
        for path, metric in metrics_of(self.module).items():
            self.saved[path] = (metric._copy_state_dict(), metric._update_count)
            metric.reset()  # the micro-batches' updates now build this batch's state

    def payload(self, logged: set[str]) -> dict[str, tuple[Layout, Tensor, int, float]]:
        """path -> (layout, flat float64 state, batch updates, step value) of each metric the step updated;
        the metric goes back to its state before the step (the merge is every rank's, `merge`)."""
        out = {}
        for path, metric in metrics_of(self.module).items():
            earlier, count = self.saved.get(path, (None, 0))
            updates = metric._update_count
            if updates:
                value = step_value(metric) if path in logged else float("nan")
                layout, flat = pack(metric)
                out[path] = (layout, flat, updates, value)
            if earlier is not None:
                _set_state(metric, earlier, count)
        return out


def step_value(metric: Metric) -> float:
    """compute() over the batch's state, synced only where the user asked for it per step."""
    metric._to_sync = metric.dist_sync_on_step
    try:
        value = metric.compute()
    finally:
        metric._to_sync, metric._computed = metric.sync_on_compute, None
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise TypeError(f"a logged torchmetrics Metric must compute a scalar, got {type(value).__name__}")
    return float(value)


def pack(metric: Metric) -> tuple[Layout, Tensor]:
    layout, parts = [], []
    for attr in metric._defaults:
        state = getattr(metric, attr)
        was_list = isinstance(state, list)
        if was_list:
            state = torch.cat([s.reshape(-1) for s in state]) if state else torch.zeros(0)
        layout.append((attr, tuple(state.shape), state.dtype, was_list))
        parts.append(state.detach().reshape(-1).to(torch.float64))
    return tuple(layout), torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def unpack(layout: Layout, flat: Tensor, device: torch.device) -> dict[str, Any]:
    state, at = {}, 0
    for attr, shape, dtype, was_list in layout:
        size = int(torch.Size(shape).numel())
        value = flat[at : at + size].to(dtype=dtype, device=device).reshape(shape)
        state[attr] = [value] if was_list else value
        at += size
    return state


def merge(metric: Metric, batch: dict[str, Any], updates: int, value: float) -> None:
    """The state set aside, then this batch: as torchmetrics' forward() merges a batch, by each state's
    reduction, with `mean` states weighed by their update counts (``_reduce_states`` assumes one update)."""
    earlier, count = metric._copy_state_dict(), metric._update_count
    _set_state(metric, batch, count + updates)
    if count:
        metric._reduce_states(earlier)
        for attr, reduction in metric._reductions.items():
            if reduction is dim_zero_mean:
                setattr(metric, attr, (count * earlier[attr] + updates * batch[attr]) / (count + updates))
    metric._forward_cache = torch.tensor(value, device=metric.device) if value == value else None
    metric._computed = None


def _set_state(metric: Metric, state: dict[str, Any], count: int) -> None:
    for attr, value in state.items():
        setattr(metric, attr, value)
    metric._update_count, metric._computed = count, None
