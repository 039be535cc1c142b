"""Training throughput on 2 gloo processes x 1 thread: our runtime vs torch.distributed.pipelining vs
one process, and the Trainer path (trainer-single / trainer-1f1b, asked for with --modes) vs the raw runtime.

benchmarks.harness.mlp's residual MLP cut in two equal halves; best of --repeats interleaved runs,
final weights checked against ``single``. Results: docs/results/benchmarks.md; the Trainer path: docs/results/predictions.md.

    flock /tmp/bench.lock python -m benchmarks.bench_runtime --repeats 3 --retries 3 --quiet-wait 20 --budget 300
    flock /tmp/bench.lock python -m benchmarks.bench_runtime --modes trainer-single,ours-1f1b,trainer-1f1b --steps 40 --repeats 4 --budget 300
    python -m benchmarks.bench_runtime --modes trainer-1f1b --steps 40 --repeats 2 --segments
    python -m benchmarks.bench_runtime --quick
    flock /tmp/bench.lock python -m benchmarks.bench_runtime --compile --modes single,ours-1f1b,torch-1f1b,torch-interleaved,trainer-1f1b,trainer-interleaved

--compile: every side compiles each block once in place (`nn.Module.compile`; through the Trainer the
strategy's ``compile=True`` does it), before the untimed warm-up steps; zero-bubble modes are refused
there (their split backward does not run compiled blocks).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from statistics import median

import torch
import torch.distributed as dist

from benchmarks.harness.bench import Bench, Table
from benchmarks.harness.mlp import best_runs, make_data, single_job, stage_job
from benchmarks.harness.trainer_runs import quiet_lightning
from benchmarks.harness.trainer_segments import segments, stamp_segments

MODES = ["single", "single-mb", "pair", "ours-gpipe", "ours-1f1b", "torch-gpipe", "torch-1f1b"]  # the default
TRAINER = ["trainer-single"] + [f"trainer-{s}" for s in ("1f1b", "interleaved", "hanayo", "zb-h1", "zb-v")]  # through the Trainer
EXTRA = ["torch-interleaved", "torch-zbv"] + TRAINER  # asked for with --modes


def profiler(clock: str):
    """cProfile over the timed steps (cpu: the main thread's CPU time; wall: the waits too), or None."""
    if not clock:
        return None
    return cProfile.Profile(time.thread_time if clock == "cpu" else time.perf_counter)


def profile_report(prof, name: str, lines: int = 35) -> str | None:
    """Each rank's heaviest functions (own, cumulative) and who syncs the ranks; BENCH_PROFILE_DIR: the pstats too."""
    if prof is None:
        return None
    if folder := os.environ.get("BENCH_PROFILE_DIR"):
        prof.dump_stats(os.path.join(folder, f"{name}-rank{dist.get_rank() if dist.is_initialized() else 0}.pstats"))
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    stats.print_callers(r"distributed_c10d.py.*\((broadcast|all_reduce|barrier|broadcast_object_list)\)")
    return out.getvalue()


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode in ("single", "pair", "single-mb"):
        return single_job(rank, world, cfg, cfg["microbatches"] if mode == "single-mb" else 1)
    if mode in TRAINER:
        return _trainer(rank, world, cfg, mode.split("-", 1)[1])
    prof = profiler(cfg["profile"] if mode.startswith("ours-") else "")  # ours-* (SequentialPipeline) cProfiled on request
    return dict(stage_job(rank, cfg, mode, prof), profile=profile_report(prof, mode))


def _trainer(rank: int, world: int, cfg: dict, schedule: str) -> dict:
    """The Trainer inside the launched processes, as under torchrun (the environment says they exist);
    `schedule` on equal chunks of blocks (the same cut as torch's schedules)."""
    if world > 1:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from benchmarks.harness.mlp_module import MLPModule

    quiet_lightning()
    data, last = make_data(cfg), cfg["warmup"] + cfg["steps"] - 1
    barrier = dist.barrier if world > 1 else (lambda: None)

    class Clock(Callback):
        """Timed steps warmup .. last, a barrier at both ends (as timed_steps)."""

        times: list[float] = []
        prof = profiler(cfg["profile"] if world > 1 else "")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == cfg["warmup"]:
                barrier()
                self.start = time.perf_counter()
                self.prof and self.prof.enable()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= cfg["warmup"]:
                self.times.append(time.perf_counter() - self.t)
            if batch_idx == last:
                self.prof and self.prof.disable()
                barrier()
                self.total = time.perf_counter() - self.start

        def on_train_end(self, trainer, pl_module):  # this rank's blocks, keyed as in the whole model
            self.params = {k.split(".", 1)[1]: v.detach().clone() for k, v in pl_module.state_dict().items()}

    clock = Clock()
    module = MLPModule(dict(cfg, compile=cfg["compile"] and world == 1))  # a pipeline: the strategy compiles
    kwargs = dict(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    kwargs.update(enable_model_summary=False, num_sanity_val_steps=0, max_steps=last + 1, callbacks=[clock])
    if world > 1:
        from lightning_pipe import AutoPipeStrategy

        kwargs["strategy"] = AutoPipeStrategy(
            schedule=schedule, microbatches=cfg["microbatches"], partition="uniform", compile=cfg["compile"]
        )
    stamps = stamp_segments() if cfg["segments"] and world > 1 else None
    # step i's batch is make_data's batch i mod 4, as the raw runs cycle them; batch_size=None: no collation
    L.Trainer(**kwargs).fit(module, torch.utils.data.DataLoader([data[i % len(data)] for i in range(last + 1)], batch_size=None))
    out = {"timing": [clock.total] + clock.times, "params": clock.params, "profile": profile_report(clock.prof, f"trainer-{schedule}")}
    if stamps is not None:
        out["segments"] = segments(stamps[cfg["warmup"] :])
    return out


def main() -> None:
    common = dict(rounds=2, steps=20, warmup=5, retries=2, max_foreign=0.1, quiet_wait=10.0, budget=120.0, timeout=300.0, pin=False)
    bench = Bench(__doc__, threads=1, **common)
    bench.options(hidden=512, mlp_ratio=(1, "inner width of a block = hidden * mlp_ratio"), blocks=(8, "even: half per stage"), lr=1e-3)
    bench.options(batch=(256, "rows per step"), microbatches=4, modes=(MODES, f"a subset of {MODES + EXTRA}"))
    bench.options(segments=(False, "time the parts of trainer-1f1b's step on each rank (medians)"))
    bench.options(compile=(False, "every side compiles each block (torch.compile, in place) before its warm-up"))
    bench.parser.add_argument("--profile", choices=["cpu", "wall"], default="", help="cProfile the pipelined modes' timed steps")
    args = bench.parse()
    modes = ["single"] + [m for m in args.modes if m != "single"]
    if set(modes) - set(MODES + EXTRA):
        bench.error(f"unknown modes {sorted(set(modes) - set(MODES + EXTRA))}; allowed: {MODES + EXTRA}")
    if args.blocks % 2 or args.batch % args.microbatches:
        bench.error("--blocks must be even and --batch divisible by --microbatches (torch's schedules need equal micro-batches)")
    if args.compile and (zb := [m for m in modes if "zb" in m]):
        bench.error(f"--compile with {zb}: a split backward over compiled blocks is not built; leave them out")
    keys = ("hidden", "mlp_ratio", "blocks", "batch", "microbatches", "steps", "warmup", "lr", "compile")
    cfg = {k: getattr(args, k) for k in keys}

    def show(mode: str, results: list[dict]) -> None:  # --segments, --profile: what each rank measured in this run
        for r, res in enumerate(results):
            if res.get("segments"):
                bench.say(f"    {mode} rank {r} step segments, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in res["segments"].items()))
            if res.get("profile"):
                bench.log(f"\n---- {mode} rank {r} profile (timed steps) ----\n{res['profile']}")

    best, errors = best_runs(bench, job, modes, dict(cfg, profile=args.profile, segments=args.segments), args.rounds, on_run=show)
    bench.keep("best", best)
    single = best["single"]["total"]
    bench.say(f"{', '.join(f'{k}={cfg[k]}' for k in keys)} repeats={args.rounds} (best run)\n")
    table = Table("mode", "samples/s", "ms/step", "samples/s (median step)", "vs single", "median of rounds", "weights vs single", "other load (CPUs)")  # fmt: skip
    for mode in modes:
        s, err = best[mode], f"{errors[mode]:.1e}" if mode in errors else ""
        name = mode + (" per process" if mode == "pair" else "")
        figures = (f"{s['total']:.1f}", f"{s['step_ms']:.1f}", f"{s['median']:.1f}", f"{s['total'] / single:.2f}x", f"{median(s['rounds']):.1f}")  # fmt: skip
        table.add(name, *figures, err, f"{s['foreign']:.2f}")
    bench.table(table)
    for sched in ("gpipe", "1f1b"):
        if f"ours-{sched}" in best and f"torch-{sched}" in best:
            bench.say(f"ours/torch {sched}: {best[f'ours-{sched}']['total'] / best[f'torch-{sched}']['total']:.2f}x")
    for a, b, target in (("trainer-1f1b", "ours-1f1b", " (target >= 0.95)"), ("trainer-single", "single", "")):
        if a in best and b in best:
            bench.say(f"Trainer/raw: {a} / {b} {best[a]['total'] / best[b]['total']:.3f}x{target}")
    mid = {m: median(best[m]["rounds"]) for m in modes}  # our best schedule through the Trainer vs torch's best, medians of rounds
    ours, theirs = (max((m for m in modes if m.startswith(k) and m != "trainer-single"), key=mid.get, default=None) for k in ("trainer-", "torch-"))  # fmt: skip
    if ours and theirs:
        bench.say(f"medians of rounds: {ours} / {theirs} {mid[ours] / mid[theirs]:.3f}x (target >= 1.05), / single {mid[ours] / mid['single']:.3f}x (>= 1.25)")  # fmt: skip
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
