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
import statistics
import time
from pathlib import Path

import torch

from lightning_pipe.bench import provenance
from lightning_pipe.bench.harness import Bench
from lightning_pipe.bench.shared_cluster import rolling_samples_per_s, run, samples_per_s


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
    bench = Bench(__doc__, dict(steps=40, start=12, stop=26, dwell=4))  # a dwell skips its first 3 iterations
    p = bench.parser
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--start", type=int, default=100)
    p.add_argument("--stop", type=int, default=200)
    p.add_argument("--dwell", type=int, default=12)
    p.add_argument("--work", default="/tmp/bench_adaptive")
    p.add_argument("--out", default=None, help="folder for the pictures")
    p.add_argument("--save", default=None, help="write every run's iteration times and partitions here")
    p.add_argument("--load", default=None, help="skip the runs: analyse a --save file")
    args = bench.parse()
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
    with bench.recording():
        report(results, args)
    if args.out:
        figures(results, args, Path(args.out))
    bench.keep("results", results)
    bench.finish()


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
