"""Adaptive re-partitioning (AutoPipe-RL part 1) in an emulated shared cluster: static vs adaptive vs oracle.

2 pinned gloo processes train a GPT-tiny-like CausalLM (lightning_pipe.bench.shared_cluster); a busy
loop joins rank 1's core from --start to --stop. Runs: a sweep of every cut under the load (the
oracle's knowledge), static, adaptive=true, oracle. Measured: samples/s before / during / after the
job, adaptive's recovery of the oracle's gain, its switches, the monitor's cost. Feeds
docs/adaptive.md ("Shared-cluster emulation") and docs/img/adaptive_throughput.png.

    flock /tmp/bench.lock python benchmarks/bench_adaptive.py --out docs/img --save docs/adaptive_results.json
    python benchmarks/bench_adaptive.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lightning_pipe.bench import provenance
from lightning_pipe.bench.harness import Bench, Table
from lightning_pipe.bench.shared_cluster import add_options, dwell_medians, plot_runs, results_of, run, samples_per_s


def meter_call_cost(repeats: int = 20000) -> float:
    """Seconds of the meter's work (start + stop) per compute action, in process."""
    from lightning_pipe.adaptive.meter import StepMeter

    meter, started = StepMeter(torch.device("cpu")), time.perf_counter()
    for _ in range(repeats):
        meter.stop(meter.start(), forward=True)
    return (time.perf_counter() - started) / repeats


def measure(args) -> dict:
    results = {"provenance": provenance()}
    cuts = list(range(1, 10))
    plan = {args.start + k * args.dwell: [[0, x], [x, 10]] for k, x in enumerate(cuts)}
    sweep_steps = args.start + len(cuts) * args.dwell
    sweep_args = argparse.Namespace(**{**vars(args), "steps": sweep_steps, "stop": sweep_steps + 1})
    results["sweep"] = run("sweep", sweep_args, plan, False, "autopipe")
    results["static"] = run("static", args, {}, False, "autopipe")
    planned = results["static"]["bounds"][0]  # every other run starts from it (a fresh plan is noisy)
    first = [planned[0][1], 10 - planned[0][1]]
    dwell = dwell_medians(results["sweep"]["times"], args.start, args.dwell, cuts)
    best = min(dwell, key=dwell.get)
    results["sweep_medians_ms"] = {str(x): v * 1e3 for x, v in dwell.items()}
    results["oracle_bounds"] = [[0, best], [best, 10]]
    results["adaptive"] = run("adaptive", args, {}, True, first)
    results["oracle"] = run("oracle", args, {args.start: results["oracle_bounds"], args.stop: planned}, False, first)
    results["meter_compute_call_s"] = meter_call_cost()
    return results


def report(bench: Bench, results: dict, args) -> None:
    bench.say(results["provenance"])
    bench.say(f"sweep under load (median ms per iteration by cut after block x): {results['sweep_medians_ms']}")
    bench.say(f"planned {results['static']['bounds'][0]}, oracle under load {results['oracle_bounds']}")
    phases = {"before": (10, args.start), "during": (args.start, args.stop), "after": (args.stop, args.steps)}
    t = Table("run", *(f"{k} samples/s" for k in phases))
    rate = {}
    for name in ("static", "adaptive", "oracle"):
        rate[name] = {k: samples_per_s(results[name]["times"], lo, hi) for k, (lo, hi) in phases.items()}
        t.add(name, *(f"{v:.1f}" for v in rate[name].values()))
    bench.table(t)
    s, a, o = (rate[n]["during"] for n in ("static", "adaptive", "oracle"))
    recovered = f"recovered {(a - s) / (o - s) if o != s else float('nan'):.0%} of the oracle's gain"
    bench.say(f"during the job: oracle {o / s - 1:+.1%} over static, adaptive {a / s - 1:+.1%}: {recovered}")
    after = {n: f"{rate[n]['after'] / rate['static']['after'] - 1:+.1%}" for n in ("adaptive", "oracle")}
    bench.say(f"after the job vs static: adaptive {after['adaptive']}; oracle {after['oracle']} (static's partition: run-to-run noise)")
    adaptive = results["adaptive"]
    step = statistics.median(adaptive["times"][10 : args.start])
    bench.say(f"adaptive switches: {adaptive['switches']}")
    cost = adaptive["monitor_s"] + adaptive["decision_s"]
    bench.say(
        f"monitor: gather + derive {adaptive['monitor_s'] * 1e3:.3f} ms per iteration, scoring {adaptive['decision_s'] * 1e3:.3f} ms "
        f"per iteration, meter {results['meter_compute_call_s'] * 1e6:.2f} us per compute action; median iteration {step * 1e3:.1f} ms "
        f"-> {cost / step:.2%} of the step"
    )
    for lo, hi, what in ((10, args.start, "before"), (args.start + 10, args.stop, "during"), (args.stop + 10, args.steps, "after")):
        factors = [f for f in adaptive["slowdown"][lo:hi] if f is not None]
        predicted = [x for x in adaptive["predicted"][lo:hi] if x is not None]
        if factors:
            bench.say(
                f"adaptive run {what}: rank 1 / rank 0 slowdown {statistics.median(f[1] / f[0] for f in factors):.2f}; iteration measured "
                f"{statistics.median(adaptive['times'][lo:hi]) * 1e3:.1f} ms, simulated {statistics.median(predicted) * 1e3:.1f} ms"
            )
    quiet = statistics.median(results["static"]["times"][10 : args.start])
    bench.say(f"quiet phase median iteration: static {quiet * 1e3:.1f} ms, adaptive {step * 1e3:.1f} ms ({step / quiet - 1:+.1%})")


def main() -> None:
    bench = Bench(__doc__, dict(steps=40, start=12, stop=26, dwell=4))  # a dwell skips its first 3 iterations
    add_options(bench.parser, "/tmp/bench_adaptive", steps=300, start=100, stop=200, dwell=12)
    args = bench.parse()
    results = results_of(args, measure)
    report(bench, results, args)
    if args.out:
        title = "Shared-cluster emulation: 2 CPU processes, a busy loop joins rank 1's core"
        widths = {"static": 5, "adaptive": 2.5, "oracle": 1.2}
        plot_runs(results, widths, [(args.start, args.stop, "0.9")], title, "iteration", Path(args.out) / "adaptive_throughput.png")
    bench.keep("results", results)
    bench.finish()


if __name__ == "__main__":
    main()
