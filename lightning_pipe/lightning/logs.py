"""Logged values: recorded per micro-batch on the last stage, then logged on every rank.

Only the last stage computes the loss, but Lightning's loggers write from global rank 0 (the
first stage), monitors (ModelCheckpoint, EarlyStopping, ReduceLROnPlateau) read the metric on
every rank, and ``sync_dist=True`` is a collective that hangs if a key is logged on some ranks
only. So the last stage combines each key over the micro-batches, weighted by their share of the
samples (the per-batch mean), and broadcasts the result; every rank then calls the real
``LightningModule.log`` with the same keys and values.

In the steady state the exchange is one broadcast of one small tensor per step: every rank
knows the last step's schema (names, options, dtypes), so the tensor's length is known on both
ends and its first element says whether the schema still holds. Only when it changed (the first
step, or a step that logs other keys) do the new schema (as an object) and the values follow.
The broadcast ends the step on every rank at once, so it is kept to one message.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class LogRecorder:
    """Stands in for ``module.log`` during a pipelined step."""

    def __init__(self) -> None:
        self.active = False
        self.weight = 0.0
        self.values: dict[str, Any] = {}  # name -> weighted sum, a tensor on the device (no sync per call)
        self.options: dict[str, tuple[dict, Optional[torch.dtype]]] = {}

    def reset(self) -> None:
        self.values, self.options = {}, {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("pass self.log options by keyword under AutoPipeStrategy (self.log(name, value, prog_bar=True))")
        if not self.active:
            return  # a stage other than the last runs the step only up to the pipeline call
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) got a tensor of {value.numel()} elements; log a scalar")
            number, dtype = value.detach().to(torch.float64).reshape(()), value.dtype
        elif isinstance(value, (int, float)):
            number, dtype = float(value), None
        else:
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) is not supported under AutoPipeStrategy: the value must be "
                "a number or a scalar tensor (for a torchmetrics Metric, log the tensor its call returns)"
            )
        self.values[name] = self.values.get(name, 0.0) + self.weight * number
        self.options.setdefault(name, (kwargs, dtype))


class LogBroadcaster:
    """Moves the last stage's combined logs to every rank of its pipeline, then logs them."""

    def __init__(self, group: Any, src: int, device: torch.device, is_src: bool):
        self.group, self.src, self.device, self.is_src = group, src, device, is_src
        self._schema: Optional[list[tuple[str, dict, Optional[torch.dtype]]]] = None

    def exchange(self, recorder: LogRecorder, loss: Any) -> tuple[float, list[tuple[str, float, dict, Optional[torch.dtype]]]]:
        """Return the batch loss and the (name, value, options, dtype) list, identical on every rank."""
        if self.is_src:
            schema = [(n, *recorder.options[n]) for n in recorder.values]
            values = [loss] + [recorder.values[n] for n in recorder.values]
            data = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values])
        if self.group is None:  # a one-stage pipeline: nothing to move
            numbers = data.tolist()
            return numbers[0], [(n, v, kw, dt) for (n, kw, dt), v in zip(schema, numbers[1:])]
        if self._schema is not None:
            # [changed, loss, values...] sized by the schema every rank knows: one message per step
            size = 2 + len(self._schema)
            if self.is_src:
                changed = schema != self._schema
                frame = torch.zeros(size, dtype=torch.float64, device=self.device)
                frame[0] = float(changed)
                if not changed:
                    frame[1:] = data
            else:
                frame = torch.zeros(size, dtype=torch.float64, device=self.device)
            dist.broadcast(frame, self.src, group=self.group)
            numbers = frame.tolist()
            if numbers[0] == 0.0:
                return numbers[1], [(n, v, kw, dt) for (n, kw, dt), v in zip(self._schema, numbers[2:])]
        # first step, or the schema changed: the schema as an object, then the values
        box = [schema if self.is_src else None]
        dist.broadcast_object_list(box, self.src, group=self.group, device=self.device)
        self._schema = box[0]
        if not self.is_src:
            data = torch.zeros(1 + len(self._schema), dtype=torch.float64, device=self.device)
        dist.broadcast(data, self.src, group=self.group)
        numbers = data.tolist()
        return numbers[0], [(n, v, kw, dt) for (n, kw, dt), v in zip(self._schema, numbers[1:])]


def replay(module: Any, entries: list[tuple[str, float, dict, Optional[torch.dtype]]], device: torch.device, sync: bool = False) -> None:
    """`sync`: evaluation with several pipelines, each over its shard of the data: the logged value is
    the mean over the pipelines (``sync_dist=True`` unless the user chose otherwise)."""
    for name, value, options, dtype in entries:
        if sync:
            options = {"sync_dist": True, **options}
        module.log(name, torch.tensor(value, dtype=dtype, device=device) if dtype is not None else value, **options)
