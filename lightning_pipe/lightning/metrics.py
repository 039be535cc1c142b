"""The metrics people read: throughput and MFU once per pipeline, each stage's peak memory and bubble.

`PipelineMetrics` is Lightning's `ThroughputMonitor` (lightning.fabric.utilities.throughput underneath)
with a pipeline's counts. Lightning assumes data parallelism: every process handles a batch of its
own, so it multiplies rank 0's rates by the world size. Under a pipeline the P stages of one
pipeline handle ONE batch per step together; the data-parallel replicas are the pipelines
(``width``, AvgPipe's ``pipelines``), so the rates are multiplied by that instead. For MFU, the
FLOPs of a step are the whole model's (every stage's), and the FLOP/s available to one pipeline are
P devices' worth:

    samples_per_sec = replicas x samples / s of rank 0's pipeline       (not x world size)
    flops_per_sec   = replicas x whole-model FLOPs per batch / s
    device/mfu      = flops_per_sec / (world size x peak FLOP/s of one device)

The FLOPs per batch are the module's ``flops_per_batch`` when it has one (Lightning's convention:
the whole model's, e.g. from ``measure_flops`` on the meta device), else ``flops_per_batch=`` given
here, else measured: during the second training step every rank counts its own stage's FLOPs
(``torch.utils.flop_counter.FlopCounterMode``, forward and backward of all micro-batches) and the
first log interval after it sums them over the stages. A device's peak FLOP/s is Lightning's table
(``get_available_flops``: CUDA and TPU chips it knows) or ``peak_flops=``; on a CPU it is unknown,
so MFU is only logged where the peak is known or given.

Per stage, every log interval (``trainer.log_every_n_steps``):

- ``stage{i}/peak_memory_mb``: the rank's peak memory (``torch.cuda.max_memory_allocated`` on a GPU;
  the process's peak RSS, ``resource.getrusage``, on a CPU);
- ``stage{i}/bubble``: the share of the pipeline's step the rank spent not computing, 1 - busy /
  step, over the steps since the last log (the simulator's idle / iteration time). Busy is the
  rank's compute time, measured by the executor (``Executor.meter``: host time around each forward
  and backward on a CPU, CUDA events on a GPU, nothing synchronised during the step). The step is
  the pipeline's: the longest span from a rank's first compute to its last, which is the first
  stage's (it runs the first forward and the last backward); waiting for inputs and gradients, the
  fill and the drain, messages and the host's work between computes are idle. ``bubble`` is the
  mean over the stages. (Not measured while AutoPipe-RL's monitor owns the executor's meter.)

The per-rank numbers reach the logging rank by one `gather` of a few floats per log interval (no
collective in the other steps); Lightning's loggers write on global rank 0 only, so each value is
logged once. Stages replicated ``width`` times report the largest memory and the mean bubble.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..adaptive.meter import StepMeter
from .strategy import AutoPipeStrategy


def samples(batch: Any) -> int:
    """Rows of a batch's first tensor."""
    first = _first_tensor(batch)
    return int(first.shape[0]) if first is not None else 0


def tokens(batch: Any) -> Optional[int]:
    """Tokens of a batch of token ids (its first tensor, integer, [batch, length, ...]: batch x length), else None."""
    first = _first_tensor(batch)
    if first is None or first.dim() < 2 or first.dtype.is_floating_point or first.dtype == torch.bool:
        return None
    return int(first.shape[0] * first.shape[1])


def _first_tensor(batch: Any) -> Optional[Tensor]:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch:
        return _first_tensor(batch[0])
    if isinstance(batch, dict) and batch:
        return _first_tensor(next(iter(batch.values())))
    return None


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory so far: allocated on its GPU, else its peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


class _BusyMeter(StepMeter):
    """The executor's meter, reduced to compute: busy time and the span from the first compute's start
    to the last one's end (messages are not recorded)."""

    def reset(self) -> None:
        super().reset()
        self._first: Any = None  # the first compute's start (perf_counter, or a CUDA event)
        self._last = 0.0

    def start(self) -> Any:
        token = super().start()
        if self._first is None:
            self._first = token
        return token

    def stop(self, token: Any, forward: bool) -> None:
        super().stop(token, forward)
        if not self.cuda:
            self._last = time.perf_counter()

    def sent(self, owners: list[int], ops: list[Any]) -> None:
        pass  # the bubble counts compute only: messages are not recorded (StepMeter's would keep events per send)

    def waiting(self, pending: Any) -> None:
        pass  # nor waits

    def busy_and_span(self) -> Optional[tuple[float, float]]:
        """(compute seconds, seconds from the first compute's start to the last one's end); None if nothing ran."""
        if self._first is None:
            return None
        if self.cuda:  # before finish() reads (and drops) the events
            last = self._events[-1][1]
            last.synchronize()
            span = self._first.elapsed_time(last) / 1e3
        else:
            span = self._last - self._first
        forward, backward, _ = self.finish()
        return forward + backward, span


class PipelineMetrics(ThroughputMonitor):
    """Throughput (samples, tokens, FLOPs per second, MFU) counted once per pipeline, and each stage's
    peak memory and bubble share, logged every log interval (see the module docstring).

    Args:
        batch_size_fn: samples in a batch (default: rows of its first tensor).
        length_fn: tokens in a batch, logged as ``tokens_per_sec`` (default: batch x length of a batch
            of token ids; None for other batches, and then no token rate is logged).
        peak_flops: FLOP/s of one device, for MFU where Lightning does not know the device (a CPU).
        flops_per_batch: the whole model's FLOPs per batch (forward + backward), if the module has no
            ``flops_per_batch``; None: measured in the second training step (``measure_flops=False``: not).
        window_size: steps in the rolling average of the rates (Lightning's default is 100).
        stage_metrics: log ``stage{i}/peak_memory_mb`` and ``stage{i}/bubble``.
    """

    def __init__(
        self,
        batch_size_fn: Optional[Callable[[Any], int]] = None,
        length_fn: Optional[Callable[[Any], Optional[int]]] = tokens,
        peak_flops: Optional[float] = None,
        flops_per_batch: Optional[float] = None,
        measure_flops: bool = True,
        window_size: int = 20,
        stage_metrics: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(batch_size_fn or samples, length_fn, window_size=window_size, **kwargs)
        self.peak_flops, self.flops_per_batch, self.measure_flops = peak_flops, flops_per_batch, measure_flops
        self.stage_metrics = stage_metrics
        self.replicas, self.depth = 1, 1
        self._said_no_peak = False
        self._meter: Optional[_BusyMeter] = None
        self._transport: Optional[Any] = None
        self._counter: Optional[Any] = None  # the FlopCounterMode of the measured step
        self._my_flops: Optional[float] = None  # this rank's FLOPs in the measured step, until gathered
        self._busy = self._span = 0.0  # since the last log
        self._batches_started = 0  # in this fit

    # ---- the pipeline's shape (known once the strategy is set up) ---------------------------------
    def _shape(self, trainer: Any) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, AutoPipeStrategy) and strategy.topology is not None:
            self.replicas, self.depth = strategy.topology.width, strategy.topology.depth
        else:  # any other strategy: Lightning's data-parallel view, one "stage"
            self.replicas, self.depth = trainer.world_size, 1

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.peak_flops is not None:
            self.available_flops = self.peak_flops

    def _start(self, trainer: Any) -> None:
        self._shape(trainer)
        for throughput in self._throughputs.values():
            throughput.world_size = self.replicas  # a "device" of Throughput's is one pipeline
            throughput.available_flops = self.available_flops * self.depth if self.available_flops else None
        if self.available_flops is None and not self._said_no_peak:
            self._said_no_peak = True
            device = trainer.strategy.root_device
            rank_zero_info(
                f"PipelineMetrics: the peak FLOP/s of a {device.type} device is unknown to Lightning, so no MFU is logged "
                "(give it as peak_flops=..., on the CLI callbacks.metrics.peak_flops=...)"
            )
        super()._start(trainer)

    # ---- throughput on rank 0 (ThroughputMonitor's hooks call these) -------------------------------
    @torch.inference_mode()
    def _update(self, trainer: Any, pl_module: Any, batch: Any, iter_num: int) -> None:
        stage = trainer.state.stage
        throughput = self._throughputs[stage]
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # as Lightning's: perf_counter after the device's work
        elapsed = time.perf_counter() - self._t0s[stage]
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        length = self.length_fn(batch) if self.length_fn is not None else None
        if length is None:
            self.length_fn = None  # not token ids: no token rate (Throughput wants lengths always or never)
        else:
            self._lengths[stage] += length
        flops = getattr(pl_module, "flops_per_batch", None) or self.flops_per_batch
        throughput.update(
            time=elapsed,
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=self._lengths[stage] if self.length_fn is not None else None,
            flops=flops if stage == RunningStage.TRAINING else None,  # a training step's: forward and backward
        )

    def _compute(self, trainer: Any, iter_num: Optional[int] = None) -> None:
        if not trainer._logger_connector.should_update_logs:
            return
        stage = trainer.state.stage
        throughput = self._throughputs[stage]
        metrics = pipeline_rates(throughput.compute(), self.replicas, self.depth)
        metrics = {f"{stage.value}{throughput.separator}{k}": v for k, v in metrics.items()}
        trainer._logger_connector.log_metrics(metrics, step=iter_num)

    # ---- every rank: the step's compute, the measured FLOPs, the gather at the log interval ----------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._batches_started = 0
        self._busy = self._span = 0.0
        super().on_train_start(trainer, pl_module)  # rank 0: the rates' clock

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        if self.stage_metrics and isinstance(strategy, AutoPipeStrategy) and strategy.layers is not None:
            transport = strategy.layers.runner.transport
            if transport.meter is None:  # (AutoPipe-RL's monitor puts its own there during the step when it is on)
                self._meter = self._meter or _BusyMeter(strategy.root_device)
                self._meter.reset()
                transport.meter, self._transport = self._meter, transport
        self._batches_started += 1
        if self._batches_started == 2 and self._wants_flops(pl_module):  # the 2nd: 2BW's first step has no backward
            self._counter = FlopCount()
            self._counter.__enter__()

    def _wants_flops(self, pl_module: Any) -> bool:
        return self.measure_flops and self.flops_per_batch is None and getattr(pl_module, "flops_per_batch", None) is None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._my_flops, self._counter = float(self._counter.total), None
        transport, self._transport = self._transport, None
        if transport is not None and transport.meter is self._meter:
            transport.meter = None
            measured = self._meter.busy_and_span()
            if measured is not None:
                self._busy += measured[0]
                self._span += measured[1]
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # rank 0: the rates (before the gather waits)
        every = trainer.log_every_n_steps
        stepped = not trainer.fit_loop._should_accumulate()  # (with accumulation, the batch that steps)
        if every and stepped and (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0:  # Lightning's log steps
            self._gather_and_log(trainer)  # alike on every rank

    def _gather_and_log(self, trainer: Any) -> None:
        strategy = trainer.strategy
        rank = trainer.global_rank
        topology = strategy.topology if isinstance(strategy, AutoPipeStrategy) else None
        where = (topology.stage_of(rank), topology.replica_of(rank)) if topology is not None else (0, rank)
        flops = self._my_flops if self._my_flops is not None else -1.0
        mine = [*where, peak_memory_mb(strategy.root_device), self._busy, self._span, flops]
        self._busy = self._span = 0.0
        self._my_flops = None  # sent
        rows = _gather(torch.tensor(mine, dtype=torch.float64, device=strategy.root_device), rank)
        if rows is None:  # not the logging rank
            return
        if self.flops_per_batch is None and all(r[5] >= 0 for r in rows):
            self.flops_per_batch = sum(r[5] for r in rows) / self.replicas  # every stage's: one pipeline's batch
        metrics = stage_summary(rows) if self.stage_metrics else {}
        if metrics:
            trainer._logger_connector.log_metrics(metrics)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        if self._transport is not None and self._transport.meter is self._meter:
            self._transport.meter = None
        self._transport = None


def _gather(row: Tensor, rank: int) -> Optional[list[list[float]]]:
    """Every rank's row on global rank 0 (one gather); None on the other ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [row.tolist()]
    if dist.get_backend() == "gloo":
        row = row.cpu()  # gloo gathers host tensors (the world is gloo when pipelines share GPUs)
    out = [torch.empty_like(row) for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather(row, out, dst=0)
    return [t.tolist() for t in out] if out is not None else None


def stage_summary(rows: list[list[float]]) -> dict[str, float]:
    """From every rank's [stage, replica, memory MB, busy s, span s, ...]: ``stage{i}/peak_memory_mb`` (the
    largest over the stage's replicas), ``stage{i}/bubble`` (1 - busy / the pipeline's step, the longest
    span of its ranks; the mean over the replicas) and ``bubble`` (the mean over the stages)."""
    step: dict[int, float] = {}
    for r in rows:
        step[int(r[1])] = max(step.get(int(r[1]), 0.0), r[4])
    out: dict[str, float] = {}
    bubbles = []
    for s in sorted({int(r[0]) for r in rows}):
        mine = [r for r in rows if int(r[0]) == s]
        out[f"stage{s}/peak_memory_mb"] = max(r[2] for r in mine)
        shares = [min(1.0, max(0.0, 1.0 - r[3] / step[int(r[1])])) for r in mine if step[int(r[1])] > 0]
        if shares:
            out[f"stage{s}/bubble"] = sum(shares) / len(shares)
            bubbles.append(out[f"stage{s}/bubble"])
    if bubbles:
        out["bubble"] = sum(bubbles) / len(bubbles)
    return out


class FlopCount(TorchDispatchMode):
    """FLOPs of every op run inside it, by torch's FLOP formulas (`torch.utils.flop_counter`).
    FlopCounterMode itself also tracks modules with hooks on their inputs and outputs, which a split
    backward's `autograd.grad(inputs=...)` refuses (zero-bubble's BI); the total needs no module."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def pipeline_rates(metrics: dict[str, float], replicas: int, depth: int) -> dict[str, float]:
    """Lightning's `Throughput.compute()` of a Throughput whose world size is the replica count and whose
    "device" is one pipeline, renamed: the all-replica rates (also with one replica, where Lightning
    leaves them out), tokens for items, per-device FLOP/s and MFU over the world's devices."""
    out = {k: v for k, v in metrics.items() if k in ("time", "batches", "samples")}
    if "lengths" in metrics:
        out["tokens"] = metrics["lengths"]
    for name, key in (("batches_per_sec", "batches_per_sec"), ("samples_per_sec", "samples_per_sec"), ("items_per_sec", "tokens_per_sec")):
        per_pipeline = metrics.get(f"device/{name}")
        if per_pipeline is not None:
            out[key] = metrics.get(name, per_pipeline * replicas)
    per_pipeline_flops = metrics.get("device/flops_per_sec")
    if per_pipeline_flops is not None:
        out["flops_per_sec"] = per_pipeline_flops * replicas
        out["device/flops_per_sec"] = per_pipeline_flops / depth
    if "device/mfu" in metrics:
        out["device/mfu"] = metrics["device/mfu"]  # per pipeline / (depth x peak): every device's mean utilisation
    return out
