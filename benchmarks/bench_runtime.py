"""Training throughput: our pipeline runtime vs torch.distributed.pipelining vs one process.

Every run trains the same balanced residual-MLP model (``blocks`` blocks of
``x + W2 gelu(W1 x)``, float32, MSE loss, SGD) on the same batches, one thread per process:

- ``single``      one process, the whole model, the whole batch (the baseline);
- ``single-mb``   one process, the whole model, the batch as the same micro-batches one after the
                  other (gradient accumulation): the pipeline's arithmetic without its parallelism,
                  which shows what small micro-batches cost in GEMM efficiency alone;
- ``pair``        two independent ``single`` processes at once (no communication): what two busy
                  processes on this machine get each, i.e. the contention ceiling of any 2-rank run;
- ``ours-gpipe``  lightning_pipe's SequentialPipeline over build_schedule("gpipe", 2, m);
- ``ours-1f1b``   the same over build_schedule("1f1b", 2, m);
- ``torch-gpipe`` torch.distributed.pipelining's PipelineStage + ScheduleGPipe;
- ``torch-1f1b``  the same with Schedule1F1B.

The pipelines cut the model in two equal halves (stage 0: the first ``blocks/2`` blocks, stage 1:
the rest plus the loss) and run 2 processes over gloo. A step is forward, backward and the
optimizer step; samples/s counts ``steps * batch`` over the wall time of the timed steps (warm-up
steps excluded, a barrier before and after). After the run the final weights of every mode are
compared with the single-process run, so all modes provably computed the same training.

Default size: hidden 512, 8 blocks, batch 256, 4 micro-batches of 64 rows (~70 ms per step in one
process). Single-threaded CPU GEMMs lose efficiency below ~64 rows (16-row micro-batches of a
1024-wide layer run ~1.8x slower per row than 64-row ones on the machine of docs/benchmarks.md),
which caps any pipeline below the one-process run no matter how good its runtime is; 64-row
micro-batches keep compute dominant, as in real pipelines.

The machine may be shared: each run waits (at most --quiet-wait s) for other processes to go quiet,
measures the CPU they used during the run, and repeats a run they disturbed (--retries).

    python benchmarks/bench_runtime.py                      # defaults, a few minutes at most
    python benchmarks/bench_runtime.py --hidden 1024 --batch 64 --microbatches 4
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ["single", "single-mb", "pair", "ours-gpipe", "ours-1f1b", "torch-gpipe", "torch-1f1b"]


# ---- model and data ----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def make_model(cfg: dict) -> nn.Sequential:
    torch.manual_seed(0)
    inner = cfg["hidden"] * cfg["mlp_ratio"]
    model = nn.Sequential(*[Block(cfg["hidden"], inner) for _ in range(cfg["blocks"])])
    with torch.no_grad():  # keep the residual stream bounded over many blocks
        for block in model:
            block.fc2.weight.mul_(cfg["blocks"] ** -0.5)
    return model


def make_data(cfg: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few fixed batches, cycled through the steps (made before timing starts)."""
    g = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g)) for _ in range(4)
    ]


def stage_half(model: nn.Sequential, stage: int) -> nn.Sequential:
    half = len(model) // 2
    return model[:half] if stage == 0 else model[half:]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


# ---- workers -----------------------------------------------------------------------------------
def _timed(step, cfg: dict, barrier) -> list[float]:
    """Run warm-up then timed steps; return [total, step times...] of the timed part."""
    for i in range(cfg["warmup"]):
        step(i)
    barrier()
    times = []
    start = time.perf_counter()
    for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    barrier()
    return [time.perf_counter() - start] + times


def _single(rank: int, cfg: dict, microbatches: int = 1) -> dict:
    model = make_model(cfg)
    data = make_data(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        if microbatches == 1:
            loss_fn(model(x), y).backward()
        else:
            for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
                (loss_fn(model(xm), ym) / microbatches).backward()
        opt.step()

    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    timing = _timed(step, cfg, barrier)
    return {"timing": timing, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _ours(rank: int, cfg: dict, name: str) -> dict:
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import build_schedule

    model = make_model(cfg)
    data = make_data(cfg)
    chunk = stage_half(model, rank)
    schedule = build_schedule(name, 2, cfg["microbatches"])
    host = SequentialHost({rank: chunk}, 1, loss_fn)
    pipe = SequentialPipeline(schedule, rank, host, Transport(lambda r: r, torch.device("cpu")))
    opt = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"])

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y)
        opt.step()

    timing = _timed(step, cfg, dist.barrier)
    return {"timing": timing, "params": {k: v.detach().clone() for k, v in chunk.state_dict().items()}}


def _torch(rank: int, cfg: dict, name: str) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model = make_model(cfg)
    data = make_data(cfg)
    chunk = stage_half(model, rank)
    m = cfg["microbatches"]
    # Static shapes (no run-time shape inference); the received activation and the output need grad.
    shape = (cfg["batch"] // m, cfg["hidden"])
    example_in = torch.empty(shape, requires_grad=rank > 0)
    example_out = torch.empty(shape, requires_grad=True)
    stage = PipelineStage(chunk, rank, 2, torch.device("cpu"), input_args=(example_in,), output_args=(example_out,))
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    schedule = cls(stage, m, loss_fn=loss_fn)  # scale_grads=True: mean over micro-batches, as ours
    opt = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"])

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, return_outputs=False)
        opt.step()

    timing = _timed(step, cfg, dist.barrier)
    return {"timing": timing, "params": {k: v.detach().clone() for k, v in chunk.state_dict().items()}}


def _worker(rank: int, world: int, port: int, mode: str, cfg: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    if cfg.get("pin") and hasattr(os, "sched_setaffinity"):  # rank r (and the threads it starts) on CPU r
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    path = os.path.join(out_dir, f"{rank}.pt")
    try:
        if world > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        if mode in ("single", "pair"):
            result = _single(rank, cfg)
        elif mode == "single-mb":
            result = _single(rank, cfg, cfg["microbatches"])
        elif mode.startswith("ours-"):
            result = _ours(rank, cfg, mode[len("ours-") :])
        else:
            result = _torch(rank, cfg, mode[len("torch-") :])
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (Linux /proc/stat, incl. steal), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and its reaped children (the benchmark's processes)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def wait_until_quiet(max_wait: float, threshold: float) -> float:
    """Wait (at most `max_wait` s) until other processes use less than `threshold` CPUs; return their load."""
    deadline = time.monotonic() + max_wait
    while True:
        busy0, own0 = _busy_seconds(), _own_seconds()
        if busy0 is None:
            return 0.0
        time.sleep(1.0)
        load = max(0.0, (_busy_seconds() - busy0) - (_own_seconds() - own0))
        if load < threshold or time.monotonic() > deadline:
            return load
        time.sleep(1.0)


def launch(mode: str, cfg: dict, timeout: float) -> tuple[list[dict], float]:
    """Run `mode` on its processes; kill them and raise if they exceed `timeout` seconds.

    Also returns the foreign load during the run: CPU cores' worth of work done by processes
    other than the benchmark's (another job on the machine), which would distort the timing."""
    busy0, own0, wall0 = _busy_seconds(), _own_seconds(), time.monotonic()
    world = 1 if mode.startswith("single") else 2
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, mode, cfg, out_dir)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"{mode}: ranks {hung} did not finish within {timeout:.0f} s")
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"{mode}: rank {r} died without a result (exit code {procs[r].exitcode})")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"{mode}: rank {r} failed:\n{record['error']}")
            results.append(record["result"])
    busy1 = _busy_seconds()
    foreign = 0.0
    if busy0 is not None and busy1 is not None:
        foreign = max(0.0, (busy1 - busy0) - (_own_seconds() - own0)) / (time.monotonic() - wall0)
    return results, foreign


# ---- report ------------------------------------------------------------------------------------
def summarize(mode: str, results: list[dict], cfg: dict) -> dict:
    """samples/s of the run (per process for `pair`), from total and from median step time."""
    if mode == "pair":
        totals = [r["timing"][0] for r in results]
        medians = [statistics.median(r["timing"][1:]) for r in results]
        total, median = statistics.mean(totals), statistics.mean(medians)
    else:
        total = max(r["timing"][0] for r in results)
        median = max(statistics.median(r["timing"][1:]) for r in results)
    return {"total": cfg["steps"] * cfg["batch"] / total, "median": cfg["batch"] / median, "step_ms": 1000 * total / cfg["steps"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--mlp-ratio", type=int, default=1, help="inner width of a block = hidden * mlp_ratio")
    p.add_argument("--blocks", type=int, default=8, help="even: the two stages get half each")
    p.add_argument("--batch", type=int, default=256, help="micro-batches of batch/microbatches rows")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode (interleaved); the best is reported")
    p.add_argument("--retries", type=int, default=2, help="re-runs of a run disturbed by other processes")
    p.add_argument(
        "--max-foreign", type=float, default=0.1, help="a run during which other processes used more CPUs than this is disturbed"
    )
    p.add_argument(
        "--budget", type=float, default=120.0, help="seconds after which disturbed runs are kept and nobody is waited for any more"
    )
    p.add_argument(
        "--quiet-wait", type=float, default=10.0, help="seconds to wait at most, before each run, for other processes to go quiet"
    )
    p.add_argument("--pin", action="store_true", help="pin rank r's process to CPU r (every mode alike)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before its processes are killed")
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; allowed: {MODES}")
    if args.blocks % 2 or args.batch % args.microbatches:
        p.error("--blocks must be even and --batch divisible by --microbatches (torch's schedules need equal micro-batches)")
    if "single" not in modes:
        modes.insert(0, "single")
    cfg = dict(
        hidden=args.hidden,
        mlp_ratio=args.mlp_ratio,
        blocks=args.blocks,
        batch=args.batch,
        microbatches=args.microbatches,
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        pin=args.pin,
    )
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread per process, gloo; config: {cfg}", flush=True)

    best: dict[str, dict] = {}
    errors: dict[str, float] = {}
    reference: dict | None = None
    started = time.monotonic()
    for rep in range(args.repeats):
        for mode in modes:
            for attempt in range(args.retries + 1):
                patient = time.monotonic() - started < args.budget  # past the budget: no waits, no retries
                if patient:
                    wait_until_quiet(args.quiet_wait, args.max_foreign)
                results, foreign = launch(mode, cfg, args.timeout)
                if foreign <= args.max_foreign or not patient:
                    break
                print(
                    f"  run {rep + 1}/{args.repeats} {mode:12s} disturbed: other processes used {foreign:.2f} CPUs"
                    f"{'; retrying' if attempt < args.retries else '; keeping it'}",
                    flush=True,
                )
            if mode == "single" and reference is None:
                reference = results[0]["params"]
            stats = summarize(mode, results, cfg)
            stats["foreign"] = foreign
            print(
                f"  run {rep + 1}/{args.repeats} {mode:12s} {stats['total']:8.1f} samples/s  ({stats['step_ms']:.1f} ms/step,"
                f" foreign load {foreign:.2f} CPUs)",
                flush=True,
            )
            if mode not in best or stats["total"] > best[mode]["total"]:
                best[mode] = stats
            if mode not in ("single", "pair") and reference is not None:  # single-mb too: same sums, other order
                err = 0.0
                for r in results:  # a stage's state_dict keeps the block indices of the whole model
                    for k, v in r["params"].items():
                        ref = reference[k]
                        err = max(err, ((v - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
                errors[mode] = max(errors.get(mode, 0.0), err)

    single = best["single"]["total"]
    print()
    print(
        f"hidden={args.hidden} mlp_ratio={args.mlp_ratio} blocks={args.blocks} batch={args.batch} "
        f"microbatches={args.microbatches} steps={args.steps} warmup={args.warmup} repeats={args.repeats} (best run)"
    )
    print()
    print("| mode | samples/s | ms/step | samples/s (median step) | vs single | weights vs single | other load (CPUs) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        s = best[mode]
        note = "per process" if mode == "pair" else ""
        err = f"{errors[mode]:.1e}" if mode in errors else ""
        print(
            f"| {mode}{' ' + note if note else ''} | {s['total']:.1f} | {s['step_ms']:.1f} | {s['median']:.1f} | "
            f"{s['total'] / single:.2f}x | {err} | {s['foreign']:.2f} |"
        )
    print()
    for sched in ("gpipe", "1f1b"):
        o, t = best.get(f"ours-{sched}"), best.get(f"torch-{sched}")
        if o and t:
            print(f"ours/torch {sched}: {o['total'] / t['total']:.2f}x")
    if "pair" in best and "single-mb" in best:
        m = args.microbatches
        bubble = 2 * m / (m + 1)
        pair, mb = best["pair"]["total"] / single, best["single-mb"]["total"] / single
        print(
            f"ideal 2-stage pipeline at m={m}: {bubble:.2f} (bubble: 2m/(m+1)) x {pair:.2f} (two busy processes,"
            f" 'pair') x {mb:.2f} (micro-batch GEMM efficiency, 'single-mb') = {bubble * pair * mb:.2f}x single"
        )


if __name__ == "__main__":
    main()
