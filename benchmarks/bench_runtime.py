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
measures the CPU they used during the run, and repeats a run they disturbed (--retries); see
lightning_pipe.bench.launch.run_undisturbed. The model, data and the one-process run are
lightning_pipe.bench.mlp (bench_waves.py trains the same).

    python benchmarks/bench_runtime.py                      # defaults, a few minutes at most
    python benchmarks/bench_runtime.py --hidden 1024 --batch 64 --microbatches 4
"""

from __future__ import annotations

import argparse
import os
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench.launch import machine_description, run_undisturbed, timed_steps  # noqa: E402
from lightning_pipe.bench.mlp import loss_fn, make_data, make_model, max_rel_error, single_job, stage_half, summarize  # noqa: E402

MODES = ["single", "single-mb", "pair", "ours-gpipe", "ours-1f1b", "torch-gpipe", "torch-1f1b"]


# ---- workers (run in the spawned processes) ----------------------------------------------------
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

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
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

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    return {"timing": timing, "params": {k: v.detach().clone() for k, v in chunk.state_dict().items()}}


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    """What a process of `mode` runs (`world` processes: 1 for single / single-mb, else 2)."""
    if mode in ("single", "pair"):
        return single_job(rank, world, cfg)
    if mode == "single-mb":
        return single_job(rank, world, cfg, cfg["microbatches"])
    if mode.startswith("ours-"):
        return _ours(rank, cfg, mode[len("ours-") :])
    return _torch(rank, cfg, mode[len("torch-") :])


def launch(mode: str, cfg: dict, args: argparse.Namespace, patient: bool, label: str) -> tuple[list[dict], float]:
    """Run `mode` on its processes (waiting for a quiet machine and repeating a disturbed run while
    `patient`); the results and the foreign load during the run (CPU cores' worth of work done by
    processes other than the benchmark's, which would distort the timing)."""
    world = 1 if mode.startswith("single") else 2
    return run_undisturbed(
        job,
        world,
        mode,
        cfg,
        retries=args.retries,
        max_foreign=args.max_foreign,
        quiet_wait=args.quiet_wait,
        patient=patient,
        label=label,
        timeout=args.timeout,
        backend="gloo" if world > 1 else None,
        pin=cfg["pin"],
    )


# ---- report ------------------------------------------------------------------------------------
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
    print(f"{machine_description()}; 1 thread per process, gloo; config: {cfg}", flush=True)

    best: dict[str, dict] = {}
    errors: dict[str, float] = {}
    reference: dict | None = None
    started = time.monotonic()
    for rep in range(args.repeats):
        for mode in modes:
            patient = time.monotonic() - started < args.budget  # past the budget: no waits, no retries
            results, foreign = launch(mode, cfg, args, patient, f"run {rep + 1}/{args.repeats} {mode:12s}")
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
                # a stage's state_dict keeps the block indices of the whole model
                errors[mode] = max(errors.get(mode, 0.0), max_rel_error(results, reference))

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
