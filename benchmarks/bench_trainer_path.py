"""The Trainer path vs the raw runtime: bench_runtime.py's residual MLP (hidden 512, 8 blocks, 4
micro-batches of 64 rows, SGD) as one process (plain PyTorch, and ``Trainer``), as SequentialPipeline
over 1F1B on 2 gloo processes (raw) and as ``Trainer(strategy=AutoPipeStrategy(...))`` with the same
cut (the module logs its loss); samples/s of the best interleaved run, weights vs one process.
``--segments`` times the parts of the Trainer path's step, ``--profile cpu|wall`` cProfiles the timed
steps. Results: docs/predictions.md ("The Trainer path vs the raw runtime").

    flock /tmp/bench.lock python benchmarks/bench_trainer_path.py --repeats 4
    python benchmarks/bench_trainer_path.py --modes trainer-1f1b --repeats 2 --segments
    python benchmarks/bench_trainer_path.py --modes raw-1f1b,trainer-1f1b --profile cpu --repeats 1
    python benchmarks/bench_trainer_path.py --quick
"""

from __future__ import annotations

import os
import statistics
import time

from lightning_pipe.bench.harness import Bench, Table, names, pin_threads

pin_threads(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench.launch import timed_steps  # noqa: E402
from lightning_pipe.bench.mlp import loss_fn, make_data, make_model, max_rel_error, single_job, stage_half, summarize  # noqa: E402

MODES = ["single", "trainer-single", "raw-1f1b", "trainer-1f1b"]


def profiler(clock: str):
    """cProfile over the timed steps (cpu: the main thread's CPU time; wall: the waits too), or None."""
    if not clock:
        return None
    import cProfile

    return cProfile.Profile(time.thread_time if clock == "cpu" else time.perf_counter)


def profile_report(prof, name: str, lines: int = 35) -> str | None:
    """Each rank's heaviest functions (own, cumulative) and who syncs the ranks; BENCH_PROFILE_DIR: the pstats too."""
    if prof is None:
        return None
    import io
    import pstats

    if folder := os.environ.get("BENCH_PROFILE_DIR"):
        prof.dump_stats(os.path.join(folder, f"{name}-rank{dist.get_rank() if dist.is_initialized() else 0}.pstats"))
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    stats.print_callers(r"distributed_c10d.py.*\((broadcast|all_reduce|barrier|broadcast_object_list)\)")
    return out.getvalue()


# ---- workers -------------------------------------------------------------------------------------
def _raw(rank: int, cfg: dict) -> dict:
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import build_schedule

    data, chunk = make_data(cfg), stage_half(make_model(cfg), rank)
    host = SequentialHost({rank: chunk}, 1, loss_fn)
    pipe = SequentialPipeline(build_schedule("1f1b", 2, cfg["microbatches"]), rank, host, Transport(lambda r: r, torch.device("cpu")))
    opt, prof, cpu = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"]), profiler(cfg["profile"]), [0.0]

    def step(i: int) -> None:
        if i == cfg["warmup"]:
            cpu[0] = time.process_time()
            prof and prof.enable()
        opt.zero_grad(set_to_none=True)
        pipe.step(*data[i % len(data)])
        opt.step()

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    prof and prof.disable()
    params = {k: v.detach().clone() for k, v in chunk.state_dict().items()}
    return {"timing": timing, "params": params, "profile": profile_report(prof, "raw-1f1b"), "cpu": time.process_time() - cpu[0]}


def _trainer(rank: int, world: int, cfg: dict) -> dict:
    """The Trainer inside the launched processes, as under torchrun (the environment says they exist)."""
    if world > 1:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    import logging
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_pipe.bench.mlp_module import MLPModule

    warnings.filterwarnings("ignore")  # num_workers / log sync advice: not what is measured
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_pipe"):
        logging.getLogger(name).setLevel(logging.WARNING)
    data, last = make_data(cfg), cfg["warmup"] + cfg["steps"] - 1
    barrier = dist.barrier if world > 1 else (lambda: None)

    class Clock(Callback):
        """Timed steps warmup .. last, a barrier at both ends (as timed_steps)."""

        times: list[float] = []
        prof = profiler(cfg["profile"])

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == cfg["warmup"]:
                barrier()
                self.start, self.cpu = time.perf_counter(), time.process_time()
                self.prof and self.prof.enable()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= cfg["warmup"]:
                self.times.append(time.perf_counter() - self.t)
            if batch_idx == last:
                self.prof and self.prof.disable()
                self.cpu = time.process_time() - self.cpu
                barrier()
                self.total = time.perf_counter() - self.start

        def on_train_end(self, trainer, pl_module):  # this rank's blocks, keyed as in the whole model
            self.params = {k.split(".", 1)[1]: v.detach().clone() for k, v in pl_module.state_dict().items()}

    clock = Clock()
    kwargs = dict(accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    kwargs.update(enable_model_summary=False, num_sanity_val_steps=0, max_steps=last + 1, callbacks=[clock])
    if world > 1:
        from lightning_pipe import AutoPipeStrategy

        half = cfg["blocks"] // 2
        kwargs["strategy"] = AutoPipeStrategy(schedule="1f1b", microbatches=cfg["microbatches"], partition=[half, cfg["blocks"] - half])
    stamps = stamp_segments() if cfg["segments"] and world > 1 else None
    # step i's batch is make_data's batch i mod 4, as the raw runs cycle them; batch_size=None: no collation
    L.Trainer(**kwargs).fit(MLPModule(cfg), torch.utils.data.DataLoader([data[i % len(data)] for i in range(last + 1)], batch_size=None))
    out = {
        "timing": [clock.total] + clock.times,
        "params": clock.params,
        "profile": profile_report(clock.prof, "trainer-1f1b"),
        "cpu": clock.cpu,
    }
    if stamps is not None:  # medians (ms) over the timed steps
        timed = stamps[cfg["warmup"] :]
        med = lambda a, b: 1e3 * statistics.median(s[b] - s[a] for s in timed)  # noqa: E731
        out["segments"] = {
            "run": med("start", "exchange"),  # from the step's entry: split, gradient set-aside, the executor
            "exchange": med("exchange", "replay"),
            "log": med("replay", "replayed"),  # Lightning's log of the exchanged values
            "rest of the step": med("replayed", "end"),
            "between steps": 1e3 * statistics.median(b["start"] - a["end"] for a, b in zip(timed, timed[1:])),
        }
    return out


def stamp_segments() -> list[dict]:
    """Wrap the strategy's step (PipelineSteps.train), its log exchange and the replay into
    ``module.log``: each step records when they start and end (perf_counter); one dict per step."""
    from lightning_pipe.lightning import steps as steps_module
    from lightning_pipe.lightning.logs import LogBroadcaster

    stamps: list[dict] = []

    def stamped(fn, before: str | None, after: str):
        def wrapper(*args, **kwargs):
            if before == "start":
                stamps.append({})
            stamps[-1].update({before: time.perf_counter()} if before else {})
            result = fn(*args, **kwargs)
            stamps[-1][after] = time.perf_counter()
            return result

        return wrapper

    steps_module.PipelineSteps.train = stamped(steps_module.PipelineSteps.train, "start", "end")
    LogBroadcaster.exchange = stamped(LogBroadcaster.exchange, "exchange", "replay")
    steps_module.replay = stamped(steps_module.replay, None, "replayed")
    return stamps


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode == "single":
        return single_job(rank, world, cfg)
    return _raw(rank, cfg) if mode == "raw-1f1b" else _trainer(rank, world, cfg)


def main() -> None:
    bench = Bench(__doc__, rounds=3, steps=40, warmup=5, retries=2, max_foreign=0.1, budget=300.0, quiet_wait=10.0, timeout=300.0)
    p = bench.parser
    p.add_argument("--blocks", type=int, default=8, help="even: the two stages get half each")
    p.add_argument("--modes", type=names, default=MODES, help=f"comma-separated subset of {MODES}")
    p.add_argument("--profile", choices=["cpu", "wall"], default="", help="cProfile the pipelined modes' timed steps (each rank's top)")
    p.add_argument("--segments", action="store_true", help="time the parts of trainer-1f1b's step on each rank (medians)")
    args = bench.parse()
    if [m for m in args.modes if m not in MODES] or args.blocks % 2:
        bench.error(f"--modes: a subset of {MODES}; --blocks even")
    modes = ["single"] + [m for m in args.modes if m != "single"]
    cfg = dict(hidden=512, mlp_ratio=1, blocks=args.blocks, batch=256, microbatches=4, steps=args.steps, warmup=args.warmup, lr=1e-3)
    bench.say(f"1 thread per process, gloo; config: {cfg}")
    best, errors, reference = {}, {}, {}
    for rep in range(args.rounds):
        for mode in modes:
            run_cfg = dict(cfg, profile=args.profile if mode.endswith("1f1b") else "", segments=args.segments)
            world, tag = 1 if mode.endswith("single") else 2, f"run {rep + 1}/{args.rounds} {mode:14s}"
            # the raw runtime joins its gloo group in the launcher; Lightning makes its own (env://)
            results, foreign = bench.run(job, world, mode, run_cfg, label=tag, backend="gloo" if mode == "raw-1f1b" else None)
            reference = reference or results[0]["params"]  # the first single run's weights
            stats = dict(summarize(mode, results, cfg), foreign=foreign)
            # CPU time of each process (all its threads) per timed step: the work, whatever the machine's load
            stats["cpu"] = [1000 * r["cpu"] / cfg["steps"] for r in results] if "cpu" in results[0] else []
            bench.log(f"  {tag} {stats['total']:8.1f} samples/s ({stats['step_ms']:.2f} ms/step, foreign load {foreign:.2f} CPUs)")
            for r, res in enumerate(results):
                if res.get("segments"):
                    bench.say(
                        f"    {mode} rank {r} step segments, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in res["segments"].items())
                    )
                if res.get("profile"):
                    bench.log(f"\n---- {mode} rank {r} profile (timed steps) ----\n{res['profile']}")
            if mode not in best or stats["total"] > best[mode]["total"]:
                best[mode] = stats
            if mode != "single":
                errors[mode] = max(errors.get(mode, 0.0), max_rel_error(results, reference))
    single = best["single"]["total"]
    t = Table("mode", "samples/s", "ms/step", "samples/s (median step)", "vs single", "weights vs single", "CPU ms/step per rank",
              "other load (CPUs)")  # fmt: skip
    for mode, s in ((mode, best[mode]) for mode in modes):
        t.add(mode, f"{s['total']:.1f}", f"{s['step_ms']:.2f}", f"{s['median']:.1f}", f"{s['total'] / single:.2f}x", f"{errors[mode]:.1e}" if mode in errors else "",
              " / ".join(f"{c:.1f}" for c in s["cpu"]), f"{s['foreign']:.2f}")  # fmt: skip
    bench.table(
        t, f"blocks={args.blocks} batch=256 microbatches=4 steps={args.steps} warmup={args.warmup} repeats={args.rounds} (best run)"
    )
    if "raw-1f1b" in best and "trainer-1f1b" in best:
        bench.say(f"Trainer/raw 1f1b: {best['trainer-1f1b']['total'] / best['raw-1f1b']['total']:.3f}x (target >= 0.95)")
    if "trainer-single" in best:
        bench.say(f"Trainer/plain single process: {best['trainer-single']['total'] / single:.3f}x")
    bench.keep("best", best)
    bench.finish()


if __name__ == "__main__":
    main()
