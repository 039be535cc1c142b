"""The Trainer path vs the raw runtime: the same pipeline through Lightning and without it.

Every run trains bench_runtime.py's residual MLP (lightning_pipe.bench.mlp: hidden 512, 8 blocks,
float32, MSE, SGD) on the same fixed batches (256 rows, cycled), one thread per process:

- ``single``          one process, plain PyTorch, whole batch (the reference weights);
- ``trainer-single``  one process, ``lightning.Trainer(devices=1)`` on a LightningModule holding the
                      same nn.Sequential;
- ``raw-1f1b``        2 gloo processes, SequentialPipeline over 1F1B (as bench_runtime.py's ours-1f1b);
- ``trainer-1f1b``    2 processes, ``Trainer(strategy=AutoPipeStrategy(schedule="1f1b", microbatches=4,
                      partition=[blocks/2, blocks/2]), devices=2, accelerator="cpu")`` with logger,
                      checkpointing, progress bar and model summary off.

Both pipelines cut the model into the same two halves and use 4 micro-batches of 64 rows. The
module's ``training_step`` logs its loss (``self.log``), as users' steps do. Every run's processes
are started by lightning_pipe.bench.launch.run_undisturbed (the Trainer runs inside them as under torchrun:
the Lightning environment variables say the processes exist, so Lightning starts none). Process
start, setup and warm-up are outside the timing: samples/s counts ``steps * batch`` over the wall
time from the first timed step's start to the last one's end (a barrier at both ends, as
``timed_steps`` does for the raw runtime); for the Trainer a Callback stamps
``on_train_batch_start`` / ``on_train_batch_end``, so the timed span holds everything Lightning does
per step (loop, hooks, data fetch, optimizer wrapper). The final weights of every mode are compared
with ``single``'s.

``--segments`` times the parts of the Trainer path's step on each rank (the strategy's step, its log
exchange and the replay into ``module.log`` wrapped; medians over the timed steps).
``--profile cpu`` (or ``wall``) runs cProfile over the timed steps of the pipelined modes and prints each rank's
heaviest functions (own time and cumulative; with BENCH_PROFILE_DIR set, the pstats files are
written there too), the numbers behind docs/benchmarks.md's "where the
time went".

    flock /tmp/bench.lock python benchmarks/bench_trainer_path.py
    flock /tmp/bench.lock python benchmarks/bench_trainer_path.py --blocks 16
    python benchmarks/bench_trainer_path.py --modes raw-1f1b,trainer-1f1b --profile cpu --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench.launch import machine_description, run_undisturbed, timed_steps  # noqa: E402
from lightning_pipe.bench.mlp import loss_fn, make_data, make_model, max_rel_error, single_job, stage_half, summarize  # noqa: E402

MODES = ["single", "trainer-single", "raw-1f1b", "trainer-1f1b"]


# ---- profiling (--profile) ----------------------------------------------------------------------
class _Profile:
    """cProfile over the timed steps; the report is text, returned with the results."""

    def __init__(self, clock: str):
        self.profiler = None
        if clock:
            import cProfile

            # cpu: the main thread's CPU time (what Python and the kernels cost, waits excluded, robust to a busy
            # machine); wall: also the time spent waiting for the peer
            self.profiler = cProfile.Profile(time.thread_time if clock == "cpu" else time.perf_counter)

    def start(self) -> None:
        if self.profiler is not None:
            self.profiler.enable()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.disable()

    def report(self, name: str, lines: int = 35) -> str | None:
        if self.profiler is None:
            return None
        import io
        import pstats

        folder = os.environ.get("BENCH_PROFILE_DIR")  # keep the raw stats too (pstats files) for a closer look
        if folder:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.profiler.dump_stats(os.path.join(folder, f"{name}-rank{rank}.pstats"))

        out = io.StringIO()
        stats = pstats.Stats(self.profiler, stream=out)
        stats.sort_stats("tottime").print_stats(lines)
        stats.sort_stats("cumulative").print_stats(lines)
        stats.print_callers(r"distributed_c10d.py.*\((broadcast|all_reduce|barrier|broadcast_object_list)\)")  # who syncs the ranks
        return out.getvalue()


# ---- workers (run in the spawned processes) ----------------------------------------------------
def _raw(rank: int, cfg: dict) -> dict:
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import build_schedule

    model = make_model(cfg)
    data = make_data(cfg)
    chunk = stage_half(model, rank)
    host = SequentialHost({rank: chunk}, 1, loss_fn)
    pipe = SequentialPipeline(build_schedule("1f1b", 2, cfg["microbatches"]), rank, host, Transport(lambda r: r, torch.device("cpu")))
    opt = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"])
    prof = _Profile(cfg["profile"])

    cpu = [0.0]

    def step(i: int) -> None:
        if i == cfg["warmup"]:
            cpu[0] = time.process_time()
            prof.start()
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y)
        opt.step()

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    prof.stop()
    cpu[0] = time.process_time() - cpu[0]
    params = {k: v.detach().clone() for k, v in chunk.state_dict().items()}
    return {"timing": timing, "params": params, "profile": prof.report("raw-1f1b"), "cpu": cpu[0]}


def _lightning_parts(cfg: dict):
    """The LightningModule, the loader and the timing callback (imported in the worker only)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, Dataset

    from lightning_pipe.bench.mlp_module import MLPModule

    class Batches(Dataset):
        """Step i's batch is make_data's batch i mod 4, as the raw runs cycle them."""

        def __init__(self) -> None:
            self.data = make_data(cfg)

        def __len__(self) -> int:
            return cfg["warmup"] + cfg["steps"]

        def __getitem__(self, i: int):
            return self.data[i % len(self.data)]

    class Clock(Callback):
        """Timed steps warmup .. warmup + steps - 1, a barrier at both ends (as timed_steps)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.total = 0.0
            self.prof = _Profile(cfg["profile"])
            self.params: dict = {}

        def _barrier(self) -> None:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == cfg["warmup"]:
                self._barrier()
                self.start = time.perf_counter()
                self.cpu = time.process_time()
                self.prof.start()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= cfg["warmup"]:
                self.times.append(time.perf_counter() - self.t)
            if batch_idx == cfg["warmup"] + cfg["steps"] - 1:
                self.prof.stop()
                self.cpu = time.process_time() - self.cpu
                self._barrier()
                self.total = time.perf_counter() - self.start

        def on_train_end(self, trainer, pl_module):
            # this rank's blocks, keyed as in the whole model (the stage keeps the block indices)
            self.params = {k.split(".", 1)[1]: v.detach().clone() for k, v in pl_module.state_dict().items()}

    # batch_size=None: the dataset's items are the batches, no collation
    return L, MLPModule(cfg), DataLoader(Batches(), batch_size=None, shuffle=False), Clock()


def _trainer(rank: int, world: int, cfg: dict) -> dict:
    if world > 1:  # the processes exist (run_distributed made them, MASTER_ADDR/PORT set): Lightning joins them, as under torchrun
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    import logging
    import warnings

    warnings.filterwarnings("ignore")  # num_workers / log sync advice: not what is measured
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_pipe"):
        logging.getLogger(name).setLevel(logging.WARNING)
    L, module, loader, clock = _lightning_parts(cfg)
    kwargs = dict(
        max_steps=cfg["warmup"] + cfg["steps"],
        accelerator="cpu",
        devices=world,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    if world > 1:
        from lightning_pipe import AutoPipeStrategy

        half = cfg["blocks"] // 2
        kwargs["strategy"] = AutoPipeStrategy(schedule="1f1b", microbatches=cfg["microbatches"], partition=[half, cfg["blocks"] - half])
    stamps = _stamp_segments() if cfg.get("segments") and world > 1 else None
    trainer = L.Trainer(**kwargs)
    trainer.fit(module, loader)
    out = {"timing": [clock.total] + clock.times, "params": clock.params, "profile": clock.prof.report("trainer-1f1b"), "cpu": clock.cpu}
    if stamps is not None:
        out["segments"] = _segments(stamps, cfg["warmup"])
    return out


# ---- where the strategy's step goes (--segments) ---------------------------------------------
def _stamp_segments() -> list[dict]:
    """Wrap the strategy's step (PipelineSteps.train), its log exchange and the replay into
    ``module.log`` so each step records when they start and end (perf_counter); one dict per step."""
    from lightning_pipe.lightning import steps as steps_module
    from lightning_pipe.lightning.logs import LogBroadcaster

    stamps: list[dict] = []
    train, exchange, replay = steps_module.PipelineSteps.train, LogBroadcaster.exchange, steps_module.replay

    def timed_train(self, *args, **kwargs):
        stamps.append({"start": time.perf_counter()})
        result = train(self, *args, **kwargs)
        stamps[-1]["end"] = time.perf_counter()
        return result

    def timed_exchange(self, *args, **kwargs):
        stamps[-1]["exchange"] = time.perf_counter()
        result = exchange(self, *args, **kwargs)
        stamps[-1]["replay"] = time.perf_counter()
        return result

    def timed_replay(*args, **kwargs):
        replay(*args, **kwargs)
        stamps[-1]["replayed"] = time.perf_counter()

    steps_module.PipelineSteps.train, LogBroadcaster.exchange, steps_module.replay = timed_train, timed_exchange, timed_replay
    return stamps


def _segments(stamps: list[dict], warmup: int) -> dict:
    """Medians (ms) over the timed steps: the schedule's run (from the step's entry: split, gradient
    set-aside, the executor), the log exchange, Lightning's ``log`` of the exchanged values, the
    rest of the strategy's step, and the time between one step's end and the next one's start
    (Lightning's closure, optimizer wrapper and step, hooks, data fetch)."""
    timed = stamps[warmup:]
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {
        "run": med([s["exchange"] - s["start"] for s in timed]),
        "exchange": med([s["replay"] - s["exchange"] for s in timed]),
        "log": med([s["replayed"] - s["replay"] for s in timed]),
        "rest of the step": med([s["end"] - s["replayed"] for s in timed]),
        "between steps": med([b["start"] - a["end"] for a, b in zip(timed, timed[1:])]),
    }


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode == "single":
        return single_job(rank, world, cfg)
    if mode == "raw-1f1b":
        return _raw(rank, cfg)
    return _trainer(rank, world, cfg)


def launch(mode: str, cfg: dict, args: argparse.Namespace, patient: bool, label: str) -> tuple[list[dict], float]:
    world = 1 if mode.endswith("single") else 2
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
        # the raw runtime joins its gloo group in the launcher; Lightning makes its own (env://)
        backend="gloo" if mode == "raw-1f1b" else None,
    )


# ---- report ------------------------------------------------------------------------------------
def cpu_note(stats: dict) -> str:
    return f"; CPU ms/step per rank {'/'.join(f'{c:.1f}' for c in stats['cpu'])}" if stats["cpu"] else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8, help="even: the two stages get half each")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode (interleaved); the best is reported")
    p.add_argument("--retries", type=int, default=2, help="re-runs of a run disturbed by other processes")
    p.add_argument("--max-foreign", type=float, default=0.1, help="a run during which other processes used more CPUs is disturbed")
    p.add_argument("--budget", type=float, default=300.0, help="seconds after which disturbed runs are kept and nobody is waited for")
    p.add_argument("--quiet-wait", type=float, default=10.0, help="seconds to wait at most, before each run, for a quiet machine")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument(
        "--profile",
        choices=["cpu", "wall"],
        default="",
        help="cProfile the timed steps of the pipelined modes (CPU or wall time); print each rank's top",
    )
    p.add_argument(
        "--segments",
        action="store_true",
        help="time the parts of trainer-1f1b's step on each rank (the strategy's step wrapped; medians printed)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before its processes are killed")
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; allowed: {MODES}")
    if args.blocks % 2 or args.batch % args.microbatches:
        p.error("--blocks must be even and --batch divisible by --microbatches")
    if "single" not in modes:
        modes.insert(0, "single")
    cfg = dict(
        hidden=args.hidden,
        mlp_ratio=1,
        blocks=args.blocks,
        batch=args.batch,
        microbatches=args.microbatches,
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        profile="",
    )
    print(f"{machine_description()}; 1 thread per process, gloo; config: {cfg}", flush=True)

    best: dict[str, dict] = {}
    errors: dict[str, float] = {}
    reference: dict | None = None
    started = time.monotonic()
    for rep in range(args.repeats):
        for mode in modes:
            patient = time.monotonic() - started < args.budget
            run_cfg = dict(cfg, profile=args.profile if mode.endswith("1f1b") else "", segments=args.segments)
            results, foreign = launch(mode, run_cfg, args, patient, f"run {rep + 1}/{args.repeats} {mode:14s}")
            if mode == "single" and reference is None:
                reference = results[0]["params"]
            stats = summarize(mode, results, cfg)
            stats["foreign"] = foreign
            # CPU time of each process (all its threads) per timed step: the work, whatever the machine's load
            stats["cpu"] = [1000 * r["cpu"] / cfg["steps"] for r in results] if "cpu" in results[0] else []
            print(
                f"  run {rep + 1}/{args.repeats} {mode:14s} {stats['total']:8.1f} samples/s  ({stats['step_ms']:.2f} ms/step,"
                f" foreign load {foreign:.2f} CPUs{cpu_note(stats)})",
                flush=True,
            )
            for r, res in enumerate(results):
                if res.get("segments"):
                    parts = ", ".join(f"{k} {v:.2f}" for k, v in res["segments"].items())
                    print(f"    rank {r} step segments, median ms: {parts}", flush=True)
                if res.get("profile"):
                    print(f"\n---- {mode} rank {r} profile (timed steps) ----\n{res['profile']}", flush=True)
            if mode not in best or stats["total"] > best[mode]["total"]:
                best[mode] = stats
            if mode != "single" and reference is not None:
                errors[mode] = max(errors.get(mode, 0.0), max_rel_error(results, reference))

    single = best["single"]["total"]
    print()
    print(
        f"hidden={args.hidden} blocks={args.blocks} batch={args.batch} microbatches={args.microbatches} steps={args.steps} "
        f"warmup={args.warmup} repeats={args.repeats} (best run)"
    )
    print()
    print(
        "| mode | samples/s | ms/step | samples/s (median step) | vs single | weights vs single | CPU ms/step per rank | other load (CPUs) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        s = best[mode]
        err = f"{errors[mode]:.1e}" if mode in errors else ""
        cpus = " / ".join(f"{c:.1f}" for c in s["cpu"])
        print(
            f"| {mode} | {s['total']:.1f} | {s['step_ms']:.2f} | {s['median']:.1f} | {s['total'] / single:.2f}x | {err} | {cpus} | {s['foreign']:.2f} |"
        )
    print()
    if "raw-1f1b" in best and "trainer-1f1b" in best:
        print(f"Trainer/raw 1f1b: {best['trainer-1f1b']['total'] / best['raw-1f1b']['total']:.3f}x (target >= 0.95)")
    if "trainer-single" in best:
        print(f"Trainer/plain single process: {best['trainer-single']['total'] / single:.3f}x")


if __name__ == "__main__":
    main()
