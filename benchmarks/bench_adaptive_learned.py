"""AutoPipe-RL part 2 in the emulated shared cluster with a changing load: static vs rule vs learned vs oracle.

The setting of bench_adaptive.py (2 gloo processes x 1 thread pinned to cores 0 and 1, the
GPT-tiny-like CausalLM, batch 16 in 4 micro-batches, 1F1B, real compute) with the load of the
paper's §5.3: a competing CPU-bound job arrives on rank 1's core at iteration --t1, another on rank
0's core at --t2, both leave at --t3; --steps iterations in all.

Runs:
``sweep``    perfect knowledge for the oracle: every 2-stage cut run --dwell iterations quiet, then
             with job 1, then with both jobs; the fastest measured cut of each load is the oracle's.
``static``   the partition planned at setup, kept.
``rule``     adaptive=rule (part 1: the simulator on measured costs, 5% over the rest of the run).
``learned``  adaptive=learned (the shipped predictor, adapted online, and the RL arbiter).
``oracle``   switched to the measured-best cut of each load exactly when the load changes.

Printed: samples/s over the whole run and per phase; switches per run; the learned run's decision
time; and the predictor's accuracy on this job: at every decision the learned run records the
predictions for every cut (the online-adapted network and the offline one on the same window),
compared with the sweep's measured iteration time of each cut under the same load (rank correlation
over the cuts) and with the measured time of the running cut (relative error).
Results: docs/adaptive.md.

    flock /tmp/bench.lock python benchmarks/bench_adaptive_learned.py --save docs/adaptive_learned_results.json --out docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from lightning_pipe.adaptive.offline import spearman
from lightning_pipe.bench import provenance
from lightning_pipe.bench.harness import Bench
from lightning_pipe.bench.shared_cluster import rolling_samples_per_s, run, samples_per_s

CUTS = list(range(1, 10))


def phases(args) -> list[tuple[str, int, int, int]]:
    """(name, first, end, jobs running) of the run."""
    return [
        ("quiet", 0, args.t1, 0),
        ("job 1", args.t1, args.t2, 1),
        ("jobs 1+2", args.t2, args.t3, 2),
        ("quiet again", args.t3, args.steps, 0),
    ]


def jobs(args) -> list:
    return [(args.t1, args.t3, 1), (args.t2, args.t3, 0)]


def sweep(args) -> dict:
    """Every cut under 0, 1 and 2 jobs; medians of each dwell after 3 settling iterations."""
    start, d = 10, args.dwell
    plan, at = {}, start
    for _ in range(3):
        for x in CUTS:
            plan[at] = [[0, x], [x, 10]]
            at += d
    one, two, end = start + len(CUTS) * d, start + 2 * len(CUTS) * d, start + 3 * len(CUTS) * d
    sweep_args = argparse.Namespace(**{**vars(args), "steps": end})
    report = run("sweep", sweep_args, plan, False, [5, 5], jobs=[(one, end + 1, 1), (two, end + 1, 0)])
    times = report["times"]
    medians = {}
    for load, first in ((0, start), (1, one), (2, two)):
        medians[load] = {x: statistics.median(times[first + k * d + 3 : first + (k + 1) * d]) for k, x in enumerate(CUTS)}
    return {"report": report, "medians": medians}


def decision_time(model: str, depth: int, microbatches: int, repeats: int = 20) -> dict:
    """Seconds of one learned decision (adapt + score every neighbour candidate + arbiter) for a paper-size
    model from its analytic profile (planning/flops.py), with a synthetic monitor window: no job needed."""
    import time

    from lightning_pipe.adaptive.learned import LearnedDecider, load_learned
    from lightning_pipe.adaptive.monitor import IterationMetrics, StaticMetrics
    from lightning_pipe.adaptive.offline import balanced
    from lightning_pipe.planning.flops import transformer_costs

    costs, _ = transformer_costs(model, 1)
    static = StaticMetrics(costs.activation_bytes, (0.0, *costs.activation_bytes[:-1]), costs.param_bytes, costs.forward, costs.backward)
    bounds = balanced([f + b for f, b in zip(costs.forward, costs.backward)], depth)
    per_rank = [microbatches * sum(costs.forward[b] + costs.backward[b] for b in range(lo, hi)) for lo, hi in bounds]
    window = [
        IterationMetrics(
            i, microbatches, bounds, tuple(range(depth)),
            tuple(0.33 * t * (2.0 if r == 1 else 1.0) for r, t in enumerate(per_rank)),
            tuple(0.67 * t * (2.0 if r == 1 else 1.0) for r, t in enumerate(per_rank)),
            (max(per_rank) * 2.5,) * depth,
            {(r, r + 1): 1e10 for r in range(depth - 1)},
            {(r, r + 1): 1e10 for r in range(depth - 1)},
        )
        for i in range(5)
    ]  # fmt: skip
    decider = LearnedDecider(load_learned(None, depth), static, "1f1b", microbatches)
    for w in window:
        decider.scorer.observe(window[: window.index(w) + 1], max(w.wall_s))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        verdict = decider.decide(window, 1000, 100, 1e10)
        seconds.append(time.perf_counter() - started)
    return {
        "model": model,
        "blocks": len(costs.forward),
        "depth": depth,
        "candidates": len(verdict.scores) - 1,
        "median_ms": statistics.median(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
    }


def main() -> None:
    bench = Bench(__doc__, dict(steps=48, t1=12, t2=24, t3=36, dwell=2))
    p = bench.parser
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--t1", type=int, default=100)
    p.add_argument("--t2", type=int, default=200)
    p.add_argument("--t3", type=int, default=300)
    p.add_argument("--dwell", type=int, default=10)
    p.add_argument("--work", default="/tmp/bench_adaptive_learned")
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--decision-time", action="store_true", help="only time a learned decision for paper-size models (the shipped depths)")
    args = bench.parse()
    os.environ["LIGHTNING_PIPE_ADAPTIVE_EVALUATE"] = "1"  # the learned run records its predictions (inherited by the workers)
    if args.decision_time:
        for model, depth in (("gpt2-1.3b", 4), ("bert-large", 4), ("gpt2-1.3b", 2)):
            print(decision_time(model, depth, 4 * depth))
        return
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.load:
        results = json.loads(Path(args.load).read_text())
    else:
        results = {"provenance": provenance()}
        sw = sweep(args)
        results["sweep_medians_ms"] = {str(k): {str(x): v * 1e3 for x, v in m.items()} for k, m in sw["medians"].items()}
        best = {load: min(m, key=m.get) for load, m in sw["medians"].items()}
        results["oracle_cuts"] = {str(k): v for k, v in best.items()}
        results["static"] = run("static", args, {}, False, "autopipe", jobs=jobs(args))
        planned = results["static"]["bounds"][0]
        first = [planned[0][1], 10 - planned[0][1]]
        results["rule"] = run("rule", args, {}, "rule", first, jobs=jobs(args))
        results["learned"] = run("learned", args, {}, "learned", first, jobs=jobs(args))
        plan = {start: [[0, best[load]], [best[load], 10]] for _, start, _, load in phases(args)}
        results["oracle"] = run("oracle", args, plan, False, first, jobs=jobs(args))
        if args.save:
            Path(args.save).write_text(json.dumps(results, indent=1))
    with bench.recording():
        report(results, args)
    if args.out:
        figure(results, args, Path(args.out))
    bench.keep("results", results)
    bench.finish()


def load_at(args, iteration: int) -> int:
    return next(load for _, lo, hi, load in phases(args) if lo <= iteration < hi)


def report(results: dict, args) -> None:
    print(results["provenance"])
    print(f"sweep medians ms by jobs running -> cut: {results['sweep_medians_ms']}")
    print(f"oracle cuts by jobs running: {results['oracle_cuts']}")
    names = ("static", "rule", "learned", "oracle")
    head = f"{'run':<9}{'all samples/s':>15}" + "".join(f"{name:>14}" for name, *_ in phases(args)) + f"{'switches':>10}"
    print(head)
    total = {}
    for n in names:
        times = results[n]["times"]
        total[n] = samples_per_s(times, 10, args.steps)
        cells = "".join(f"{samples_per_s(times, max(lo, 10), hi):>14.1f}" for _, lo, hi, _ in phases(args))
        print(f"{n:<9}{total[n]:>15.1f}{cells}{len(results[n]['switches']):>10}")
    for n in ("rule", "learned"):
        print(f"{n} switches: {[(s['iteration'], s['new'][0][1]) for s in results[n]['switches']]}")
    print(
        f"learned vs rule over the run: {total['learned'] / total['rule'] - 1:+.1%} samples/s, "
        f"{len(results['learned']['switches'])} vs {len(results['rule']['switches'])} switches; "
        f"oracle's gain over static recovered: rule {(total['rule'] - total['static']) / (total['oracle'] - total['static']):.0%}, "
        f"learned {(total['learned'] - total['static']) / (total['oracle'] - total['static']):.0%}"
    )
    learned = results["learned"]
    evaluations = learned.get("evaluations", [])
    if evaluations:
        decisions = [e["decision_s"] * 1e3 for e in evaluations]
        step = statistics.median(learned["times"][10 : args.t1])
        print(
            f"learned decision time: median {statistics.median(decisions):.2f} ms, max {max(decisions):.2f} ms per decision "
            f"({len(decisions)} decisions, one per window); monitor {learned['monitor_s'] * 1e3:.3f} ms per iteration; "
            f"all of it {(learned['monitor_s'] + learned['decision_total_s'] / len(learned['times'])) / step:.2%} of a {step * 1e3:.0f} ms step; "
            f"online gradient steps {learned.get('adapted_steps')}"
        )
        adapting = sum(e["adapt_s"] for e in evaluations)
        print(f"online adaptation: {adapting * 1e3:.1f} ms in all = {adapting / sum(learned['times']):.2%} of the run's time")
        medians = {int(k): {int(x): v for x, v in m.items()} for k, m in results["sweep_medians_ms"].items()}
        rows = {"offline": [], "adapted": []}
        errors = {"offline": [], "adapted": []}
        for e in evaluations:
            load = load_at(args, e["iteration"])
            cuts = [scores[0][0][1] for scores in e["scores"]]
            measured = [medians[load][c] for c in cuts]
            rows["adapted"].append(spearman([s[1] for s in e["scores"]], measured))
            rows["offline"].append(spearman([s[2] for s in e["scores"]], measured))
            errors["adapted"].append(abs(e["scores"][0][1] / e["measured_s"] - 1))
            errors["offline"].append(abs(e["scores"][0][2] / e["measured_s"] - 1))
        for k in ("offline", "adapted"):
            print(
                f"predictor {k:<8}: rank correlation over the 9 cuts vs the sweep's measured times, median {statistics.median(rows[k]):.2f} "
                f"(min {min(rows[k]):.2f}); relative error on the running cut's measured iteration, median {statistics.median(errors[k]):.1%}"
            )
        results["_evaluation"] = {"spearman": rows, "relative_error": errors}


def figure(results: dict, args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for n in ("static", "rule", "learned", "oracle"):
        times = results[n]["times"]
        smooth = rolling_samples_per_s(times)
        top.plot(range(len(times)), smooth, label=n, linewidth=1.2)
        width = {"static": 5, "rule": 3.5, "learned": 2, "oracle": 1}[n]
        bottom.plot(range(len(times)), [b[0][1] for b in results[n]["bounds"]], label=n, drawstyle="steps-post", linewidth=width)
    for ax in (top, bottom):
        ax.axvspan(args.t1, args.t2, color="0.92")
        ax.axvspan(args.t2, args.t3, color="0.82")
    top.set_ylabel("samples/s (5-iteration mean)")
    bottom.set_ylabel("blocks on rank 0 (of 10)")
    bottom.set_xlabel("iteration (light: a job on rank 1's core; dark: and one on rank 0's)")
    top.legend(loc="lower left", fontsize=8, ncol=4)
    top.set_title("Changing load: static vs rule vs learned vs oracle (2 CPU processes)")
    fig.tight_layout()
    fig.savefig(out / "adaptive_learned_throughput.png", dpi=110)
    print(f"wrote {out / 'adaptive_learned_throughput.png'}")
    predictions_figure(results, args, out)


def predictions_figure(results: dict, args, out: Path) -> None:
    """Per load: the sweep's measured iteration time of every cut, and the predictor's (offline and
    adapted) at the learned run's last decision under that load."""
    import matplotlib.pyplot as plt

    evaluations = results["learned"].get("evaluations", [])
    medians = {int(k): {int(x): v for x, v in m.items()} for k, m in results["sweep_medians_ms"].items()}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=False)
    for ax, load in zip(axes, (0, 1, 2)):
        last = [e for e in evaluations if load_at(args, e["iteration"]) == load and e["iteration"] >= 10]
        ax.plot(CUTS, [medians[load][c] for c in CUTS], "k-o", label="measured (sweep)")
        if last:
            e = last[-1]
            scores = sorted(e["scores"], key=lambda x: x[0][0][1])
            ax.plot([x[0][0][1] for x in scores], [x[2] * 1e3 for x in scores], "--", label="predicted, offline")
            ax.plot([x[0][0][1] for x in scores], [x[1] * 1e3 for x in scores], "-", label="predicted, adapted")
            ax.set_title(f"{load} job(s): decision at iteration {e['iteration']}", fontsize=9)
        ax.set_xlabel("cut after block (rank 0 holds blocks 0..cut-1)")
    axes[0].set_ylabel("iteration ms")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "adaptive_learned_predictions.png", dpi=110)
    print(f"wrote {out / 'adaptive_learned_predictions.png'}")


if __name__ == "__main__":
    main()
