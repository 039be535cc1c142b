"""Adaptive re-partitioning (AutoPipe-RL part 1) in an emulated shared cluster: static vs adaptive vs oracle.

The shared cluster of the paper's §5.3 on this machine: 2 gloo processes x 1 thread, rank r pinned to
core r (every thread of the process, gloo's included). At iteration --start a competing CPU-bound
job (a Python busy loop) is started on rank 1's core, as the paper adds training jobs to a worker's
GPU; at --stop it ends. Real compute throughout (no emulated devices): a GPT-tiny-like CausalLM
(4 layers, hidden 128, 4 heads, seq 64, byte vocabulary, tied embedding / head: 10 blocks), batch
16 in 4 micro-batches, 1F1B, AdamW, through ``Trainer(strategy=AutoPipeStrategy(...))``.

Runs (each --steps iterations, the same data and seed):
``sweep``     the oracle's knowledge: with the competing job on from --start, every 2-stage cut is
              run for --dwell iterations (``strategy.repartition``); the fastest under load is the
              oracle's partition (measured, not predicted).
``static``    the partition planned at setup (partition="autopipe"), kept.
``adaptive``  pipeline.adaptive=true with the default rule (gain 5%, interval 20, window 5).
``oracle``    static, but switched to the sweep's best-under-load partition exactly at --start and
              back to the planned one at --stop (perfect knowledge of the change, no detection delay).

Printed: samples/s of each run before, during and after the competing job; the adaptive run's
recovery of the oracle's gain over static while the job runs, (A - S) / (O - S) (target >= 80%);
its switches; the monitor's cost (gather + derive per iteration, and the meter's calls during the
step, timed in-process) against the step time. Pictures: throughput over iterations, and the
partition over time. Results: docs/adaptive.md.

    flock /tmp/bench.lock python benchmarks/bench_adaptive.py --out docs/img --save docs/adaptive_results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.bench import provenance
from lightning_pipe.models import CausalLM, ModelConfig

CFG = dict(vocab_size=260, n_layer=4, n_head=4, d_model=128, max_seq_len=64)
BATCH, SEQ, M = 16, 64, 4


def pin_process(core: int) -> None:
    """Every thread of this process (gloo's background threads too) on `core`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass
    torch.set_num_threads(1)


class SharedCluster(Callback):
    """Pins the ranks, starts / stops the competing jobs (rank 0 owns them; `jobs`: (start, stop, core)
    iterations), records rank 0's iteration times and partitions, applies a scripted partition plan
    {iteration: bounds}."""

    def __init__(self, jobs: list, plan: dict, out: str):
        self.jobs, self.plan, self.out = jobs, plan, out
        self.procs: dict = {}
        self.times, self.bounds, self.last = [], [], None
        self.slowdown, self.predicted = [], []  # the adaptive run's monitor: per-rank factors, scorer's time of the current partition

    def setup(self, trainer, pl_module, stage):
        pin_process(trainer.global_rank % os.cpu_count())

    def _job(self, k: int, on: bool) -> None:
        if on and k not in self.procs:
            code = f"import os; os.sched_setaffinity(0, {{{self.jobs[k][2]}}}); x = 0\nwhile True: x += 1"
            self.procs[k] = subprocess.Popen([sys.executable, "-c", code])
        elif not on and k in self.procs:
            proc = self.procs.pop(k)
            proc.kill()
            proc.wait()

    def _stop_all(self) -> None:
        for k in list(self.procs):
            self._job(k, False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        i = trainer.fit_loop.total_batch_idx
        for k, (start, stop, _) in enumerate(self.jobs):
            if trainer.global_rank == 0 and i == start:
                self._job(k, True)
            if trainer.global_rank == 0 and i == stop:
                self._job(k, False)
        if i in self.plan:
            trainer.strategy.repartition(self.plan[i])
        if self.last is None:
            self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        self.bounds.append([list(b) for b in trainer.strategy.cut.bounds])
        adaptive = trainer.strategy.adaptive
        latest = adaptive.monitor.latest if adaptive is not None and adaptive.monitor is not None else None
        if latest is not None and latest.microbatches == M:
            window = list(adaptive.monitor.history) or [latest]
            schedule = trainer.strategy.mode.executor("train", M).schedule
            self.slowdown.append(list(latest.slowdown(adaptive.monitor.static)))
            self.predicted.append(adaptive.scorer(window, schedule, latest.bounds))
        else:
            self.slowdown.append(None)
            self.predicted.append(None)

    def on_train_end(self, trainer, pl_module):
        self._stop_all()
        if trainer.global_rank != 0:
            return
        adaptive = trainer.strategy.adaptive
        report = {
            "times": self.times,
            "bounds": self.bounds,
            "slowdown": self.slowdown,
            "predicted": self.predicted,
            "switches": [],
            "monitor_s": None,
            "decision_s": None,
        }
        if adaptive is not None:
            report["switches"] = [
                {"iteration": s.iteration, "old": s.old, "new": s.new, "gain": s.predicted_gain, "seconds": s.seconds}
                for s in adaptive.switches
            ]
            report["evaluations"] = adaptive.evaluations
            report["decision_total_s"] = adaptive.decision_seconds
            if adaptive.decider is not None:
                report["adapted_steps"] = adaptive.decider.scorer.adapted
            if adaptive.monitor is not None:
                report["monitor_s"] = adaptive.monitor.seconds / max(1, adaptive.monitor.iterations)
                report["decision_s"] = adaptive.decision_seconds / max(1, adaptive.monitor.iterations)
        Path(self.out).write_text(json.dumps(report))

    def on_exception(self, trainer, pl_module, exception):
        self._stop_all()


def data(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (steps * BATCH, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=BATCH)


def run(name: str, args, plan: dict, adaptive, partition, jobs=None) -> dict:
    torch.manual_seed(0)
    model = CausalLM(model=ModelConfig(**CFG), lr=1e-3, warmup_steps=10, max_steps=args.steps)
    out = Path(args.work) / f"{name}.json"
    callback = SharedCluster(jobs if jobs is not None else [(args.start, args.stop, 1)], plan, str(out))
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=M, partition=partition, adaptive=adaptive, start_method="spawn")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(Path(args.work) / name),
    )
    started = time.perf_counter()
    trainer.fit(model, data(args.steps))
    report = json.loads(out.read_text())
    report["wall_s"] = time.perf_counter() - started
    print(f"{name}: {report['wall_s']:.0f} s, switches {[(s['iteration'], s['new']) for s in report['switches']]}", flush=True)
    return report


def samples_per_s(times: list[float], lo: int, hi: int) -> float:
    return BATCH * (hi - lo) / sum(times[lo:hi])


def rolling_samples_per_s(times: list[float], k: int = 5) -> list[float]:
    """Samples/s over the last k iterations (fewer at the start), for the pictures."""
    return [BATCH * len(times[max(0, i - k + 1) : i + 1]) / sum(times[max(0, i - k + 1) : i + 1]) for i in range(len(times))]


def meter_call_cost(repeats: int = 20000) -> float:
    """Seconds of the meter's work per compute action (start + stop) and per message (sent + waiting), in process."""
    from lightning_pipe.adaptive.meter import StepMeter

    meter = StepMeter(torch.device("cpu"))
    started = time.perf_counter()
    for _ in range(repeats):
        meter.stop(meter.start(), forward=True)
    return (time.perf_counter() - started) / repeats


def figures(results: dict, args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in ("static", "adaptive", "oracle"):
        times = results[name]["times"]
        smooth = rolling_samples_per_s(times)
        top.plot(range(len(times)), smooth, label=name)
        width = {"static": 5, "adaptive": 2.5, "oracle": 1.2}[name]  # drawn over each other where equal
        bottom.plot(range(len(times)), [b[0][1] for b in results[name]["bounds"]], label=name, drawstyle="steps-post", linewidth=width)
    for ax in (top, bottom):
        ax.axvspan(args.start, args.stop, color="0.9", label="competing job on rank 1's core")
    top.set_ylabel("samples/s (5-iteration mean)")
    bottom.set_ylabel("blocks on rank 0 (of 10)")
    bottom.set_xlabel("iteration")
    top.legend(loc="lower left", fontsize=8)
    top.set_title("Shared-cluster emulation: 2 CPU processes, a busy loop joins rank 1's core")
    fig.tight_layout()
    fig.savefig(out / "adaptive_throughput.png", dpi=110)
    print(f"wrote {out / 'adaptive_throughput.png'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--start", type=int, default=100)
    p.add_argument("--stop", type=int, default=200)
    p.add_argument("--dwell", type=int, default=12)
    p.add_argument("--work", default="/tmp/bench_adaptive")
    p.add_argument("--out", default=None, help="folder for the pictures")
    p.add_argument("--save", default=None, help="write every run's iteration times and partitions here")
    p.add_argument("--load", default=None, help="skip the runs: analyse a --save file")
    args = p.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.load:
        results = json.loads(Path(args.load).read_text())
    else:
        results = {"provenance": provenance()}
        cuts = list(range(1, 10))
        plan = {args.start + k * args.dwell: [[0, x], [x, 10]] for k, x in enumerate(cuts)}
        sweep_steps = args.start + len(cuts) * args.dwell
        sweep_args = argparse.Namespace(**{**vars(args), "steps": sweep_steps, "stop": sweep_steps + 1})
        results["sweep"] = run("sweep", sweep_args, plan, False, "autopipe")
        results["static"] = run("static", args, {}, False, "autopipe")
        planned = results["static"]["bounds"][0]  # every other run starts from it (a fresh plan is noisy)
        first = [planned[0][1], 10 - planned[0][1]]
        sweep = results["sweep"]["times"]
        dwell = {
            x: statistics.median(sweep[args.start + k * args.dwell + 3 : args.start + (k + 1) * args.dwell]) for k, x in enumerate(cuts)
        }
        best = min(dwell, key=dwell.get)
        results["sweep_medians_ms"] = {str(x): v * 1e3 for x, v in dwell.items()}
        results["oracle_bounds"] = [[0, best], [best, 10]]
        results["adaptive"] = run("adaptive", args, {}, True, first)
        results["oracle"] = run("oracle", args, {args.start: results["oracle_bounds"], args.stop: planned}, False, first)
        results["meter_compute_call_s"] = meter_call_cost()
        if args.save:
            Path(args.save).write_text(json.dumps(results, indent=1))
    report(results, args)
    if args.out:
        figures(results, args, Path(args.out))


def report(results: dict, args) -> None:
    print(results["provenance"])
    print(f"sweep under load (median ms per iteration by cut after block x): {results['sweep_medians_ms']}")
    print(f"planned {results['static']['bounds'][0]}, oracle under load {results['oracle_bounds']}")
    phases = {"before": (10, args.start), "during": (args.start, args.stop), "after": (args.stop, args.steps)}
    print(f"{'run':<10}" + "".join(f"{k + ' samples/s':>20}" for k in phases))
    rate = {}
    for name in ("static", "adaptive", "oracle"):
        times = results[name]["times"]
        rate[name] = {k: samples_per_s(times, lo, hi) for k, (lo, hi) in phases.items()}
        print(f"{name:<10}" + "".join(f"{rate[name][k]:>20.1f}" for k in phases))
    s, a, o = (rate[n]["during"] for n in ("static", "adaptive", "oracle"))
    recovered = (a - s) / (o - s) if o != s else float("nan")
    print(f"during the job: oracle +{o / s - 1:.1%} over static, adaptive +{a / s - 1:.1%}: recovered {recovered:.0%} of the oracle's gain")
    after = {n: rate[n]["after"] / rate["static"]["after"] - 1 for n in ("adaptive", "oracle")}
    # after the job static and oracle run the same partition: their difference is the noise between runs
    print(
        f"after the job: adaptive {after['adaptive']:+.1%} vs static; oracle {after['oracle']:+.1%} (same partition as static: run-to-run noise)"
    )
    adaptive = results["adaptive"]
    step = statistics.median(adaptive["times"][10 : args.start])
    print(f"adaptive switches: {adaptive['switches']}")
    print(
        f"monitor: gather + derive {adaptive['monitor_s'] * 1e3:.3f} ms per iteration, scoring {adaptive['decision_s'] * 1e3:.3f} ms "
        f"per iteration (averaged), meter {results['meter_compute_call_s'] * 1e6:.2f} us per compute action; "
        f"median iteration {step * 1e3:.1f} ms -> {(adaptive['monitor_s'] + adaptive['decision_s']) / step:.2%} of the step"
    )
    for lo, hi, what in ((10, args.start, "before"), (args.start + 10, args.stop, "during"), (args.stop + 10, args.steps, "after")):
        factors = [f for f in adaptive["slowdown"][lo:hi] if f is not None]
        predicted = [x for x in adaptive["predicted"][lo:hi] if x is not None]
        if factors:
            ratio = statistics.median(f[1] / f[0] for f in factors)
            print(
                f"adaptive run {what}: rank 1 / rank 0 measured slowdown {ratio:.2f}; iteration measured "
                f"{statistics.median(adaptive['times'][lo:hi]) * 1e3:.1f} ms, simulator on measured costs {statistics.median(predicted) * 1e3:.1f} ms"
            )
    quiet = statistics.median(results["static"]["times"][10 : args.start]), step
    print(
        f"quiet phase median iteration: static {quiet[0] * 1e3:.1f} ms, adaptive {quiet[1] * 1e3:.1f} ms ({quiet[1] / quiet[0] - 1:+.1%})"
    )


if __name__ == "__main__":
    main()
