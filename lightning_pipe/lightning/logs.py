"""Logged values: recorded per micro-batch on the last stage, then logged on every rank.

Only the last stage computes the loss, but Lightning's loggers write from global rank 0 (the
first stage), monitors (ModelCheckpoint, EarlyStopping, ReduceLROnPlateau) read the metric on
every rank, and ``sync_dist=True`` is a collective that hangs if a key is logged on some ranks
only. So the last stage combines each key over the micro-batches, weighted by their share of the
samples (the per-batch mean), and broadcasts the result; every rank then calls the real
``LightningModule.log`` with the same keys and values.

In the steady state the exchange is one small frame per step: every rank knows the last step's
schema for this kind of step (training or evaluation: names, options, dtypes), so the frame's
length is known on both ends and its first element says whether the schema still holds. Only when
it changed (the first step, or a step that logs other keys) do the new schema (as an object) and
the values follow. The frame travels point to point on a group of the pipeline's own, and every
other rank posts its receive before the step's schedule runs (`post`): the first stage starts and
ends each 1F1B step, and a broadcast at the step's end made it wait a collective's round trip on
the critical path (ours; docs/results/predictions.md, "The Trainer path"). In a training step the last
stage sends the frame as soon as its last forward has logged (`send_early`), and a rank that finds
it landed while it waits for a gradient logs the step then (`arrived`, from the executor's idle
hook) instead of after its last backward; never blocking on it, so a frame that lands late is
simply logged at the step's end.

A torchmetrics ``Metric`` logged on the last stage rides in the same message: the batch's state,
merged into the metric on every rank (`metric_state.py`), then logged as the Metric itself, so
Lightning's step value, epoch ``compute()`` and reset work as in one process.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from .metric_state import Layout, MetricSteps, merge, metrics_of, unpack

Kind = Any  # a scalar's dtype (None for a Python number), or ("metric", path) for a Metric


class LogRecorder:
    """Stands in for ``module.log`` during a pipelined step."""

    def __init__(self, module: Any = None) -> None:
        self.active = False
        self.weight = 0.0
        self.values: dict[str, Any] = {}  # name -> weighted sum, a tensor on the device (no sync per call)
        self.options: dict[str, tuple[dict, Kind]] = {}
        self.metrics = MetricSteps(module) if module is not None else None
        self.paths = {id(m): p for p, m in metrics_of(module).items()} if module is not None else {}

    def reset(self) -> None:
        self.values, self.options = {}, {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("pass self.log options by keyword under AutoPipeStrategy (self.log(name, value, prog_bar=True))")
        if not self.active:
            return  # a stage other than the last runs the step only up to the pipeline call
        if isinstance(value, Metric):
            path = self.paths.get(id(value))
            if path is None:
                raise ValueError(
                    f"self.log({name!r}, <Metric>): under AutoPipeStrategy the metric must be an attribute of the LightningModule"
                )
            self.options.setdefault(name, (kwargs, ("metric", path)))
            return
        if isinstance(value, DTensor):
            value = value.full_tensor()  # loss_parallel: the loss is a DTensor, replicated over the tensor ranks
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) got a tensor of {value.numel()} elements; log a scalar")
            number, dtype = value.detach().to(torch.float64).reshape(()), value.dtype
        elif isinstance(value, (int, float)):
            number, dtype = float(value), None
        else:
            raise TypeError(
                f"self.log({name!r}, <{type(value).__name__}>) is not supported under AutoPipeStrategy: the value must be "
                "a number, a scalar tensor or a torchmetrics Metric"
            )
        self.values[name] = self.values.get(name, 0.0) + self.weight * number
        self.options.setdefault(name, (kwargs, dtype))


Schema = tuple[list[tuple[str, dict, Kind]], list[tuple[str, Layout]]]  # logged keys; metric states sent
Entries = list[tuple[str, Any, dict, Kind]]


class LogBroadcaster:
    """Moves the last stage's combined logs to every rank of its pipeline, then logs them.

    `frames`: the pipeline's group of its own for the steady-state frame (a receive posted before the
    schedule must not meet the schedule's messages); None: the frame is broadcast on `group`."""

    def __init__(self, group: Any, src: int, device: torch.device, is_src: bool, frames: Any = None):
        self.group, self.src, self.device, self.is_src, self.frames = group, src, device, is_src, frames
        self.peers = [r for r in dist.get_process_group_ranks(frames) if r != src] if frames is not None else []
        self._schemas: dict[str, Schema] = {}  # per kind of step: training and evaluation log other keys
        self._posted: Optional[tuple[Tensor, Any]] = None  # the frame and its receive (None once waited)
        self._early: Optional[tuple[Tensor, list]] = None  # the last stage's frame, sent before the step's end
        self._packed: Optional[tuple[Schema, Tensor]] = None  # packed once a step: packing resets the metrics

    def post(self, kind: str) -> None:
        """Before the step's schedule runs: the receive of this step's frame, so that it lands while
        this rank computes (the last stage sends it when its part of the step is done)."""
        self._early = self._packed = None  # left by a step that failed
        schema = self._schemas.get(kind)
        if self.is_src or self.frames is None or schema is None:
            return
        frame = self._frame(schema)
        self._posted = (frame, dist.irecv(frame, self.src, group=self.frames))

    def send_early(self, recorder: LogRecorder, loss: Any, kind: str) -> None:
        """The last stage, once its last forward has logged (before its last backwards): the frame
        goes now if the schema holds, so the other ranks can log while they wait for their last
        gradients (`arrived`); otherwise it goes at the exchange."""
        known = self._schemas.get(kind)
        if not self.is_src or self.frames is None or known is None:
            return
        schema, data = self._packed = self._pack(recorder, loss)
        if schema != known:
            return
        frame = self._frame(known)
        frame[1:-1], frame[-1] = data, 1.0
        self._early = (frame, [dist.isend(frame, peer, group=self.frames) for peer in self.peers])

    def arrived(self, recorder: LogRecorder, kind: str) -> Optional[tuple[float, Entries]]:
        """Another rank, during the step: the posted frame, if it has landed with the known schema;
        None: the exchange at the step's end moves it."""
        if self._posted is None:
            return None
        frame, work = self._posted
        # gloo reports a receive complete only in wait(), but writes its data in place, in order, as it
        # lands: the frame's last element (1.0 from the sender) has landed last
        if work is not None and not (work.is_completed() or (frame.device.type == "cpu" and frame[-1].item() == 1.0)):
            return None
        frame = self._wait_posted()
        if frame[0].item() != 0.0:
            return None  # the schema changed: the exchange sends it, after this frame
        self._posted = None
        return self._unpack(recorder, self._schemas[kind], frame[1:-1])

    def _wait_posted(self) -> Tensor:
        """The posted frame, its receive waited once (a second wait on a gloo receive waits for
        another message)."""
        frame, work = self._posted
        if work is not None:
            work.wait()
            self._posted = (frame, None)
        return frame

    def exchange(self, recorder: LogRecorder, loss: Any, kind: str = "train") -> tuple[float, Entries]:
        """Return the batch loss and the (name, value, options, kind) list, identical on every rank; the
        metrics the step updated hold the same state on every rank."""
        if self._early is not None:  # sent during the step (`send_early`)
            frame, works = self._early
            self._early = self._packed = None
            for work in works:
                work.wait()
            return self._unpack(recorder, self._schemas[kind], frame[1:-1])
        if self.is_src:
            schema, data = self._packed if self._packed is not None else self._pack(recorder, loss)
            self._packed = None
        if self.group is None:  # a one-stage pipeline: nothing to move
            return self._unpack(recorder, schema, data)
        known = self._schemas.get(kind)
        if known is not None:
            # [changed, loss, values..., landed] sized by the schema every rank knows: one message per step
            if self.is_src:
                frame = self._frame(known)
                changed = schema != known
                frame[0], frame[-1] = float(changed), 1.0
                if not changed:
                    frame[1:-1] = data
                self._send(frame)
            else:
                frame = self._receive(known)
            if frame[0].item() == 0.0:
                return self._unpack(recorder, known, frame[1:-1])
        # first step of its kind, or the schema changed: the schema as an object, then the values
        box = [schema if self.is_src else None]
        dist.broadcast_object_list(box, self.src, group=self.group, device=self.device)
        known = self._schemas[kind] = box[0]
        if not self.is_src:
            data = torch.zeros(_size(known), dtype=torch.float64, device=self.device)
        dist.broadcast(data, self.src, group=self.group)
        return self._unpack(recorder, known, data)

    def _frame(self, schema: Schema) -> Tensor:
        """[changed, loss, values..., landed]: sized by the schema both ends know."""
        return torch.zeros(2 + _size(schema), dtype=torch.float64, device=self.device)

    def _send(self, frame: Tensor) -> None:
        if self.frames is None:
            dist.broadcast(frame, self.src, group=self.group)
            return
        for work in [dist.isend(frame, peer, group=self.frames) for peer in self.peers]:
            work.wait()

    def _receive(self, schema: Schema) -> Tensor:
        if self.frames is None:
            frame = self._frame(schema)
            dist.broadcast(frame, self.src, group=self.group)
            return frame
        if self._posted is None:  # an exchange without `post`: receive it now
            frame = self._frame(schema)
            dist.recv(frame, self.src, group=self.frames)
            return frame
        frame = self._wait_posted()
        self._posted = None
        return frame

    def _pack(self, recorder: LogRecorder, loss: Any) -> tuple[Schema, Tensor]:
        entries = [(n, kw, kind) for n, (kw, kind) in recorder.options.items()]
        values = [loss] + [recorder.values[n] for n, _, kind in entries if not _is_metric(kind)]
        parts = [torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values])]
        logged = {kind[1] for _, _, kind in entries if _is_metric(kind)}
        sent = recorder.metrics.payload(logged) if recorder.metrics is not None else {}
        for _layout, flat, updates, value in sent.values():
            parts += [torch.tensor([updates, value], dtype=torch.float64, device=self.device), flat.to(self.device)]
        return (entries, [(path, item[0]) for path, item in sent.items()]), torch.cat(parts)

    def _unpack(self, recorder: LogRecorder, schema: Schema, data: Tensor) -> tuple[float, Entries]:
        entries, layouts = schema
        scalars = sum(not _is_metric(kind) for _, _, kind in entries)
        numbers = data[: 1 + scalars].tolist()
        at = 1 + scalars
        metrics = metrics_of(recorder.metrics.module) if recorder.metrics is not None else {}
        for path, layout in layouts:
            size = _numel(layout)
            updates, value = data[at : at + 2].tolist()
            metric = metrics[path]
            merge(metric, unpack(layout, data[at + 2 : at + 2 + size], metric.device), int(updates), value)
            at += 2 + size
        values = iter(numbers[1:])
        out = [(n, metrics[kind[1]] if _is_metric(kind) else next(values), kw, kind) for n, kw, kind in entries]
        return numbers[0], out


# Lightning's advice for epoch-level values logged without sync_dist. With one replica every rank logs the
# last stage's value (above), so there is nothing to accumulate across devices: the advice does not apply.
SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\(.*, \.\.\., sync_dist=True\)` when logging on epoch level"


def silence_sync_dist_advice() -> None:
    """With one replica (every rank logs the same value): Lightning's sync_dist advice, by its exact text."""
    warnings.filterwarnings("ignore", message=SYNC_DIST_ADVICE)


def _is_metric(kind: Kind) -> bool:
    return isinstance(kind, tuple)


def _numel(layout: Layout) -> int:
    return sum(int(torch.Size(shape).numel()) for _, shape, _, _ in layout)


def _size(schema: Schema) -> int:
    entries, layouts = schema
    return 1 + sum(not _is_metric(kind) for _, _, kind in entries) + sum(2 + _numel(layout) for _, layout in layouts)


def replay(log: Callable[..., None], entries: Entries, device: torch.device, sync: bool = False) -> None:
    """Log `entries` with `log` (the module's real ``log``). `sync`: evaluation with several pipelines,
    each over its shard of the data: the logged value is the mean over the pipelines (``sync_dist=True``
    unless the user chose otherwise). A Metric syncs itself at compute() (over its stage's ranks,
    `metric_state.attach`)."""
    for name, value, options, kind in entries:
        if _is_metric(kind):
            log(name, value, **options)
            continue
        if sync:
            options = {"sync_dist": True, **options}
        log(name, torch.tensor(value, dtype=kind, device=device) if kind is not None else value, **options)
