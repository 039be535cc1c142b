"""AvgPipe's profiling-based tuner (§5.2, Eq. 1-8) against a real traversal of its grid (issue 13
item 3; the paper's §7.3): the whole ``python -m lightning_pipe.plan ... pipeline.tune=true`` command,
then every (M, N) of its grid trained with the tuner's own profile-run command line, each command
holding /tmp/bench.lock; predicted vs measured time and memory per setting. Results: docs/results/tuner.md.

    python -m benchmarks.bench_tuner                                   # both models (~25 minutes on 2 cores)
    python -m benchmarks.bench_tuner --models gpt-tiny --repeats 3 --confirm 0 --out docs/results/tuner_results_gpt_repeats.json
    python -m benchmarks.bench_tuner --report docs/results/tuner_results.json  # tables and plots of a saved run
    python -m benchmarks.bench_tuner --quick                           # smoke: gpt-tiny, a 2 x 2 grid, 2 batches
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import REPO
from benchmarks.harness import cli_runs as cli
from benchmarks.harness.bench import Bench, column_table, interleave, pyplot, save_figure
from lightning_pipe.adaptive.stats import spearman

RECORD_ENV = "LIGHTNING_PIPE_TUNE_RECORD"  # lightning_pipe.lightning.tune_record.RECORD_ENV
MODELS: dict[str, list[str]] = {
    "gpt-tiny": ["recipe=gpt-tiny-avgpipe"],  # K = 2; batch 8 per pipeline -> M in 1, 2, 4, 8
    # masked LM (the attention mask travels): K = 2 devices, shared by the pipelines; batch 16 -> M in 1 .. 16
    "bert-tiny": ["recipe=bert-tiny-cpu", "pipeline=avgpipe", "trainer.devices=2"],
}
MiB = 2**20
MN = lambda x: {"microbatches": x["microbatches"], "pipelines": x["pipelines"]}  # a setting's (M, N)


def run_command(bench: Bench, cmd: list[str], folder: Path, label: str, env: Optional[dict] = None) -> dict[str, Any]:
    """`cmd` in a fresh `folder` holding the lock, on a quiet machine; repeated while disturbed."""
    a = bench.args
    quiet = dict(retries=a.retries, max_foreign=a.max_foreign, quiet_wait=a.quiet_wait, patient=bench.patient, log=bench.log)
    run = cli.run_command(cmd, folder, a.timeout, label, lock=a.lock, env=env, **quiet)
    return {k: run[k] for k in ("wall", "foreign", "cpu", "attempts")}


def setting_overrides(m: int, n: int, k: int, steps: int, folder: Path) -> list[str]:
    """The tuner's profile-run command line (lightning_pipe.cli.tune.run_profile) at (M, N)."""
    return (
        f"pipeline.tune=false pipeline.pipelines={n} pipeline.microbatches={m} pipeline.trace=false trainer.devices={k} "
        f"trainer.num_nodes=1 trainer.max_steps={steps} trainer.limit_val_batches=0 logger=none callbacks=none ckpt_path=null "
        f"test_after_fit=false hydra.run.dir={folder}"
    ).split()


def record(path: Path) -> dict[str, Any]:
    """A rank record, its utilisation curve folded into the mean utilisation."""
    rec = json.loads(path.read_text())
    curve = rec.pop("utilisation", [])
    busy = sum(d for d, _ in curve)
    rec["mean_utilisation"] = sum(d * phi for d, phi in curve) / busy if busy > 0 else None
    return rec


def measure(folder: Path, m: int, n: int, k: int, batch: int) -> dict[str, Any]:
    """From the rank records (global rank r = stage r mod K of pipeline r div K): samples/s = sum over
    pipelines of B / period; seconds per batch = B / samples/s (the prediction's T); the schedule
    alone likewise from ``wall``; memory of device k = sum over the N ranks of stage k."""
    ranks = {int(f.stem[4:]): record(f) for f in (folder / "ranks").glob("rank*.json")}
    if len(ranks) != n * k or any(rec["stage"] != r % k for r, rec in ranks.items()):
        raise RuntimeError(f"M={m} N={n}: {len(ranks)} of {n * k} rank records (or a stage out of place) in {folder / 'ranks'}")
    mean = lambda key, p: statistics.fmean(ranks[p * k + s][key] for s in range(k))
    period = [mean("period", p) for p in range(n)]
    samples, schedule = sum(batch / x for x in period), sum(batch / mean("wall", p) for p in range(n))
    per_device = lambda keys: [sum(ranks[p * k + s][key] for p in range(n) for key in keys) for s in range(k)]
    return {"samples_per_s": samples, "seconds_per_batch": batch / samples, "schedule_seconds_per_batch": batch / schedule, "period": period,
            "memory_per_device": per_device(("model_bytes", "data_bytes")), "data_per_device": per_device(("data_bytes",)),
            "ranks": [ranks[r] for r in sorted(ranks)]}  # fmt: skip


def run_model(bench: Bench, name: str) -> dict[str, Any]:
    args = bench.args
    base, work, py = MODELS[name] + args.set, Path(args.workdir).resolve() / name, [sys.executable, "-m"]
    bench.log(f"\n## {name}: {' '.join(base)}")
    folder = work / "tune"
    cmd = py + ["lightning_pipe.plan", *base, "pipeline.tune=true", f"pipeline.tune_batches={args.tune_batches}", f"hydra.run.dir={folder}"]
    tuner = run_command(bench, cmd, folder, f"{name} tuner")
    tuned = json.loads((folder / "tune.json").read_text())
    profile_ranks = [record(f) for f in sorted((folder / "tune_profile" / "ranks").glob("rank*.json"))]
    tuner |= {"command": " ".join(cmd[2:]), "tune": tuned, "profile_ranks": profile_ranks}
    k, batch = len(tuned["profile"]["stages"]), tuned["profile"]["batch_size"]
    chosen = (tuned["chosen"]["microbatches"], tuned["chosen"]["pipelines"])
    bench.log(
        f"tuner: {tuner['wall']:.1f} s (foreign load {tuner['foreign']:.2f}); K = {k}, B = {batch}; chose M={chosen[0]} N={chosen[1]}"
    )
    # the partition is fixed to the profile run's, as in the paper (partition once, then tune M and N)
    plan = next((p for p in (folder / "plan.json", folder / "tune_profile" / "plan.json") if p.exists()), None)
    tuner["bounds"] = json.loads(plan.read_text()).get("bounds") if plan else None
    fixed = [f"pipeline.partition=[{','.join(str(b - a) for a, b in tuner['bounds'])}]"] if tuner["bounds"] else []

    def train(c: dict, tag: str) -> tuple[dict, dict]:
        m, n = c["microbatches"], c["pipelines"]
        folder = work / f"{tag}M{m}_N{n}"
        cmd = py + ["lightning_pipe.train", *base, *fixed, *setting_overrides(m, n, k, args.batches + 1, folder)]
        run = run_command(bench, cmd, folder, f"{name} {tag}M={m} N={n}", env={RECORD_ENV: str(folder / "ranks")})
        got = measure(folder, m, n, k, batch)
        bench.log(
            f"  M={m:>2} N={n}: {run['wall']:5.1f} s, {got['samples_per_s']:6.1f} samples/s, predicted {c['predicted_samples_per_s']:6.1f}"
        )
        return run, got

    grid = sorted(tuned["candidates"], key=lambda c: (c["pipelines"], c["microbatches"]))
    passes = interleave(grid, args.rounds, lambda c, rnd: train(c, f"pass{rnd + 1}_" if rnd else ""))
    settings = []  # one record per (M, N): the median over the passes; memory, records and wall from the first
    for c, results in zip(grid, passes):
        medians = {
            key: statistics.median(g[key] for _, g in results)
            for key in ("samples_per_s", "seconds_per_batch", "schedule_seconds_per_batch")
        }
        measured = {**results[0][1], **medians, "samples_per_s_passes": [g["samples_per_s"] for _, g in results]}
        settings.append({**MN(c), "predicted": c, "measured": measured, "run": results[0][0]})
    best = max(settings, key=lambda s: s["measured"]["samples_per_s"])
    pick = next(s for s in settings if (s["microbatches"], s["pipelines"]) == chosen)
    confirm = []  # the pick and the best once more (not counted in the traversal): the ratio's noise
    for rep in range(args.confirm):
        for s in {id(x): x for x in (pick, best)}.values():
            run, got = train(s["predicted"], f"confirm{rep}_")
            confirm.append({**MN(s), "samples_per_s": got["samples_per_s"], "run": run})
    return {"model": name, "overrides": base, "batches": args.batches, "tune_batches": args.tune_batches, "partition": fixed, "stages": k,
            "batch_size": batch, "tuner": tuner, "settings": settings, "confirm": confirm}  # fmt: skip


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    settings, tuner = res["settings"], res["tuner"]
    key = lambda s: (s["microbatches"], s["pipelines"])
    chosen = (tuner["tune"]["chosen"]["microbatches"], tuner["tune"]["chosen"]["pipelines"])
    best = max(settings, key=lambda s: s["measured"]["samples_per_s"])
    pick = next(s for s in settings if key(s) == chosen)
    predicted = [s["predicted"]["predicted_seconds_per_batch"] for s in settings]
    measured = [s["measured"]["seconds_per_batch"] for s in settings]
    pairs = lambda which: [(p, q) for s in settings for p, q in zip(s["predicted"]["memory_per_device"], s["measured"][which])]
    mem_err = [(p - q) / q for p, q in pairs("memory_per_device") if q > 0]
    prof = tuner["tune"]["profile"]  # Eq. 8's data part alone: (m / m*) (n* / n) F_dat of the profile
    data_err = [((prof["microbatches"] / s["microbatches"]) * (s["pipelines"] / prof["pipelines"]) * st["data_bytes"] - q) / q
                for s in settings for st, q in zip(prof["stages"], s["measured"]["data_per_device"]) if q > 0]  # fmt: skip
    traversal = sum(s["run"]["wall"] for s in settings)
    profile_period = statistics.fmean(r["period"] for r in tuner["profile_ranks"]) if tuner.get("profile_ranks") else None
    rate = lambda s: s["measured"]["samples_per_s"] / best["measured"]["samples_per_s"]
    ms, ns = sorted({s["microbatches"] for s in settings}), sorted({s["pipelines"] for s in settings})
    # traversal_steps_seconds / tuner_steps_seconds: the training steps alone (no process start), steps x measured period
    out = {"chosen": list(chosen), "best": list(key(best)), "pick_over_best": rate(pick), "tuner_wall": tuner["wall"], "traversal_wall": traversal,
           "wall_ratio": tuner["wall"] / traversal,
           "traversal_steps_seconds": sum((res["batches"] + 1) * statistics.fmean(s["measured"]["period"]) for s in settings),
           "tuner_steps_seconds": (res["tune_batches"] + 1) * profile_period if profile_period else None,
           "spearman_time": spearman(predicted, measured),
           "spearman_schedule_time": spearman(predicted, [s["measured"]["schedule_seconds_per_batch"] for s in settings]),
           "time_error_median": statistics.median(abs(p - q) / q for p, q in zip(predicted, measured)),
           "memory_error_signed": [min(mem_err), max(mem_err)], "max_foreign": max([tuner["foreign"]] + [s["run"]["foreign"] for s in settings])}  # fmt: skip
    for name, errs in (("memory", mem_err), ("memory_data", data_err)):
        out |= {f"{name}_error_mean_abs": statistics.fmean(abs(e) for e in errs), f"{name}_error_max_abs": max(abs(e) for e in errs)}  # fmt: skip
    # the paper's guidelines (§7.3): max-num = M at its largest, then N at its largest; max-size = M = 1, N = 2
    for label, want in (("max_num", (ms[-1], ns[-1])), ("max_size", (ms[0], 2 if 2 in ns else ns[-1]))):
        out[label] = {"setting": list(want), "over_best": rate(next(s for s in settings if key(s) == want))}
    if res.get("confirm"):
        per: dict = {}
        for c in res["confirm"]:
            per.setdefault((c["microbatches"], c["pipelines"]), []).append(c["samples_per_s"])
        both = [statistics.median(per.get(key(s), []) + [s["measured"]["samples_per_s"]]) for s in (pick, best)]
        out["confirm_pick_over_best"] = both[0] / both[1]
        out["confirm_samples_per_s"] = {f"M={m} N={n}": v for (m, n), v in per.items()}
    return out


def report(bench: Bench, res: dict[str, Any]) -> None:
    s, k = summarize(res), res["stages"]
    ms = lambda seconds: f"{seconds * 1e3:.1f}"
    tags = lambda mn: ("**pick**" if mn == s["chosen"] else "") + (" **best**" if mn == s["best"] else "")
    passes = lambda q: (
        f" ({' / '.join(f'{v:.1f}' for v in q['samples_per_s_passes'])})" if len(q.get("samples_per_s_passes", [])) > 1 else ""
    )
    memory = lambda x, d: f"{x['predicted']['memory_per_device'][d] / MiB:.1f} / {x['measured']['memory_per_device'][d] / MiB:.1f}"
    columns = [
        ("M", lambda x: x["microbatches"]),
        ("N", lambda x: f"{x['pipelines']} {tags([x['microbatches'], x['pipelines']])}"),
        ("predicted ms/batch", lambda x: ms(x["predicted"]["predicted_seconds_per_batch"])),
        ("measured ms/batch", lambda x: ms(x["measured"]["seconds_per_batch"])),
        ("schedule only", lambda x: ms(x["measured"]["schedule_seconds_per_batch"])),
        ("predicted samples/s", lambda x: f"{x['predicted']['predicted_samples_per_s']:.1f}"),
        ("measured samples/s", lambda x: f"{x['measured']['samples_per_s']:.1f}{passes(x['measured'])}"),
        *((f"device {d} memory MiB pred / meas", lambda x, d=d: memory(x, d)) for d in range(k)),
        ("mean phi", lambda x: f"{statistics.fmean(r['mean_utilisation'] or 0.0 for r in x['measured']['ranks']):.2f}"),
        ("run s", lambda x: f"{x['run']['wall']:.1f}"),
        ("foreign load", lambda x: f"{x['run']['foreign']:.2f}"),
    ]
    bench.say(f"### {res['model']} ({' '.join(res['overrides'])}; K = {k} stages, B = {res['batch_size']} per pipeline)\n")
    bench.table(
        column_table(columns, sorted(res["settings"], key=lambda x: (x["microbatches"], x["pipelines"])), "r" * (10 + k)),
        f"tuner: `{res['tuner']['command']}`: {s['tuner_wall']:.1f} s (of which the profile run {res['tuner']['tune']['seconds']['profile_run']:.1f} s); "
        f"traversal of {len(res['settings'])} settings: {s['traversal_wall']:.1f} s",
    )
    ok = lambda good: "met" if good else "NOT met"
    pct = lambda key: f"{100 * s[key]:.1f}%"
    mn = lambda g: f"M={s[g]['setting'][0]} N={s[g]['setting'][1]} {s[g]['over_best']:.2f}"
    bench.say(
        f"- tuner's pick M={s['chosen'][0]} N={s['chosen'][1]}, traversal's best M={s['best'][0]} N={s['best'][1]}: pick's measured "
        f"throughput / best = **{s['pick_over_best']:.3f}** (target >= 0.90: {ok(s['pick_over_best'] >= 0.9)})"
        + (f"; median over the re-runs (--confirm): {s['confirm_pick_over_best']:.3f}" if "confirm_pick_over_best" in s else "")
        + f"\n- tuner wall / traversal wall = {s['tuner_wall']:.1f} / {s['traversal_wall']:.1f} s = **{s['wall_ratio']:.3f}** "
        f"(target <= 0.10: {ok(s['wall_ratio'] <= 0.1)}); the training steps alone (steps x measured period, no process start): "
        f"traversal {s['traversal_steps_seconds']:.1f} s" + (f", tuner's profile {s['tuner_steps_seconds']:.1f} s" if s["tuner_steps_seconds"] else "")
        + f"\n- Spearman rank correlation, predicted vs measured seconds per batch over the {len(res['settings'])} settings: "
        f"**{s['spearman_time']:.2f}** (vs the schedule's time alone, without optimizer and update: {s['spearman_schedule_time']:.2f}); "
        f"median |error| of the predicted time {100 * s['time_error_median']:.0f}%"
        f"\n- memory per device, predicted vs measured: mean |error| {pct('memory_error_mean_abs')}, max {pct('memory_error_max_abs')} "
        f"(range {100 * s['memory_error_signed'][0]:+.1f}% .. {100 * s['memory_error_signed'][1]:+.1f}%); the data part alone "
        f"(activations, inputs): mean |error| {pct('memory_data_error_mean_abs')}, max {pct('memory_data_error_max_abs')}"
        f"\n- the paper's guidelines, measured / best: max-num {mn('max_num')}, max-size {mn('max_size')}"
        f"\n- largest foreign load during a kept run: {s['max_foreign']:.2f} CPUs\n"
    )  # fmt: skip


def plot(res: dict[str, Any], path: Path) -> None:
    s = summarize(res)
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 4.5))
    for x in res["settings"]:
        m, n = x["microbatches"], x["pipelines"]
        p, q = x["predicted"]["predicted_samples_per_s"], x["measured"]["samples_per_s"]
        mark = "*" if [m, n] == s["chosen"] else ("s" if [m, n] == s["best"] else "o")
        a.scatter(q, p, marker=mark, s=120 if mark != "o" else 40, c=f"C{[1, 2, 4].index(n) if n in (1, 2, 4) else 3}")
        a.annotate(f"{m},{n}", (q, p), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for d, (pm, qm) in enumerate(zip(x["predicted"]["memory_per_device"], x["measured"]["memory_per_device"])):
            b.scatter(qm / MiB, pm / MiB, marker="o^"[d % 2], c=f"C{d}", s=30)
    for ax in (a, b):
        lim = max(ax.get_xlim()[1], ax.get_ylim()[1]) * 1.05
        ax.plot([0, lim], [0, lim], "k:", lw=0.8)
    a.set(xlim=(0, lim), ylim=(0, lim), xlabel="measured samples/s", ylabel="predicted samples/s (Eq. 1-7)")
    for i, n in enumerate((1, 2, 4)):
        a.scatter([], [], c=f"C{i}", s=40, label=f"N={n}")
    a.legend(loc="lower right", fontsize=8)
    a.set_title(
        f"{res['model']}: samples/s, labels M,N; * pick, square best; dotted: equal; Spearman(T) {s['spearman_time']:.2f}", fontsize=9
    )
    b.set_title("memory per device (MiB): o device 0, ^ device 1; dotted: equal", fontsize=9)
    b.set(xlabel="measured (recorder's accounting)", ylabel="predicted (Eq. 8)")
    fig.tight_layout()
    save_figure(fig, path, 90)


def main() -> None:
    quick = dict(models=["gpt-tiny"], tune_batches=2, batches=2, confirm=0, img="", out="/tmp/bench_tuner_quick.json",
                 set=["pipeline.tune_microbatches=[1,2]", "pipeline.tune_pipelines=[1,2]"])  # fmt: skip
    bench = Bench(__doc__, quick, rounds=1, retries=1, max_foreign=0.15, quiet_wait=60.0, budget=1500.0, timeout=900.0)
    bench.options(models=(list(MODELS), f"of {list(MODELS)}"), tune_batches=(20, "pipeline.tune_batches (the paper's twenty)"))
    bench.parser.add_argument("--set", nargs="*", default=[], help="extra Hydra overrides for every run (pipeline.tune_pipelines=[1,2])")
    bench.options(batches=(8, "recorded steps per traversal setting (one warm-up step more)"), lock="/tmp/bench.lock")
    bench.options(confirm=(1, "re-runs of the pick and the best (not counted in the traversal)"), workdir="/tmp/bench_tuner")
    bench.options(
        out=(str(REPO / "docs" / "results" / "tuner_results.json"), "raw results (JSON)"), img=(str(REPO / "docs" / "img"), "'': none")
    )
    bench.options(report=(None, "print the tables (and plots) of a saved results file; run nothing"))
    args = bench.parse()
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        results = [{"batches": saved["args"]["batches"], "tune_batches": saved["args"]["tune_batches"], **res} for res in saved["models"]]
    else:
        unknown = [n for n in args.models if n not in MODELS]
        if unknown:
            bench.error(f"--models: unknown {unknown}; known: {list(MODELS)}")
        results = [run_model(bench, name) for name in args.models]
        for res in results:
            res["summary"] = summarize(res)
        saved = {"date": bench.provenance, "machine": bench.provenance, "args": vars(args), "models": results}
        Path(args.out).write_text(json.dumps(saved, indent=1))
    for res in results:
        report(bench, res)
        if args.img:
            plot(res, Path(args.img) / f"tuner_{res['model']}.png")
    bench.finish()


if __name__ == "__main__":
    main()
