"""Training throughput: our pipeline runtime vs torch.distributed.pipelining vs one process.

The residual MLP of lightning_pipe.bench.mlp (default hidden 512, 8 blocks, batch 256 in 4
micro-batches of 64 rows, SGD) on 2 gloo processes x 1 thread, cut in two equal halves; modes
single, single-mb, pair, ours-gpipe/1f1b, torch-gpipe/1f1b; best of --repeats interleaved runs,
final weights checked against ``single``. Method and results: docs/benchmarks.md.

    flock /tmp/bench.lock python benchmarks/bench_runtime.py --repeats 3 --retries 3 --quiet-wait 20 --budget 300
    python benchmarks/bench_runtime.py --hidden 1024 --batch 64 --microbatches 4
    python benchmarks/bench_runtime.py --quick
"""

from __future__ import annotations

from lightning_pipe.bench.harness import Bench, Table, names, pin_threads

pin_threads(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench.launch import timed_steps  # noqa: E402
from lightning_pipe.bench.mlp import best_runs, loss_fn, make_data, make_model, single_job, stage_half  # noqa: E402

MODES = ["single", "single-mb", "pair", "ours-gpipe", "ours-1f1b", "torch-gpipe", "torch-1f1b"]


def _pipeline(rank: int, cfg: dict, mode: str) -> dict:
    """One stage of ``ours-*`` (SequentialPipeline) or ``torch-*`` (PipelineStage + Schedule*)."""
    model, data = make_model(cfg), make_data(cfg)
    chunk, m = stage_half(model, rank), cfg["microbatches"]
    kind, name = mode.split("-")
    if kind == "ours":
        from lightning_pipe.runtime.p2p import Transport
        from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
        from lightning_pipe.schedules import build_schedule

        host = SequentialHost({rank: chunk}, 1, loss_fn)
        run = SequentialPipeline(build_schedule(name, 2, m), rank, host, Transport(lambda r: r, torch.device("cpu"))).step
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        shape = (cfg["batch"] // m, cfg["hidden"])  # static shapes: no run-time shape inference
        ins, outs = (torch.empty(shape, requires_grad=rank > 0),), (torch.empty(shape, requires_grad=True),)
        stage = PipelineStage(chunk, rank, 2, torch.device("cpu"), input_args=ins, output_args=outs)
        schedule = (ScheduleGPipe if name == "gpipe" else Schedule1F1B)(stage, m, loss_fn=loss_fn)  # scale_grads: as ours
        run = lambda x, y: schedule.step(x) if rank == 0 else schedule.step(target=y, return_outputs=False)
    opt = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"])

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        run(*data[i % len(data)])
        opt.step()

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    return {"timing": timing, "params": {k: v.detach().clone() for k, v in chunk.state_dict().items()}}


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode in ("single", "pair", "single-mb"):
        return single_job(rank, world, cfg, cfg["microbatches"] if mode == "single-mb" else 1)
    return _pipeline(rank, cfg, mode)


def main() -> None:
    bench = Bench(
        __doc__, rounds=2, steps=20, warmup=5, retries=2, max_foreign=0.1, quiet_wait=10.0, budget=120.0, timeout=300.0, pin=False
    )
    p = bench.parser
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--mlp-ratio", type=int, default=1, help="inner width of a block = hidden * mlp_ratio")
    p.add_argument("--blocks", type=int, default=8, help="even: the two stages get half each")
    p.add_argument("--batch", type=int, default=256, help="micro-batches of batch/microbatches rows")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--modes", type=names, default=MODES, help=f"comma-separated subset of {MODES}")
    args = bench.parse()
    modes = ["single"] + [m for m in args.modes if m != "single"]
    if set(modes) - set(MODES):
        bench.error(f"unknown modes {sorted(set(modes) - set(MODES))}; allowed: {MODES}")
    if args.blocks % 2 or args.batch % args.microbatches:
        bench.error("--blocks must be even and --batch divisible by --microbatches (torch's schedules need equal micro-batches)")
    keys = ("hidden", "mlp_ratio", "blocks", "batch", "microbatches", "steps", "warmup", "lr")
    cfg = {k: getattr(args, k) for k in keys}
    best, errors = best_runs(bench, job, modes, cfg, args.rounds)
    bench.keep("best", best)
    single = best["single"]["total"]
    bench.say(f"{', '.join(f'{k}={cfg[k]}' for k in keys)} repeats={args.rounds} (best run)\n")
    table = Table("mode", "samples/s", "ms/step", "samples/s (median step)", "vs single", "weights vs single", "other load (CPUs)")
    for mode in modes:
        s, err = best[mode], f"{errors[mode]:.1e}" if mode in errors else ""
        name = mode + (" per process" if mode == "pair" else "")
        figures = (f"{s['total']:.1f}", f"{s['step_ms']:.1f}", f"{s['median']:.1f}", f"{s['total'] / single:.2f}x")
        table.add(name, *figures, err, f"{s['foreign']:.2f}")
    bench.table(table)
    for sched in ("gpipe", "1f1b"):
        if f"ours-{sched}" in best and f"torch-{sched}" in best:
            bench.say(f"ours/torch {sched}: {best[f'ours-{sched}']['total'] / best[f'torch-{sched}']['total']:.2f}x")
    if "pair" in best and "single-mb" in best:
        m = args.microbatches
        bubble, pair, mb = 2 * m / (m + 1), best["pair"]["total"] / single, best["single-mb"]["total"] / single
        bench.say(
            f"ideal 2-stage pipeline at m={m}: {bubble:.2f} (bubble: 2m/(m+1)) x {pair:.2f} (two busy processes,"
            f" 'pair') x {mb:.2f} (micro-batch GEMM efficiency, 'single-mb') = {bubble * pair * mb:.2f}x single"
        )
    bench.finish()


if __name__ == "__main__":
    main()
