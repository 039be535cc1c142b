"""Adaptive re-partitioning (AutoPipe-RL) in an emulated shared cluster (benchmarks.harness.shared_cluster).

Default: a busy loop on rank 1's core from --start to --stop; a sweep of every cut under the load (the
oracle's knowledge), static, adaptive=true, oracle (docs/results/adaptive.md, "Shared-cluster emulation").
``--changing``: jobs join rank 1's core at --t1, rank 0's at --t2, both leave at --t3; static, rule,
learned (ours), paper (the paper's networks), oracle and the predictor against the sweep ("Changing
load"). ``--decision-time``: one learned decision for paper-size models.

    flock /tmp/bench.lock python -m benchmarks.bench_adaptive --out docs/img --save docs/results/adaptive_results.json
    flock /tmp/bench.lock python -m benchmarks.bench_adaptive --changing --out docs/img --save docs/results/adaptive_learned_results.json
    python -m benchmarks.bench_adaptive --decision-time
    python -m benchmarks.bench_adaptive [--changing] --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import provenance
from benchmarks.harness.bench import Bench, Table, pyplot, save_figure
from benchmarks.harness.shared_cluster import add_options, dwell_medians, plot_runs, results_of, run, samples_per_s
from lightning_pipe.adaptive.offline import spearman


def meter_call_cost(repeats: int = 20000) -> float:
    """Seconds of the meter's work (start + stop) per compute action, in process."""
    from lightning_pipe.adaptive.meter import StepMeter

    meter, started = StepMeter(torch.device("cpu")), time.perf_counter()
    for _ in range(repeats):
        meter.stop(meter.start(), forward=True)
    return (time.perf_counter() - started) / repeats


def measure_one(args) -> dict:
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


def report_one(bench: Bench, results: dict, args) -> None:
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


CUTS = list(range(1, 10))


def phases(args) -> list[tuple[str, int, int, int]]:
    """(name, first, end, jobs running) of the run."""
    ends = (0, args.t1, args.t2, args.t3, args.steps)
    return [(name, ends[k], ends[k + 1], (0, 1, 2, 0)[k]) for k, name in enumerate(("quiet", "job 1", "jobs 1+2", "quiet again"))]


def sweep(args) -> dict:
    """Every cut under 0, 1 and 2 jobs; medians of each dwell after 3 settling iterations."""
    start, d, n = 10, args.dwell, len(CUTS)
    plan = {start + (load * n + k) * d: [[0, x], [x, 10]] for load in range(3) for k, x in enumerate(CUTS)}
    one, two, end = start + n * d, start + 2 * n * d, start + 3 * n * d
    sweep_args = argparse.Namespace(**{**vars(args), "steps": end})
    times = run("sweep", sweep_args, plan, False, [5, 5], jobs=[(one, end + 1, 1), (two, end + 1, 0)])["times"]
    return {load: dwell_medians(times, first, d, CUTS) for load, first in ((0, start), (1, one), (2, two))}


def decision_time(model: str, depth: int, microbatches: int, repeats: int = 20) -> tuple:
    """Blocks, candidates, median and max ms of one learned decision (adapt + score every neighbour
    candidate + arbiter) for a paper-size model from its analytic profile (planning/flops.py), with
    a synthetic monitor window (rank 1 twice as slow): no job needed."""
    from lightning_pipe.adaptive.learned import LearnedDecider, load_learned
    from lightning_pipe.adaptive.monitor import IterationMetrics, StaticMetrics
    from lightning_pipe.adaptive.offline import balanced
    from lightning_pipe.planning.flops import transformer_costs

    costs, _ = transformer_costs(model, 1)
    static = StaticMetrics(costs.activation_bytes, (0.0, *costs.activation_bytes[:-1]), costs.param_bytes, costs.forward, costs.backward)
    bounds = balanced([f + b for f, b in zip(costs.forward, costs.backward)], depth)
    per_rank = [microbatches * sum(costs.forward[b] + costs.backward[b] for b in range(lo, hi)) for lo, hi in bounds]
    busy, links = [t * (2.0 if r == 1 else 1.0) for r, t in enumerate(per_rank)], {(r, r + 1): 1e10 for r in range(depth - 1)}
    f, b, wall = tuple(0.33 * t for t in busy), tuple(0.67 * t for t in busy), (max(per_rank) * 2.5,) * depth
    window = [IterationMetrics(i, microbatches, bounds, tuple(range(depth)), f, b, wall, dict(links), dict(links)) for i in range(5)]
    decider = LearnedDecider(load_learned(None, depth), static, "1f1b", microbatches)
    for w in window:
        decider.scorer.observe(window[: window.index(w) + 1], max(w.wall_s))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        verdict = decider.decide(window, 1000, 100, 1e10)
        seconds.append(time.perf_counter() - started)
    return len(costs.forward), len(verdict.scores) - 1, f"{statistics.median(seconds) * 1e3:.1f}", f"{max(seconds) * 1e3:.1f}"


def measure_changing(args) -> dict:
    results = {"provenance": provenance()}
    medians = sweep(args)
    results["sweep_medians_ms"] = {str(k): {str(x): v * 1e3 for x, v in m.items()} for k, m in medians.items()}
    best = {load: min(m, key=m.get) for load, m in medians.items()}
    results["oracle_cuts"] = {str(k): v for k, v in best.items()}
    jobs = [(args.t1, args.t3, 1), (args.t2, args.t3, 0)]
    results["static"] = run("static", args, {}, False, "autopipe", jobs=jobs)
    planned = results["static"]["bounds"][0]
    first = [planned[0][1], 10 - planned[0][1]]
    plan = {start: [[0, best[load]], [best[load], 10]] for _, start, _, load in phases(args)}
    for name, scripted, adaptive in (*((mode, {}, mode) for mode in DECIDERS), ("oracle", plan, False)):
        results[name] = run(name, args, scripted, adaptive, first, jobs=jobs)
    return results


DECIDERS = ("rule", "learned", "paper")  # the adaptive modes --changing compares


def load_at(args, iteration: int) -> int:
    return next(load for _, lo, hi, load in phases(args) if lo <= iteration < hi)


def report_changing(bench: Bench, results: dict, args) -> None:
    bench.say(results["provenance"])
    bench.say(f"sweep medians ms by jobs running -> cut: {results['sweep_medians_ms']}")
    bench.say(f"oracle cuts by jobs running: {results['oracle_cuts']}")
    # every run trains the same batches to the same weights (a switch keeps training exact), so the time
    # to any loss target is the time to its iteration; the last target's is the time to the last iteration
    t = Table("run", "s to the last iteration", "all samples/s", *(name for name, *_ in phases(args)), "switches", "oracle's gain")
    total = {}
    runs = [n for n in ("static", *DECIDERS, "oracle") if n in results]  # a --load of an older file may lack paper
    for n in runs:
        total[n] = samples_per_s(results[n]["times"], 10, args.steps)
    gain = lambda n: (total[n] - total["static"]) / (total["oracle"] - total["static"])  # noqa: E731
    for n in runs:
        times = results[n]["times"]
        cells = (f"{samples_per_s(times, max(lo, 10), hi):.1f}" for _, lo, hi, _ in phases(args))
        t.add(n, f"{sum(times[10 : args.steps]):.1f}", f"{total[n]:.1f}", *cells, len(results[n]["switches"]), f"{gain(n):.0%}")
    bench.table(t)
    for n in runs[1:-1]:
        bench.say(f"{n} switches: {[(s['iteration'], s['new'][0][1]) for s in results[n]['switches']]}")
    bench.say(
        f"learned vs rule over the run: {total['learned'] / total['rule'] - 1:+.1%} samples/s, {len(results['learned']['switches'])} vs "
        f"{len(results['rule']['switches'])} switches; oracle's gain over static recovered: "
        + ", ".join(f"{n} {gain(n):.0%}" for n in runs[1:-1])
    )
    if "paper" in results:
        paper = results["paper"]
        rewards = paper.get("rewards") or []
        bench.say(
            f"paper: decisions {paper['decision_total_s'] * 1e3:.0f} ms in all = {paper['decision_total_s'] / sum(paper['times']):.2%} of the "
            f"run's time; predictor online gradient steps {paper.get('adapted_steps')}; arbiter rewards measured (switched, reward): "
            f"{[(s, round(r, 3)) for s, r in rewards if s]}, {sum(1 for s, _ in rewards if not s)} stays"
        )
    learned, evaluations = results["learned"], results["learned"].get("evaluations", [])
    if not evaluations:
        return
    decisions = [e["decision_s"] * 1e3 for e in evaluations]
    step = statistics.median(learned["times"][10 : args.t1])
    share = (learned["monitor_s"] + learned["decision_total_s"] / len(learned["times"])) / step
    bench.say(
        f"learned decision time: median {statistics.median(decisions):.2f} ms, max {max(decisions):.2f} ms ({len(decisions)} decisions); "
        f"monitor {learned['monitor_s'] * 1e3:.3f} ms per iteration; all of it {share:.2%} of a {step * 1e3:.0f} ms step; "
        f"online gradient steps {learned.get('adapted_steps')}"
    )
    adapting = sum(e["adapt_s"] for e in evaluations)
    bench.say(f"online adaptation: {adapting * 1e3:.1f} ms in all = {adapting / sum(learned['times']):.2%} of the run's time")
    medians = {int(k): {int(x): v for x, v in m.items()} for k, m in results["sweep_medians_ms"].items()}
    for k, col in (("offline", 2), ("adapted", 1)):  # scores: (candidate, adapted, offline) seconds
        measured = lambda e: [medians[load_at(args, e["iteration"])][s[0][0][1]] for s in e["scores"]]  # noqa: E731
        rho = [spearman([s[col] for s in e["scores"]], measured(e)) for e in evaluations]
        err = [abs(e["scores"][0][col] / e["measured_s"] - 1) for e in evaluations]
        bench.say(
            f"predictor {k:<8}: rank correlation over the 9 cuts vs the sweep's measured times, median {statistics.median(rho):.2f} "
            f"(min {min(rho):.2f}); relative error on the running cut's measured iteration, median {statistics.median(err):.1%}"
        )


def predictions_figure(results: dict, args, out: Path) -> None:
    """Per load: the sweep's measured iteration time of every cut, and the predictor's (offline and
    adapted) at the learned run's last decision under that load."""
    evaluations = results["learned"].get("evaluations", [])
    medians = {int(k): {int(x): v for x, v in m.items()} for k, m in results["sweep_medians_ms"].items()}
    fig, axes = pyplot().subplots(1, 3, figsize=(12, 3.6))
    for ax, load in zip(axes, (0, 1, 2)):
        last = [e for e in evaluations if load_at(args, e["iteration"]) == load and e["iteration"] >= 10]
        ax.plot(CUTS, [medians[load][c] for c in CUTS], "k-o", label="measured (sweep)")
        if last:
            scores = sorted(last[-1]["scores"], key=lambda x: x[0][0][1])
            ax.plot([x[0][0][1] for x in scores], [x[2] * 1e3 for x in scores], "--", label="predicted, offline")
            ax.plot([x[0][0][1] for x in scores], [x[1] * 1e3 for x in scores], "-", label="predicted, adapted")
            ax.set_title(f"{load} job(s): decision at iteration {last[-1]['iteration']}", fontsize=9)
        ax.set_xlabel("cut after block (rank 0 holds blocks 0..cut-1)")
    axes[0].set_ylabel("iteration ms")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / "adaptive_learned_predictions.png")


ITERATIONS = {  # experiment -> the iteration options' defaults, and --quick's (a dwell skips its first 3 iterations)
    "one": (dict(steps=300, start=100, stop=200, dwell=12), dict(steps=40, start=12, stop=26, dwell=4)),
    "changing": (dict(steps=400, t1=100, t2=200, t3=300, dwell=10), dict(steps=48, t1=12, t2=24, t3=36, dwell=4)),
}


def decision_times(bench: Bench, args) -> None:
    t = Table("model", "blocks", "depth", "candidates", "median ms", "max ms")
    for model, depth in (("gpt2-1.3b", 4), ("bert-large", 4), ("gpt2-1.3b", 2)):
        blocks, candidates, *times = decision_time(model, depth, 4 * depth, repeats=3 if args.quick else 20)
        t.add(model, blocks, depth, candidates, *times)
    bench.table(t)


def main() -> None:
    bench = Bench(__doc__)
    add_options(bench.parser, "/tmp/bench_adaptive", **dict.fromkeys(("steps", "start", "stop", "t1", "t2", "t3", "dwell")))
    bench.parser.add_argument("--changing", action="store_true", help="the changing load: static vs rule vs learned vs paper vs oracle")
    bench.parser.add_argument("--decision-time", action="store_true", help="only time a learned decision for paper-size models")
    args = bench.parse()
    changing = args.changing
    for key, value in ITERATIONS["changing" if changing else "one"][args.quick].items():
        setattr(args, key, value if args.quick or getattr(args, key) is None else getattr(args, key))
    if args.decision_time:
        decision_times(bench, args)
        return bench.finish()
    if changing:
        os.environ["LIGHTNING_PIPE_ADAPTIVE_EVALUATE"] = "1"  # the learned run records its predictions (inherited by the workers)
    results = results_of(args, measure_changing if changing else measure_one)
    (report_changing if changing else report_one)(bench, results, args)
    if args.out and changing:
        spans = [(args.t1, args.t2, "0.92"), (args.t2, args.t3, "0.82")]
        title = "Changing load: static vs rule vs learned vs paper vs oracle (2 CPU processes)"
        xlabel = "iteration (light: a job on rank 1's core; dark: and one on rank 0's)"
        widths = {n: w for n, w in {"static": 5, "rule": 3.5, "learned": 2.5, "paper": 1.5, "oracle": 1}.items() if n in results}
        plot_runs(results, widths, spans, title, xlabel, Path(args.out) / "adaptive_learned_throughput.png")
        predictions_figure(results, args, Path(args.out))
    elif args.out:
        title = "Shared-cluster emulation: 2 CPU processes, a busy loop joins rank 1's core"
        widths = {"static": 5, "adaptive": 2.5, "oracle": 1.2}
        plot_runs(results, widths, [(args.start, args.stop, "0.9")], title, "iteration", Path(args.out) / "adaptive_throughput.png")
    bench.keep("results", results)
    bench.finish()


if __name__ == "__main__":
    main()
