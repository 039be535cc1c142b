"""Pieces of the pipeline benchmarks that measure our runtime on real processes and simulate it
(bench_updates, bench_waves, bench_advance, bench_emulated, bench_memory, bench_simulator): the
emulated device that sleeps, the link and block profile as the simulator gets them, a rank's chunks
and layer, the clocks around the executor, timed training steps and their spans over the ranks."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``t_f`` and whose backward sleeps ``t_b`` seconds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        ctx.t_b = t_b
        if t_f > 0:
            time.sleep(t_f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.t_b > 0:
            time.sleep(ctx.t_b)
        return grad, None, None


class SleepBlock(nn.Module):
    """An emulated device's stage: ``sleep(x * scale + bias)``; real parameters, real gradients
    (a GPU leaves its host idle while it computes: the sleep is that time)."""

    def __init__(self, width: int, t_f: float, t_b: float):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale + self.bias, self.t_f, self.t_b)


def sleep_model(depth: int, width: int, t_f: float, t_b: float) -> nn.Sequential:
    """``depth`` SleepBlocks (seed 0), each one's scale nudged so that every stage's weights differ
    (a final-weights check then tells the stages apart)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[SleepBlock(width, t_f, t_b) for _ in range(depth)])
    with torch.no_grad():
        for block in model:
            block.scale.add_(0.1 * torch.randn(width))
    return model


def best_link(rank: int, sizes: Sequence[int], rounds: int = 3, repeats: int = 50) -> dict | None:
    """The link fit (ping_pong) of the fastest of ``rounds`` rounds, on rank 0 (None elsewhere).
    Even a quiet ping-pong has phases of ms stalls; the fastest round is the link without them."""
    from lightning_pipe.profiling.link import ping_pong

    measured = [ping_pong(rank, sizes=tuple(sizes), repeats=repeats) for _ in range(rounds)]
    return min(measured, key=lambda r: r["samples"][-1][1]) if rank == 0 else None


def gather(value: Any, world: int) -> list:
    """``value`` of every rank (all_gather_object), in rank order."""
    parts: list = [None] * world
    dist.all_gather_object(parts, value)
    return parts


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (broadcast_object_list)."""
    box = [value]
    dist.broadcast_object_list(box, 0)
    return box[0]


def chunk_pipeline(model: nn.Sequential, schedule: Any, bounds: Sequence[tuple[int, int]], rank: int, transport: Any, loss, lr: float):
    """This rank's chunks of ``model`` (cut at ``bounds``, placed by ``schedule``), a SequentialPipeline
    running them, and their SGD."""
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline

    chunks = {c: model[slice(*bounds[c])] for c in schedule.chunks_of(rank)}
    pipe = SequentialPipeline(schedule, rank, SequentialHost(chunks, schedule.num_chunks - 1, loss), transport)
    return chunks, pipe, torch.optim.SGD([p for c in chunks.values() for p in c.parameters()], lr=lr)


TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")  # torch.distributed.pipelining's: one stage per rank, then two


def torch_stages(model: nn.Sequential, name: str, world: int, rank: int, m: int, example: torch.Tensor, loss: Callable) -> tuple:
    """torch.distributed.pipelining's schedule `name` (`TORCH_SCHEDULES`) over ``model`` cut into equal
    stages on `world` ranks: one per rank (gpipe, 1f1b), else two, interleaved (r and r + world) or a V
    (zbv: r and 2 world - 1 - r); ``example``: one micro-batch, the static shape and dtype of every
    stage boundary (no shape inference). Returns ``run(x, y)`` (one step of m micro-batches) and the
    indices of this rank's blocks."""
    from torch.distributed import pipelining as tp

    kinds = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B, "interleaved": tp.ScheduleInterleaved1F1B, "zbv": tp.ScheduleZBVZeroBubble}
    n = world if name in ("gpipe", "1f1b") else 2 * world
    bounds = equal_bounds(len(model), n)
    mine = [rank] if n == world else sorted([rank, rank + world] if name == "interleaved" else [rank, n - 1 - rank])
    shape = lambda grad: (torch.empty_like(example).requires_grad_(grad),)  # noqa: E731
    stages = [
        tp.PipelineStage(model[slice(*bounds[s])], s, n, example.device, input_args=shape(s > 0), output_args=shape(True)) for s in mine
    ]
    schedule = kinds[name](stages[0] if n == world else stages, m, loss_fn=loss)  # scale_grads: as ours
    run = lambda x, y: schedule.step(*((x,) if 0 in mine else ()), return_outputs=False, **({"target": y} if n - 1 in mine else {}))  # noqa: E731
    return run, {i for s in mine for i in range(*bounds[s])}


def median_costs(parts: list[dict], link: dict, name: str = "bench", fold_loss: bool = False, messages: dict | None = None):
    """A CostModel from per-rank block profiles: each block's median over the ranks; with
    ``fold_loss`` the last profiled block is the loss, added to the block before it. Returns the
    costs, and with ``fold_loss`` also the loss's (forward, backward)."""
    from lightning_pipe.profiling import Profile

    n = len(parts[0])
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(n)]  # noqa: E731
    fwd, bwd, acts, params = field("forward"), field("backward"), field("activation_bytes"), field("param_bytes")
    loss = None
    if fold_loss:
        loss = (fwd.pop(), bwd.pop())
        fwd[-1] += loss[0]
        bwd[-1] += loss[1]
        acts, params = acts[:-1], params[:-1]
    profile = Profile(name, 0, "float32", "cpu", fwd, bwd, acts, params)
    if messages is not None:
        profile.messages = messages
    costs = profile.costs(link["bandwidth"], link["latency"])
    return (costs, loss) if fold_loss else costs


def equal_bounds(blocks: int, parts: int) -> list[tuple[int, int]]:
    per = blocks // parts
    return [(r * per, (r + 1) * per) for r in range(parts)]


class Clock(dict):
    """Seconds spent in wrapped calls, by key (reset per step with `zero`)."""

    def zero(self) -> None:
        for key in self:
            self[key] = 0.0

    def wrap(self, fn: Callable, key: str) -> Callable:
        self.setdefault(key, 0.0)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self[key] += time.perf_counter() - t

        return timed


def time_executor(clock: Clock, key: str = "executor") -> None:
    """Count the time inside ``Executor.run`` (this process only) in ``clock[key]``: what the
    layers around it spend is the rest."""
    from lightning_pipe.runtime.executor import Executor

    Executor.run = clock.wrap(Executor.run, key)


def compute_seconds(executor: Any) -> float:
    """The traced executor's time in forward / backward actions."""
    return sum(e - s for j, s, e in executor.records if executor.actions[j].op.is_compute)


def profile_job(rank: int, world: int, blocks: list, x, y, rows: Sequence[int], link_sizes: Sequence[int], loss_fn, repeats: int) -> dict:
    """A `bench.run` job: the link (`best_link` at ``link_sizes``) and every block profiled at each
    of ``rows`` rows per micro-batch (the loss after the last), the ranks profiling at once."""
    from lightning_pipe.profiling import profile_blocks

    link, measured = best_link(rank, link_sizes), {}
    for r in rows:
        dist.barrier()
        loss = lambda out, r=r: loss_fn(out, y[:r])  # noqa: E731
        measured[r] = profile_blocks(blocks, x[:r], torch.device("cpu"), repeats=repeats, warmup=3, loss_fn=loss)
    return {"timing": [1.0, 1.0], "params": {}, "link": link, "blocks": gather(measured, world)}


def costs_at(prof: dict, rows: int, name: str = "bench"):
    """The CostModel of a `profile_job`'s blocks at ``rows`` rows per micro-batch."""
    return median_costs([p[rows] for p in prof["blocks"]], prof["link"], name)


def schedule_layer(name: str, world: int, m: int, rank: int, transport: Any, chunk: Any, update: Callable, **kw: Any) -> Any:
    """The pipeline layer running schedule ``name`` on this rank: DoubleBuffer for 2BW (``update``: a
    drain's optimizer step, what the caller's own step does), Flush for the flushing schedules."""
    from lightning_pipe.modes.flush.engine import Flush
    from lightning_pipe.modes.two_bw.engine import DoubleBuffer
    from lightning_pipe.schedules import ScheduleSpec

    if name == "2bw":
        return DoubleBuffer(ScheduleSpec.of(name), world, m, rank, transport, chunk, update, **kw)
    return Flush(ScheduleSpec.of(name), world, m, rank, transport, **kw)


def run_layer(layer: Any, host: Any, x: torch.Tensor, y: torch.Tensor, m: int) -> Any:
    """One training run of a pipeline layer (Flush, DoubleBuffer, ...) on (x, y) in ``m``
    micro-batches through a SequentialHost; the traced executor."""
    from lightning_pipe.runtime.microbatch import signature, split_microbatches

    host.inputs, host.weights = split_microbatches(x, m)
    host.targets, _ = split_microbatches(y, m)
    host.losses = []
    return layer.run("train", host, [("train", signature(mb)) for mb in host.inputs])


def pipeline_steps(pipe: Any, opt: Any, x: Any, y: Any, count: int, after: Callable | None = None) -> list[tuple[float, float, float]]:
    """``count`` training steps of a SequentialPipeline, each after a barrier: (start, pipeline end,
    step end) in perf_counter seconds, one clock for every process; ``after`` runs between the
    pipeline and the optimizer step (the tied weights' all-reduce)."""
    out = []
    for _ in range(count):
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, y)
        t1 = time.perf_counter()
        if after is not None:
            after()
        opt.step()
        out.append((t0, t1, time.perf_counter()))
    return out


def spans(per_rank: Sequence[Sequence[tuple]]) -> tuple[list[float], list[float]]:
    """Per step index, from every rank's `pipeline_steps`: the pipeline iteration (first start to last
    pipeline end) and the training step (first start to last step end)."""
    steps = [(min(t[0] for t in s), max(t[1] for t in s), max(t[2] for t in s)) for s in zip(*per_rank)]
    return [e - t for t, e, _ in steps], [e - t for t, _, e in steps]


def best_runs(configs: Sequence[Any], rounds: int, one: Callable[[Any, int], dict], score: str, worst: str) -> list[dict]:
    """Every config in interleaved rounds (``one(config, round)`` -> its figures); per config its
    run with the highest ``score``, with ``worst`` (where there is one) the largest over its runs."""
    from .bench import interleave

    out = []
    for runs in interleave(configs, rounds, one):
        best = max(runs, key=lambda st: st[score])
        if best.get(worst) is not None:
            best[worst] = max(st[worst] for st in runs)
        out.append(best)
    return out
