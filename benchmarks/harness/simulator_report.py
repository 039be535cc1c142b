"""bench_simulator.py's reporting part: analysis, tables and pictures of saved measurements.

The measuring part (benchmarks/bench_simulator.py) runs the real processes and saves what every
rank measured (``--raw FILE``: per world the ranks' results, with the run's arguments and
provenance); this module turns such results into the tables and pictures, in the same run or
later from the file:

    python -m benchmarks.bench_simulator --from-raw run.pt               # the measuring run's options
    python -m benchmarks.harness.simulator_report run.pt --pictures ''   # the same, options from the file

Per partition: the measured iteration (median over the timed steps of first rank in to last rank
out), the simulated one from the profile taken in the same job, the error, the Spearman rank
correlation, and the variants (per-block profile, no cores model, ...) that show what each
ingredient of the simulation is worth; where the time went (CPU per step, critical paths); the
pictures (simulated vs measured per partition, measured and predicted timelines of autopipe).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.adaptive.stats import spearman

from .gpt import describe

RAW_FORMAT = "bench_simulator/2"


def sizes_of(bounds: Sequence[tuple[int, int]]) -> list[int]:
    return [b - a for a, b in bounds]


# ---- raw measurements ----------------------------------------------------------------------------
def save_raw(path: str, worlds: dict[int, list[dict]], args: Any, provenance: str) -> None:
    """Every rank's results per world, the measuring run's arguments and provenance (torch.save)."""
    torch.save({"format": RAW_FORMAT, "args": vars(args), "provenance": provenance, "worlds": worlds}, path)


def load_raw(path: str) -> tuple[dict[int, list[dict]], dict | None, str | None]:
    """(results per world, the measuring run's arguments, its provenance); files written before the
    arguments were saved hold the results alone (arguments and provenance None)."""
    saved = torch.load(path, weights_only=False)
    if isinstance(saved, dict) and saved.get("format") == RAW_FORMAT:
        return saved["worlds"], saved["args"], saved["provenance"]
    return saved, None, None


# ---- analysis ----------------------------------------------------------------------------------
def iteration_times(results: list[dict], index: int) -> list[float]:
    """Per timed step: last rank's end - first rank's start (one machine-wide monotonic clock)."""
    out = []
    for rnd in range(len(results[0]["runs"][index])):
        for s in range(len(results[0]["runs"][index][rnd])):
            spans = [r["runs"][index][rnd][s] for r in results]
            out.append(max(e for _, e in spans) - min(t for t, _ in spans))
    return out


# variant -> (profile, with the cores model?, legend): the headline first, then what each ingredient is worth
VARIANTS = {
    "simulated": ("main", True, "chain profile (min(cores, ranks) at once) + cores model"),
    "hot": ("hot", True, "per-block profile (hot caches) + cores model"),
    "no-cores": ("main", False, "chain profile, no cores model"),
    "all": ("all", False, "chain profile with all ranks at once, no cores model"),
    "lone": ("lone", True, "chain profile on rank 0 alone + cores model"),
}


def traced_busy(results: list[dict], index: int, schedule) -> list[float]:
    """Per rank, the median over the timed steps of its traced compute time (waits excluded)."""
    busy = []
    for r in results:
        per_step = [sum(e - s for i, s, e in recs if schedule.actions[r["rank"]][i].op.is_compute) for _, recs in r["traces"][index]]
        busy.append(statistics.median(per_step))
    return busy


def cpu_use(results: list[dict], index: int) -> tuple[float, float]:
    """(CPU seconds of all ranks per timed step, CPUs the whole machine kept busy meanwhile)."""
    rounds = results[0]["cpu"][index]
    steps = sum(n for *_, n in rounds)
    own = sum(c for r in results for c, *_ in r["cpu"][index]) / steps
    machine = sum(m for _, m, _, _ in rounds) / sum(w for _, _, w, _ in rounds)
    return own, machine


def measured_path(results: list[dict], index: int, schedule) -> tuple[float, float, float]:
    """The traced step's critical path, walked back from the compute that ends last through what
    each compute waited for (its input, if that was sent after the rank's previous compute ended,
    else the previous compute), split into (compute, waiting for a message, gaps between a rank's
    computes); medians over the timed steps."""
    from lightning_pipe.schedules import Op

    world = len(results)
    parts = []
    for s in range(len(results[0]["traces"][index])):
        sent, comps = {}, {}
        start = min(r["traces"][index][s][0][0] for r in results)
        for rank, r in enumerate(results):
            for i, t0, t1 in r["traces"][index][s][1]:
                a = schedule.actions[rank][i]
                if a.op.is_send:
                    sent[(a.op, a.chunk, a.microbatch)] = t0
                elif a.op.is_compute:
                    comps[(rank, a.op, a.chunk, a.microbatch)] = (t0, t1)
        before = {}
        for rank in range(world):
            mine = sorted((v, k) for k, v in comps.items() if k[0] == rank)
            before.update({k: (mine[j - 1][1] if j else None) for j, (_, k) in enumerate(mine)})
        key = max(comps, key=lambda k: comps[k][1])
        compute = message = gap = 0.0
        while True:
            t0, t1 = comps[key]
            compute += t1 - t0
            rank, op, c, mb = key
            need = None
            if op is Op.FORWARD and c > 0:
                need = (Op.SEND_ACT, c - 1, mb), (schedule.chunk_rank[c - 1], op, c - 1, mb)
            elif op is Op.BACKWARD and c < schedule.num_chunks - 1:
                need = (Op.SEND_GRAD, c + 1, mb), (schedule.chunk_rank[c + 1], op, c + 1, mb)
            prev = before[key]
            prev_end = comps[prev][1] if prev is not None else start
            if need is not None and need[1] in comps and sent.get(need[0], -math.inf) >= prev_end:
                message += t0 - comps[need[1]][1]
                key = need[1]
            else:
                gap += t0 - prev_end
                if prev is None:
                    break
                key = prev
        parts.append((compute, message, gap))
    return tuple(statistics.median(p[j] for p in parts) for j in range(3))


def analyse(results: list[dict], world: int, args: Any) -> dict:
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulation import simulate

    r0 = results[0]
    link, partitions, profiles = r0["link"], r0["partitions"], r0["profiles"]
    variants = {k: v for k, v in VARIANTS.items() if v[0] in profiles and (world > min(args.cores, world) or k not in ("no-cores", "all"))}
    costs = {
        k: profiles[p].costs(link["bandwidth"], link["latency"], cores=args.cores if shared else None)
        for k, (p, shared, _) in variants.items()
    }
    schedule = build_schedule("1f1b", world, args.microbatches)
    rows = []
    for i, (label, bounds) in enumerate(partitions):
        times = iteration_times(results, i)
        measured = statistics.median(times)
        sims = {k: simulate(schedule, c, bounds, critical_path=(k == "simulated")) for k, c in costs.items()}
        q1, _, q3 = statistics.quantiles(times, n=4) if len(times) >= 4 else (measured, measured, measured)
        main = sims["simulated"]
        busy = traced_busy(results, i, schedule)
        heavy = max(range(world), key=lambda r: busy[r])
        cpu, machine = cpu_use(results, i)
        path = measured_path(results, i, schedule)
        sim_path = sum(e.end - e.start for e in main.critical_path)
        rows.append(
            {
                "label": label,
                "bounds": bounds,
                "sizes": sizes_of(bounds),
                "measured": measured,
                "iqr": (q1, q3),
                "sim": {k: t.iteration_time for k, t in sims.items()},
                "error": {k: t.iteration_time / measured - 1 for k, t in sims.items()},
                "master": main.master_stage,
                "bubble": main.bubble_ratio,
                "heavy": heavy,
                "traced_busy": busy[heavy],
                "sim_busy": main.busy[heavy],
                "cpu": cpu,
                "machine": machine,
                "path": path,
                "sim_path": (sim_path, main.iteration_time - sim_path),
                "load": max(r0["loads"][i]),
                "steps": len(times),
            }
        )
    measured = [r["measured"] for r in rows]
    rho = {k: spearman(measured, [r["sim"][k] for r in rows]) for k in variants}
    return {
        "world": world,
        "rows": rows,
        "rho": rho,
        "variants": variants,
        "link": link,
        "costs": costs["simulated"],
        "schedule": schedule,
        "profiles": profiles,
        "profile_loads": r0["profile_loads"],
        "results": results,
    }


def report(a: dict, args: Any) -> str:
    world, rows, profiles = a["world"], a["rows"], a["profiles"]
    cores = min(args.cores, world)
    total = lambda key: 1e3 * sum(profiles[key].forward + profiles[key].backward)  # noqa: E731
    lines = [
        f"{world} processes x 1 thread on {args.cores} cores, {world} stages, 1F1B, m = {args.microbatches}; link: latency "
        f"{a['link']['latency'] * 1e6:.0f} us, bandwidth {a['link']['bandwidth'] / 1e9:.2f} GB/s (ping-pong rank 0 <-> 1)",
        "profiles (f+b of all blocks per micro-batch, the loss included; foreign load): "
        + ", ".join(f"{k} {total(k):.1f} ms ({a['profile_loads'][k]:.2f})" for k in profiles),
        f"  main = chain (inflight {args.inflight}) on {cores} ranks at once; hot = per-block on {cores} ranks at once; "
        f"lone = chain on rank 0 alone" + (f"; all = chain on all {world} ranks at once" if "all" in profiles else ""),
        f"simulated with cores = {args.cores}"
        + (" (more ranks than cores: processor sharing)" if world > args.cores else " (a core per rank: no sharing)"),
        "",
        "| partition | blocks per stage | measured ms | simulated ms | error | master stage | busiest rank: traced / simulated compute ms | foreign load |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['sizes']} | {r['measured'] * 1e3:.1f} | {r['sim']['simulated'] * 1e3:.1f} | "
            f"{r['error']['simulated']:+.1%} | {r['master']} | {r['heavy']}: {r['traced_busy'] * 1e3:.1f} / {r['sim_busy'] * 1e3:.1f} | "
            f"{r['load']:.2f} |"
        )
    work = args.microbatches * sum(profiles["main"].forward + profiles["main"].backward)
    lines += [
        "",
        f"Where the time goes (per step, ms; profiled CPU work m x sum(f+b) = {work * 1e3:.1f} ms): CPU time of all ranks and "
        "how many CPUs the machine kept busy over the timed steps; the critical path of the traced steps (computes, waits for a "
        "message, gaps between a rank's computes) next to the simulated one (computes, waits)",
        "",
        "| partition | ranks' CPU per step | machine busy (CPUs) | measured path: compute + message + gaps | simulated path: compute + waits |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        c, msg, gap = (v * 1e3 for v in r["path"])
        sc, sw = (v * 1e3 for v in r["sim_path"])
        lines.append(
            f"| {r['label']} | {r['cpu'] * 1e3:.1f} | {r['machine']:.2f} | {c:.1f} + {msg:.1f} + {gap:.1f} | {sc:.1f} + {sw:.1f} |"
        )
    names = list(a["variants"])
    lines += [
        "",
        "Every variant (error per partition, Spearman, largest |error|):",
        "",
        "| partition | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for r in rows:
        lines.append(f"| {r['label']} | " + " | ".join(f"{r['error'][k]:+.1%}" for k in names) + " |")
    lines.append("| Spearman | " + " | ".join(f"{a['rho'][k]:.3f}" for k in names) + " |")
    lines.append("| max abs error | " + " | ".join(f"{max(abs(r['error'][k]) for r in rows):.1%}" for k in names) + " |")
    lines += ["", "variants: " + "; ".join(f"{k} = {a['variants'][k][2]}" for k in names)]
    floor = args.microbatches * sum(profiles["main"].forward + profiles["main"].backward) / cores
    worst = max(abs(r["error"]["simulated"]) for r in rows)
    within = sum(abs(r["error"]["simulated"]) <= 0.10 for r in rows)
    lines += [
        f"CPU floor: m x (f+b of all blocks, main profile) / min(cores, ranks) = {floor * 1e3:.1f} ms per step",
        "",
        f"Spearman rank correlation (measured vs simulated): {a['rho']['simulated']:.3f}; largest |error| {worst:.1%}; "
        f"{within} of {len(rows)} within 10%",
        f"targets: every partition within 10% -> {'met' if worst <= 0.10 else 'missed'}; rank correlation 1.0 -> "
        f"{'met' if a['rho']['simulated'] > 0.9999 else 'missed'}",
    ]
    return "\n".join(lines)


# ---- pictures ----------------------------------------------------------------------------------
def plot_comparison(analyses: list[dict], path: Path, args: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "simulated": ("s--", "#DD8452"),
        "hot": ("v:", "#55A868"),
        "no-cores": ("D:", "#C44E52"),
        "all": ("x:", "#8172B3"),
        "lone": ("^:", "#8C8C8C"),
    }
    fig, axes = plt.subplots(1, len(analyses), figsize=(6.8 * len(analyses), 4.6), squeeze=False)
    for ax, a in zip(axes[0], analyses):
        rows = a["rows"]
        xs = range(len(rows))
        ax.plot(xs, [r["measured"] * 1e3 for r in rows], "o-", label="measured (median step)", color="#4C72B0", lw=2)
        ax.fill_between(
            xs,
            [r["iqr"][0] * 1e3 for r in rows],
            [r["iqr"][1] * 1e3 for r in rows],
            color="#4C72B0",
            alpha=0.2,
            label="measured, quartiles",
        )
        for k in a["variants"]:
            marker, color = styles[k]
            ax.plot(
                xs,
                [r["sim"][k] * 1e3 for r in rows],
                marker,
                color=color,
                lw=2 if k == "simulated" else 1,
                alpha=1.0 if k == "simulated" else 0.7,
                label=f"{k}: {a['variants'][k][2]}",
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['label'].replace(' = ', '=')}\n{r['sizes']}" for r in rows], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("iteration time (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"{a['world']} processes on {args.cores} cores: Spearman {a['rho']['simulated']:.2f}, max |error| "
            f"{max(abs(r['error']['simulated']) for r in rows):.1%}",
            fontsize=9,
        )
        ax.legend(fontsize=6, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timelines(a: dict, folder: Path, label: str = "autopipe") -> list[Path]:
    from lightning_pipe.simulation import simulate
    from lightning_pipe.simulation.timelines import gantt, traced_timeline

    index = next((i for i, r in enumerate(a["rows"]) if label in r["label"].split(" = ")), None)
    if index is None:
        return []
    row = a["rows"][index]
    # the traced step whose iteration is the median one, records of all ranks (one monotonic clock)
    steps = len(a["results"][0]["traces"][index])
    per_step = []
    for s in range(steps):
        spans = [r["traces"][index][s][0] for r in a["results"]]
        records = [r["traces"][index][s][1] for r in a["results"]]
        per_step.append((max(e for _, e in spans) - min(t for t, _ in spans), s, records))
    per_step.sort(key=lambda t: t[:2])
    measured = traced_timeline(a["schedule"], per_step[len(per_step) // 2][2])
    predicted = simulate(a["schedule"], a["costs"], row["bounds"])
    m = a["schedule"].num_microbatches
    out_m = gantt(
        measured,
        folder / "measured_timeline.png",
        title=f"measured (traced; gaps = waiting): {label} {row['sizes']}, {a['world']} processes, m={m}: "
        f"{measured.iteration_time * 1e3:.1f} ms",
    )
    out_p = gantt(
        predicted,
        folder / "predicted_timeline.png",
        title=f"simulated: {label} {row['sizes']}, {a['world']} stages on {a['costs'].cores} cores, 1F1B m={m}: "
        f"iteration {predicted.iteration_time * 1e3:.1f} ms, master stage {predicted.master_stage}",
    )
    return [out_m, out_p]


# ---- the whole report ----------------------------------------------------------------------------
def header(args: Any) -> str:
    return f"gloo, 1 thread per process; {describe(args)}"


def show_world(results: list[dict], world: int, args: Any) -> dict:
    """Analyse one world's results and print its tables; returns the analysis (for `draw`)."""
    a = analyse(results, world, args)
    print(report(a, args), flush=True)
    return a


def draw(analyses: list[dict], args: Any) -> list[Path]:
    """The pictures into ``args.pictures`` (none if empty); returns the files written."""
    if not args.pictures or not analyses:
        return []
    folder = Path(args.pictures)
    plot_comparison(analyses, folder / "simulated_vs_measured.png", args)
    written = [folder / "simulated_vs_measured.png"] + plot_timelines(analyses[0], folder)
    print("\npictures: " + ", ".join(str(w) for w in written))
    return written


def show(worlds: dict[int, list[dict]], args: Any) -> list[dict]:
    """Tables of every world in ``args.worlds`` that was measured, then the pictures."""
    analyses = []
    for world in args.worlds:
        print(f"\n== {world} processes ==", flush=True)
        if world not in worlds:
            print(f"  not in the measurements (measured: {sorted(worlds)})")
            continue
        analyses.append(show_world(worlds[world], world, args))
    draw(analyses, args)
    return analyses


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Tables and pictures of measurements saved by bench_simulator.py --raw.")
    p.add_argument("raw", help="the file bench_simulator.py --raw wrote")
    p.add_argument("--pictures", default=None, help="folder for the pictures ('' for none; default: the measuring run's)")
    p.add_argument("--cores", type=int, default=None, help="cores in the simulator's cores model (default: the measuring run's)")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="which of the measured worlds (default: all)")
    opts = p.parse_args(argv)
    worlds, stored, origin = load_raw(opts.raw)
    if stored is None:
        p.error(
            f"{opts.raw} was saved without the measuring run's options: analyse it with "
            "python -m benchmarks.bench_simulator --from-raw FILE and that run's options"
        )
    args = argparse.Namespace(**stored)
    args.worlds = opts.worlds or [w for w in args.worlds if w in worlds]
    for key in ("pictures", "cores"):
        if getattr(opts, key) is not None:
            setattr(args, key, getattr(opts, key))
    print(f"re-analysis of {opts.raw}, measured: {origin}")
    print(header(args), flush=True)
    show(worlds, args)


if __name__ == "__main__":
    main(sys.argv[1:])
