"""Peak memory per stage against the prediction: on real processes (default) or per rank of a CLI run (--ranks).

Default: GPipe, 1F1B and PipeDream-2BW train the residual MLP on d = 2, 4 gloo processes at m = d,
4d; saved tensors, stash, communication buffers and weights per stage against simulate(). ``--ranks``:
one CLI step of a paper-size recipe on CPU, every process's peak memory against the planners' memory
model. Feeds docs/results/memory.md (method there).

    python -m benchmarks.bench_memory
    python -m benchmarks.bench_memory --no-prefetch   # Executor(prefetch=False)
    python -m benchmarks.bench_memory --ranks --runs gpt2-345m:2:32-true --init empty,full --checkpoint full,sharded
    python -m benchmarks.bench_memory [--ranks] --quick  # smoke: d = 2 only; gpt-tiny-cpu on 2 ranks
    python -m benchmarks.bench_memory --ranks --checkpoint none \
        --runs gpt2-345m:4:32-true:width=2+data.batch_size=4,gpt2-345m:4:32-true:width=2+shard=optimizer+data.batch_size=4
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.bench import Bench, Table, column_table, names
from benchmarks.harness.launch import run_distributed
from benchmarks.harness.mlp import loss_fn, make_data, make_model
from benchmarks.harness.pipes import equal_bounds, run_layer, schedule_layer
from benchmarks.harness.rss import run_sampled
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.two_bw import pipedream_2bw
from lightning_pipe.simulation import CostModel, simulate
from lightning_pipe.topology import Topology

SCHEDULES = ["gpipe", "1f1b", "2bw"]
KiB, GiB = 1024.0, 2.0**30
BATCH, MICRO, SEQ = 2, 2, 128  # --ranks: one step of 2 sequences of 128 tokens in 2 micro-batches


class Ledger:
    """Bytes of storages held for a reason, reference counted by storage data_ptr (a storage saved
    twice, or saved and stashed, counts once); the peak since the last `reset_peak`."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # data_ptr -> [bytes, references]
        self.bytes = self.peak = 0

    def acquire(self, ptr: int, nbytes: int) -> None:
        if ptr in self.live:
            self.live[ptr][1] += 1
            return
        self.live[ptr] = [nbytes, 1]
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.bytes -= entry[0]

    def reset_peak(self) -> None:
        self.peak = self.bytes


class StorageWatch:
    """Bytes of storages alive: each storage is counted from the first time it is seen until torch
    frees it (`weakref.finalize` on the UntypedStorage). `kind` labels why it was first seen; at
    each new peak the bytes by kind of the storages not in `held` (the saved + stash ledger) are
    kept, to say what the excess consisted of; `peak_kind`: the kind whose arrival set the peak."""

    def __init__(self, held: "Ledger | None" = None) -> None:
        self.kind: dict[int, tuple[int, str]] = {}  # data_ptr -> (bytes, kind)
        self.bytes = self.peak = 0
        self.held, self.excess_at_peak, self.peak_kind = held, {}, ""

    def watch(self, t: torch.Tensor, kind: str) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.kind:
            return
        self.kind[ptr] = (nbytes, kind)
        self.bytes += nbytes
        weakref.finalize(storage, self._freed, ptr)
        if self.bytes > self.peak:
            self.peak, self.peak_kind = self.bytes, kind
            if self.held is not None:
                self.excess_at_peak = {}
                for p, (n, k) in self.kind.items():
                    if p not in self.held.live:
                        self.excess_at_peak[k] = self.excess_at_peak.get(k, 0) + n

    def _freed(self, ptr: int) -> None:
        self.bytes -= self.kind.pop(ptr)[0]

    def reset_peak(self) -> None:
        self.peak, self.excess_at_peak = self.bytes, {}


class _Saved:
    """What pack returns for an activation autograd saves: dies when autograd releases it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# transport method -> (kind of what it moves, where the tensors are: "before"/"after" the call in its
# last argument, or "received": the buffers of the pending receive it returns)
TRANSPORT_WATCH = {
    "send_activation": ("activation", "after"),
    "send_gradients": ("gradient sent", "before"),
    "recv_activation": ("activation received", "received"),
    "recv_gradients": ("gradient received", "received"),
}


class Probe:
    """The saved-tensor hooks and the ledgers of one process: `held` (saved by autograd + stashed by
    the executor), `saved` (autograd only), `alive` (the same and communication buffers, until
    freed); `weight_ptrs`: the storages of the parameters the running forward uses."""

    def __init__(self) -> None:
        self.held, self.saved = Ledger(), Ledger()
        self.alive, self.weights = StorageWatch(self.held), StorageWatch()
        self.weight_ptrs: set[int] = set()
        self.in_flight = self.peak_in_flight = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed.tensor if isinstance(packed, _Saved) else packed)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in self.weight_ptrs:
            return t  # a weight (or an empty tensor): not an activation
        holder = _Saved(t)
        for ledger in (self.held, self.saved):
            ledger.acquire(ptr, nbytes)
            weakref.finalize(holder, ledger.release, ptr)
        self.alive.watch(t, "saved")
        return holder

    def use_weights(self, module: nn.Module) -> None:
        self.weight_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def stash(self, out: torch.Tensor, counted: bool) -> None:
        """The executor keeps `out` until this micro-batch's backward (the gradient hook on it)."""
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        ptr = out.untyped_storage().data_ptr()
        if counted:
            self.held.acquire(ptr, out.untyped_storage().nbytes())
            self.alive.watch(out, "activation")

        def backward(grad: torch.Tensor) -> None:
            self.in_flight -= 1
            if counted:
                self.held.release(ptr)

        out.register_hook(backward)

    def reset_peaks(self) -> None:
        for ledger in (self.held, self.saved, self.alive):
            ledger.reset_peak()
        self.peak_in_flight = self.in_flight

    def watch_transport(self, transport) -> None:
        """Count what the transport sends and the buffers it receives into (`TRANSPORT_WATCH`)."""

        def watched(call, kind: str, where: str):
            def run(*args):
                tensors = args[-1] if isinstance(args[-1], (tuple, list)) else (args[-1],)
                [self.alive.watch(t, kind) for t in tensors if where == "before"]
                result = call(*args)
                [self.alive.watch(t, kind) for t in (result[0].buffers if where == "received" else tensors) if where != "before"]
                return result

            return run

        for name, (kind, where) in TRANSPORT_WATCH.items():
            setattr(transport, name, watched(getattr(transport, name), kind, where))


class MeasuredHost(SequentialHost):
    """SequentialHost with each micro-batch's input and target a tensor of its own (not a view
    of the whole batch, which the caller holds anyway) and the executor's stash observed."""

    def __init__(self, probe: Probe, stage: nn.Module, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe, self.stage = probe, stage

    def forward(self, chunk, microbatch, inputs):
        self.probe.use_weights(self.stage)  # under 2BW: the version this batch runs on
        x = self.inputs[microbatch].clone() if chunk == 0 else inputs
        out = self.chunks[chunk](x)
        if chunk != self.last_chunk:
            self.probe.stash(out, counted=True)
            return out
        loss = self.loss_fn(out, self.targets[microbatch].clone())
        self.losses.append(loss.detach() * self.weights[microbatch])
        loss = loss * self.weights[microbatch]
        self.probe.stash(loss, counted=False)  # a scalar: counted in flight, not in bytes
        return loss


def _param_bytes(module: nn.Module) -> int:
    return sum(s.nbytes() for s in {p.untyped_storage().data_ptr(): p.untyped_storage() for p in module.parameters()}.values())


def job(rank: int, world: int, runs: list[tuple[str, int]], cfg: dict) -> list[dict]:
    """Every (schedule, m) of `runs` on this rank's stage, one after the other (one launch per d)."""
    return [(_measure(rank, world, schedule, m, cfg), dist.barrier())[0] for schedule, m in runs]


def _measure(rank: int, world: int, schedule: str, m: int, cfg: dict) -> dict:
    """One stage of a run: warm-up steps, measured steps (and 2BW's drain); the peaks."""
    per, probe = cfg["blocks"] // world, Probe()
    stage = make_model(cfg)[rank * per : (rank + 1) * per]
    host = MeasuredHost(probe, stage, {rank: stage}, world - 1, loss_fn)
    transport = Transport(lambda r: r, torch.device("cpu"))
    probe.watch_transport(transport)
    opt = torch.optim.SGD(stage.parameters(), lr=cfg["lr"])
    for p in stage.parameters():
        probe.weights.watch(p, "live")
    warmup, measured, held = cfg["warmup"], cfg["steps_2bw"] if schedule == "2bw" else cfg["steps"], 0
    apply = lambda: (opt.step(), opt.zero_grad(set_to_none=True))  # 2BW: a drain's update, the caller's optimizer step
    # flushing schedules: what SequentialPipeline runs, Executor(build_schedule(schedule, world, m))
    mode = schedule_layer(schedule, world, m, rank, transport, stage, apply, prefetch=cfg["prefetch"])
    if schedule == "2bw":
        versions = mode.versions
        detach_live, snapshot = versions.detach_live, versions.snapshot
        watch = lambda tensors, kind: [probe.weights.watch(t, kind) for t in tensors]  # noqa: E731
        versions.detach_live = lambda: (detach_live(), watch(versions.live, "detach_live"))[0]
        versions.snapshot = lambda: (stashed := snapshot(), watch(stashed.values(), "snapshot"))[0]
    data = make_data(dict(cfg, batch=cfg["rows"] * m))  # 4 batches, cycled
    with probe.hooks():
        for step in range(warmup + measured):
            x, y = data[step % len(data)]
            if step == warmup:
                probe.reset_peaks()
            opt.zero_grad(set_to_none=True)
            run_layer(mode, host, x, y, m)
            held = max(held, mode.versions_held()) if schedule == "2bw" else 0
            opt.step()
        mode.drain()  # 2BW: the last batch's backwards and update; flushing schedules: nothing
        held = max(held, mode.versions_held()) if schedule == "2bw" else 0
    if probe.held.bytes or probe.in_flight:
        raise RuntimeError(f"rank {rank}: {probe.held.bytes} bytes / {probe.in_flight} micro-batches still held after the run")
    return dict(
        saved=probe.saved.peak, held=probe.held.peak, alive=probe.alive.peak, excess=probe.alive.excess_at_peak,
        in_flight=probe.peak_in_flight, weights=probe.weights.peak, weights_peak_at=probe.weights.peak_kind,
        versions_held=held, param_bytes=_param_bytes(stage),
    )  # fmt: skip


def block_costs(cfg: dict) -> tuple[list[int], list[int], list[int]]:
    """Per block: the bytes its forward saves for one micro-batch (the same hooks), its output's
    bytes (the profiler's activation_bytes) and its parameter bytes."""
    model = make_model(cfg)
    x = torch.randn(cfg["rows"], cfg["hidden"]).requires_grad_()
    saved, output, params = [], [], []
    for block in model:
        probe = Probe()
        probe.use_weights(block)
        with probe.hooks():
            out = block(x)
        saved.append(probe.saved.bytes)
        output.append(out.untyped_storage().nbytes())
        params.append(_param_bytes(block))
        out.sum().backward()
        if probe.saved.bytes:
            raise RuntimeError("the saved-tensor accounting did not return to 0 after backward")
        x = out.detach().requires_grad_()
    return saved, output, params


def kib(n: float) -> str:
    return f"{n / KiB:,.0f}"


KEY = [(k, k) for k in ("schedule", "d", "m", "stage")]
# (header, cell of a stage's row: the measurement plus n, pred, pred_w, pred_out, the simulator's in flight and bytes)
ACTIVATIONS = [
    ("in flight meas/pred", lambda r: f"{r['in_flight']}/{r['n']}"), ("saved + stash KiB", lambda r: kib(r["held"])),
    ("predicted KiB", lambda r: kib(r["pred"])), ("ratio", lambda r: f"{r['held'] / r['pred']:.2f}"),
    ("alive KiB", lambda r: kib(r["alive"])), ("alive / pred", lambda r: f"{r['alive'] / r['pred']:.2f}"),
    ("excess of alive at its peak (KiB)", lambda r: ", ".join(f"{k} {kib(v)}" for k, v in sorted(r["excess"].items())) or "-"),
    ("pred (output bytes) KiB", lambda r: kib(r["pred_out"])),
]  # fmt: skip
WEIGHTS = [
    ("weights measured KiB", lambda r: kib(r["weights"])),
    ("versions_held() max", lambda r: str(r["versions_held"]) if r["schedule"] == "2bw" else "-"),
    ("measured peak set by", lambda r: r["weights_peak_at"]), ("predicted KiB", lambda r: kib(r["pred_w"])),
    ("ratio", lambda r: f"{r['weights'] / r['pred_w']:.2f}"),
]  # fmt: skip


def cli_step(model: str, ranks: int, precision: str, init: str, checkpoint: str, timeout: float, pipeline: str = "") -> dict:
    """One step of the CLI, its process tree sampled: peak (rss, anon) of each rank and of the other processes.
    `pipeline`: further settings, "name=value+name=value": pipeline.<name>, or as written where the name has a dot
    (e.g. width=2+shard=optimizer+data.batch_size=4)."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "lightning_pipe.train", f"recipe={model}", "trainer=cpu", "partition=autopipe",
                   "schedule=1f1b", f"trainer.devices={ranks}", f"trainer.precision={precision}", "trainer.max_steps=1",
                   "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "data.synthetic=true", f"data.batch_size={BATCH}",
                   f"data.seq_len={SEQ}", f"pipeline.microbatches={MICRO}", f"empty_init={init == 'empty'}", f"hydra.run.dir={out}",
                   *(["callbacks=none"] if checkpoint == "none" else [f"pipeline.checkpoint={checkpoint}"]),
                   *(s if "." in s.split("=")[0] else f"pipeline.{s}" for s in pipeline.split("+") if s)]  # fmt: skip
        rc, peaks, tail = run_sampled(command, timeout=timeout)
        plan = next(Path(out).rglob("plan.json"), None)  # the run's own prediction: the memory model on its profile
        planned = json.loads(plan.read_text()) if plan else {}
        prediction = planned.get("predicted_memory_bytes")
        schedule = [planned.get("schedule"), planned.get("options")] if plan else None  # what ran (schedule=auto: its choice)
    if rc != 0:
        said = [line for line in tail.splitlines() if line.startswith("error:")]
        raise RuntimeError(f"exit {rc}: {said[-1] if said else tail.splitlines()[-1:]}")
    # rank 0 is the command itself; Lightning starts the other ranks as its children; the rest are helpers
    root = peaks[0]
    ranked = {0: root, **{p.rank: p for p in peaks if p.parent == root.pid and p.rank is not None and "lightning_pipe.train" in p.command}}
    helpers = [p for p in peaks if p not in ranked.values()]
    started_by = {p.pid: r for r, p in ranked.items()}
    return {
        "ranks": {r: (p.rss, p.anon) for r, p in sorted(ranked.items())},
        "predicted": prediction,
        "schedule": schedule,
        "helpers": [(started_by.get(p.parent, "?"), p.command[:80], p.rss, p.anon) for p in helpers],
    }


def _setting(pipeline: str, name: str, default: object) -> object:
    """A pipeline setting of a run's spec ("width=2+tensor=2+data.batch_size=4"), else `default`."""
    found = dict(s.split("=", 1) for s in pipeline.split("+") if s)
    return found.get(name, default)


def rank_peaks(bench: Bench, args) -> None:
    _, idle, _ = run_sampled([sys.executable, "-c", "import time, lightning_pipe.cli.train; time.sleep(1)"])
    runtime = idle[0].anon
    bench.say(f"runtime (a process that imported the CLI): {runtime / GiB:.2f} GiB anonymous memory")
    columns = ("predicted GiB", "of which runtime GiB", "peak anon GiB", "peak rss GiB", "anon / predicted")
    table = Table("model", "ranks", "pipeline", "precision", "init", "checkpoint", "rank", *columns)
    for spec in names(args.runs):
        model, ranks, precision, *more = spec.split(":", 3)
        ranks, pipeline = int(ranks), (more[0] if more else "")
        for init in names(args.init):
            for checkpoint in names(args.checkpoint):
                bench.log(f"{model} x{ranks} {precision} init={init} checkpoint={checkpoint} ...")
                try:
                    result = cli_step(model, ranks, precision, init, checkpoint, args.timeout, pipeline)
                except RuntimeError as err:
                    bench.say(f"- {model} x{ranks} {precision} init={init} checkpoint={checkpoint}: failed: {str(err).splitlines()[0]}")
                    continue
                bench.keep(f"{spec}:{init}:{checkpoint}", result)
                own = result["predicted"]["runtime_bytes"]  # what the run measured and planned with
                per_stage = result["predicted"]["per_rank"]  # one entry per stage
                grid = Topology(ranks, int(_setting(pipeline, "width", 1)), tensor=int(_setting(pipeline, "tensor", 1)))
                for rank, (rss, anon) in result["ranks"].items():
                    pred = per_stage[grid.stage_of(rank)]
                    figures, ratios = (pred / GiB, own / GiB, anon / GiB, rss / GiB), (anon / pred,)
                    table.add(
                        model,
                        ranks,
                        pipeline.replace("+", " ") or "-",
                        precision,
                        init,
                        checkpoint,
                        rank,
                        *(f"{v:.2f}" for v in figures),
                        *(f"{v:.2f}x" for v in ratios),
                    )
                if result["helpers"]:  # the data-loader workers, forked from the ranks: their pages are mostly the rank's
                    most = max(anon for *_, anon in result["helpers"])
                    bench.say(
                        f"- {spec} init={init} checkpoint={checkpoint}: {len(result['helpers'])} other processes, at most {most / GiB:.2f} GiB anon"
                    )
    bench.table(table, "Peak memory per rank, one step (CPU)")


def main() -> None:
    bench = Bench(__doc__, {"stages": [2], "steps_2bw": 2, "runs": "gpt-tiny-cpu:2:32-true"}, threads=1, steps=2, warmup=1, timeout=None)
    bench.options(hidden=256, mlp_ratio=(2, "inner width of a block = hidden * mlp_ratio"), blocks=(8, "divisible by every d"), lr=1e-3)
    bench.options(rows=(32, "rows per micro-batch"), stages=([2, 4], "d values"), schedules=SCHEDULES, steps_2bw=(4, "2BW: then a drain"))
    bench.options(no_prefetch=(False, "the executor posts each receive when it is due (prefetch=False)"))
    runs = "gpt2-345m:2:32-true,gpt2-345m:2:bf16-true,gpt2-345m:4:32-true,gpt2-345m:4:bf16-true,gpt2-1.3b:4:bf16-true,gpt2-1.3b:4:32-true"
    bench.options(
        ranks=(False, "per rank of CLI runs (timeout per run 1800 s)"),
        runs=(runs, "--ranks: model:ranks:precision[:setting=value+...], ... (settings: pipeline.<setting>)"),
    )
    bench.options(init=("empty", "--ranks: empty (each rank creates its stage), full (every rank builds the model), or both"))
    bench.options(checkpoint=("full", "--ranks: the checkpoint at the end: full, sharded, none (callbacks=none)"))
    args = bench.parse()
    args.timeout = args.timeout or (1800.0 if args.ranks else 240.0)  # default: a CLI run's, or a process group's
    if args.ranks:
        rank_peaks(bench, args)
        return bench.finish()
    if any(args.blocks % d for d in args.stages) or any(s not in SCHEDULES for s in args.schedules):
        bench.error(f"--blocks must be divisible by every d, and schedules in {SCHEDULES}")
    cfg = {k: getattr(args, k) for k in ("hidden", "mlp_ratio", "blocks", "rows", "warmup", "steps", "steps_2bw", "lr")}
    cfg["prefetch"] = not args.no_prefetch
    bench.say(f"1 thread per process, gloo; config: {cfg}")
    saved, output, params = block_costs(cfg)
    bench.say(f"per block, one micro-batch: saves {kib(saved[0])} KiB, outputs {kib(output[0])} KiB, parameters {kib(params[0])} KiB")
    costs = [
        CostModel.uniform(args.blocks, 1.0, 2.0, activation_bytes=tuple(map(float, a)), param_bytes=tuple(map(float, params)))
        for a in (saved, output)
    ]
    started, results, rows = time.monotonic(), {}, []
    for d in args.stages:
        runs, t0 = [(schedule, m) for schedule in args.schedules for m in (d, 4 * d)], time.monotonic()
        per_rank = run_distributed(job, d, runs, cfg, timeout=args.timeout)
        bench.log(f"d={d}: {len(runs)} runs in {time.monotonic() - t0:.1f} s")
        results[d] = {run: [r[i] for r in per_rank] for i, run in enumerate(runs)}
        bench.keep(f"d={d}", {f"{s} m={m}": stages for (s, m), stages in results[d].items()})
    for d, runs in results.items():
        for (schedule, m), stages in runs.items():  # the prediction: the same schedule (2BW: as many batches) simulated
            sched = pipedream_2bw(d, m, batches=cfg["warmup"] + cfg["steps_2bw"]) if schedule == "2bw" else build_schedule(schedule, d, m)
            t, t_out = (simulate(sched, c, equal_bounds(cfg["blocks"], d), critical_path=False) for c in costs)
            for s, r in enumerate(stages):
                if r["saved"] > r["held"]:
                    raise RuntimeError("saved > saved + stash: the accounting is wrong")
                rows.append(dict(r, schedule=schedule, d=d, m=m, stage=s, n=t.peak_activations[s], pred=t.peak_activation_bytes[s]))
                rows[-1].update(pred_w=t.weight_bytes[s], pred_out=t_out.peak_activation_bytes[s])
    bench.say(f"\n{len(rows)} stage rows in {time.monotonic() - started:.0f} s\n")
    bench.table(column_table(KEY + ACTIVATIONS, rows, "llll" + "r" * len(ACTIVATIONS)))
    bench.table(column_table(KEY + WEIGHTS, rows, "llllrrlrr"))
    bench.finish()


if __name__ == "__main__":
    main()
