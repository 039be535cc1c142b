"""Peak memory per stage, measured on real processes, against the simulator's prediction.

GPipe, 1F1B and PipeDream-2BW train lightning_pipe.bench.mlp's residual MLP on d = 2, 4 gloo
processes at m = d, 4d. Per stage: "saved + stash" (autograd's saved tensors through
saved_tensors_hooks, plus the executor's stashed outputs), "alive" (the same and every communication
buffer until torch frees its storage), the weight buffers (2BW: versions_held()); predicted:
simulate() on per-block bytes measured with the same hooks. Feeds docs/memory.md (method there).

    python benchmarks/bench_memory.py
    python benchmarks/bench_memory.py --no-prefetch   # Executor(prefetch=False)
    python benchmarks/bench_memory.py --quick         # smoke: d = 2 only
"""

from __future__ import annotations

import time
import weakref

from lightning_pipe.bench.harness import Bench, Table, ints, names, pin_threads

pin_threads(1)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.bench.launch import run_distributed  # noqa: E402
from lightning_pipe.bench.mlp import loss_fn, make_model  # noqa: E402
from lightning_pipe.simulation import CostModel, simulate  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "2bw"]
KiB = 1024.0


# ---- accounting ----------------------------------------------------------------------------------
class Ledger:
    """Bytes of storages held for a reason, reference counted by storage data_ptr (a storage saved
    twice, or saved and stashed, counts once); the peak since the last `reset_peak`."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # data_ptr -> [bytes, references]
        self.bytes = self.peak = 0

    def acquire(self, ptr: int, nbytes: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [nbytes, 1]
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        else:
            entry[1] += 1

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
    kept, to say what the excess consisted of."""

    def __init__(self, held: "Ledger | None" = None) -> None:
        self.kind: dict[int, tuple[int, str]] = {}  # data_ptr -> (bytes, kind)
        self.bytes = self.peak = 0
        self.held = held
        self.excess_at_peak: dict[str, int] = {}
        self.peak_kind = ""  # the kind of the storage whose arrival set the peak

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
                excess: dict[str, int] = {}
                for p, (n, k) in self.kind.items():
                    if p not in self.held.live:
                        excess[k] = excess.get(k, 0) + n
                self.excess_at_peak = excess

    def _freed(self, ptr: int) -> None:
        nbytes, _ = self.kind.pop(ptr)
        self.bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.bytes
        self.excess_at_peak = {}


class _Saved:
    """What pack returns for an activation autograd saves: dies when autograd releases it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Probe:
    """The saved-tensor hooks and the ledgers of one process."""

    def __init__(self) -> None:
        self.held = Ledger()  # saved by autograd + stashed by the executor
        self.saved = Ledger()  # saved by autograd only
        self.alive = StorageWatch(self.held)  # the same, and communication buffers, until freed
        self.weights = StorageWatch()
        self.weight_ptrs: set[int] = set()  # storages of the parameters the running forward uses
        self.in_flight = self.peak_in_flight = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

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

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def use_weights(self, module: nn.Module) -> None:
        self.weight_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def stash(self, out: torch.Tensor, counted: bool) -> None:
        """The executor keeps `out` until this micro-batch's backward (the gradient hook on it)."""
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        storage = out.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if counted:
            self.held.acquire(ptr, nbytes)
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
        """Count what the transport sends and the buffers it receives into."""
        send_act, send_grad = transport.send_activation, transport.send_gradients
        recv_act, recv_grad = transport.recv_activation, transport.recv_gradients

        def send_activation(peer, chunk, key, value):
            ops = send_act(peer, chunk, key, value)
            for t in value if isinstance(value, tuple) else (value,):
                self.alive.watch(t, "activation")
            return ops

        def send_gradients(peer, grads):
            for g in grads:
                self.alive.watch(g, "gradient sent")
            return send_grad(peer, grads)

        def recv_activation(peer, chunk, key):
            pending, ops = recv_act(peer, chunk, key)
            for b in pending.buffers:
                self.alive.watch(b, "activation received")
            return pending, ops

        def recv_gradients(peer, like):
            pending, ops = recv_grad(peer, like)
            for b in pending.buffers:
                self.alive.watch(b, "gradient received")
            return pending, ops

        transport.send_activation, transport.send_gradients = send_activation, send_gradients
        transport.recv_activation, transport.recv_gradients = recv_activation, recv_gradients


# ---- the workers ---------------------------------------------------------------------------------
def _host_class():
    from lightning_pipe.runtime.sequential import SequentialHost

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

    return MeasuredHost


def _batches(cfg: dict, m: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    rows = cfg["rows"] * m
    return [(torch.randn(rows, cfg["hidden"], generator=g), torch.randn(rows, cfg["hidden"], generator=g)) for _ in range(count)]


def _param_bytes(module: nn.Module) -> int:
    return sum(s.nbytes() for s in {p.untyped_storage().data_ptr(): p.untyped_storage() for p in module.parameters()}.values())


def job(rank: int, world: int, runs: list[tuple[str, int]], cfg: dict) -> list[dict]:
    """Every (schedule, m) of `runs` on this rank's stage, one after the other (one launch per d)."""
    import torch.distributed as dist

    results = []
    for schedule, m in runs:
        results.append(_measure(rank, world, schedule, m, cfg))
        dist.barrier()
    return results


def _measure(rank: int, world: int, schedule: str, m: int, cfg: dict) -> dict:
    """One stage of a run: warm-up steps, measured steps (and 2BW's drain); the peaks."""
    from lightning_pipe.layers import DoubleBuffer
    from lightning_pipe.runtime.executor import Executor
    from lightning_pipe.runtime.microbatch import signature, split_microbatches
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.schedules import ScheduleSpec, build_schedule

    model = make_model(cfg)
    per = cfg["blocks"] // world
    stage = model[rank * per : (rank + 1) * per]
    probe = Probe()
    host = _host_class()(probe, stage, {rank: stage}, world - 1, loss_fn)
    transport = Transport(lambda r: r, torch.device("cpu"))
    probe.watch_transport(transport)
    opt = torch.optim.SGD(stage.parameters(), lr=cfg["lr"])
    for p in stage.parameters():
        probe.weights.watch(p, "live")
    warmup, measured = cfg["warmup"], cfg["steps_2bw"] if schedule == "2bw" else cfg["steps"]
    held = 0
    if schedule == "2bw":

        def apply() -> None:  # a drain's update: the caller's optimizer step
            opt.step()
            opt.zero_grad(set_to_none=True)

        mode = DoubleBuffer(ScheduleSpec.of("2bw"), world, m, rank, transport, stage, apply, prefetch=cfg["prefetch"])
        versions = mode.versions
        detach_live, snapshot = versions.detach_live, versions.snapshot

        def watched_detach_live() -> None:
            detach_live()
            for p in versions.live:
                probe.weights.watch(p, "detach_live")

        def watched_snapshot():
            stashed = snapshot()
            for t in stashed.values():
                probe.weights.watch(t, "snapshot")
            return stashed

        versions.detach_live, versions.snapshot = watched_detach_live, watched_snapshot
    else:
        executor = Executor(build_schedule(schedule, world, m), rank, transport, prefetch=cfg["prefetch"])

    with probe.hooks():
        for step, (x, y) in enumerate(_batches(cfg, m, warmup + measured)):
            if step == warmup:
                probe.reset_peaks()
            opt.zero_grad(set_to_none=True)
            host.inputs, host.weights = split_microbatches(x, m)
            host.targets, _ = split_microbatches(y, m)
            host.losses = []
            if schedule == "2bw":
                mode.run("train", host, [("train", signature(mb)) for mb in host.inputs])
                held = max(held, mode.versions_held())
            else:
                executor.run(host, [signature(mb) for mb in host.inputs])
            opt.step()
        if schedule == "2bw":
            mode.drain()
            held = max(held, mode.versions_held())
    if probe.held.bytes or probe.in_flight:
        raise RuntimeError(f"rank {rank}: {probe.held.bytes} bytes / {probe.in_flight} micro-batches still held after the run")
    return {
        "saved": probe.saved.peak,
        "held": probe.held.peak,
        "alive": probe.alive.peak,
        "excess": probe.alive.excess_at_peak,
        "in_flight": probe.peak_in_flight,
        "weights": probe.weights.peak,
        "weights_peak_at": probe.weights.peak_kind,
        "versions_held": held,
        "param_bytes": _param_bytes(stage),
    }


# ---- per-block costs on one process --------------------------------------------------------------
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


def predict(schedule: str, d: int, m: int, cfg: dict, costs: CostModel):
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.schedules.two_bw import pipedream_2bw

    if schedule == "2bw":
        sched = pipedream_2bw(d, m, batches=cfg["warmup"] + cfg["steps_2bw"])
    else:
        sched = build_schedule(schedule, d, m)
    per = cfg["blocks"] // d
    return simulate(sched, costs, [(s * per, (s + 1) * per) for s in range(d)], critical_path=False)


# ---- report --------------------------------------------------------------------------------------
def kib(n: float) -> str:
    return f"{n / KiB:,.0f}"


def main() -> None:
    bench = Bench(__doc__, {"stages": [2], "steps_2bw": 2}, steps=2, warmup=1, timeout=240.0)
    p = bench.parser
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--mlp-ratio", type=int, default=2, help="inner width of a block = hidden * mlp_ratio")
    p.add_argument("--blocks", type=int, default=8, help="divisible by every stage count")
    p.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--stages", type=ints, default=[2, 4], help="comma-separated d")
    p.add_argument("--schedules", type=names, default=SCHEDULES)
    p.add_argument("--steps-2bw", type=int, default=4, help="measured steps (2BW; then a drain)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-prefetch", action="store_true", help="the executor posts each receive when it is due (prefetch=False)")
    args = bench.parse()
    stages, schedules = args.stages, args.schedules
    if any(args.blocks % d for d in stages) or any(s not in SCHEDULES for s in schedules):
        bench.error(f"--blocks must be divisible by every d, and schedules in {SCHEDULES}")
    cfg = dict(hidden=args.hidden, mlp_ratio=args.mlp_ratio, blocks=args.blocks, rows=args.rows, warmup=args.warmup, steps=args.steps)
    cfg.update(steps_2bw=args.steps_2bw, lr=args.lr, prefetch=not args.no_prefetch)
    bench.say(f"1 thread per process, gloo; config: {cfg}")
    saved, output, params = block_costs(cfg)
    bench.say(f"per block, one micro-batch: saves {kib(saved[0])} KiB, outputs {kib(output[0])} KiB, parameters {kib(params[0])} KiB")
    blocks = cfg["blocks"]
    costs = CostModel.uniform(blocks, 1.0, 2.0, activation_bytes=tuple(map(float, saved)), param_bytes=tuple(map(float, params)))
    costs_out = CostModel.uniform(blocks, 1.0, 2.0, activation_bytes=tuple(map(float, output)), param_bytes=tuple(map(float, params)))
    key = ("schedule", "d", "m", "stage")
    acts = Table(
        *key,
        *("in flight meas/pred", "saved + stash KiB", "predicted KiB", "ratio", "alive KiB", "alive / pred"),
        *("excess of alive at its peak (KiB)", "pred (output bytes) KiB"),
        align="llll" + "r" * 8,
    )
    weights = Table(
        *key,
        *("weights measured KiB", "versions_held() max", "measured peak set by", "predicted KiB", "ratio"),
        align="llll" + "rrlrr",
    )
    started = time.monotonic()
    for d in stages:
        runs = [(schedule, m) for schedule in schedules for m in (d, 4 * d)]
        t0 = time.monotonic()
        per_rank = run_distributed(job, d, runs, cfg, timeout=args.timeout)
        bench.log(f"d={d}: {len(runs)} runs in {time.monotonic() - t0:.1f} s")
        bench.keep(f"d={d}", {f"{s} m={m}": [r[i] for r in per_rank] for i, (s, m) in enumerate(runs)})
        for i, (schedule, m) in enumerate(runs):
            t = predict(schedule, d, m, cfg, costs)
            t_out = predict(schedule, d, m, cfg, costs_out)
            for s in range(d):
                r = per_rank[s][i]
                if r["saved"] > r["held"]:
                    raise RuntimeError("saved > saved + stash: the accounting is wrong")
                pred, pred_w = t.peak_activation_bytes[s], t.weight_bytes[s]
                excess = ", ".join(f"{k} {kib(v)}" for k, v in sorted(r["excess"].items())) or "-"
                acts.add(
                    schedule, d, m, s, f"{r['in_flight']}/{t.peak_activations[s]}", kib(r["held"]), kib(pred), f"{r['held'] / pred:.2f}",
                    kib(r["alive"]), f"{r['alive'] / pred:.2f}", excess, kib(t_out.peak_activation_bytes[s]),
                )  # fmt: skip
                versions = str(r["versions_held"]) if schedule == "2bw" else "-"
                weights.add(
                    schedule, d, m, s, kib(r["weights"]), versions, r["weights_peak_at"], kib(pred_w), f"{r['weights'] / pred_w:.2f}"
                )
    bench.say(f"\n{len(acts.rows)} stage rows in {time.monotonic() - started:.0f} s\n")
    bench.table(acts)
    bench.table(weights)
    bench.finish()


if __name__ == "__main__":
    main()
