"""AvgPipe's profiling-based tuner (§5.2, Eq. 1-8) against a real traversal of its grid (issue 13,
item 3; the paper's §7.3 comparison).

For each model:

1. **The tuner**, exactly as a user runs it: ``python -m lightning_pipe.plan <model> pipeline.tune=true
   pipeline.tune_batches=T``; its wall clock is the whole command (Python start, Hydra, the child
   profile run at (M = the grid's largest, N = 1) for T + 1 steps, the prediction). Its tune.json
   gives every candidate's predicted seconds per batch, samples/s and memory per device.
2. **The traversal**: every (M, N) of that grid trained for real, each for ``--batches`` + 1 steps,
   with exactly the command line of the tuner's profile run (``lightning_pipe.cli.tune.run_profile``:
   pipeline.pipelines=N pipeline.microbatches=M trainer.devices=N x K trainer.max_steps=...
   trainer.limit_val_batches=0 logger=none callbacks=none, env LIGHTNING_PIPE_TUNE_RECORD), so every
   rank writes its record (the first step is not recorded). Its wall clock is the sum of the
   settings' whole commands.

Measured per setting, from the rank records (global rank r = stage r mod K of pipeline r div K):
samples/s of the job = sum over pipelines of B / period (period = start-to-start seconds of an
iteration, optimizer step and AvgPipe's update included; mean over the pipeline's ranks), seconds
per batch = B / samples/s (the prediction's T: one pipeline's batch, the N pipelines' batches
sharing each device), the schedule alone likewise from ``wall``; memory of device k (the paper's
device shared by the N pipelines' stage k) = sum over the N ranks of stage k of model_bytes +
data_bytes (the recorder's accounting: weights, gradients, optimizer state; saved activations x
micro-batches in flight + the stage's input), against tune.json's memory_per_device[k].

Summary: the tuner's pick, the traversal's best (highest measured samples/s), pick's measured
throughput / best (target >= 0.90), tuner wall / traversal wall (target <= 0.10), Spearman's rank
correlation of predicted vs measured seconds per batch over the grid, memory errors. ``--confirm``
re-runs the pick and the best (not counted in the traversal's wall) to show the ratio's noise.

Each timed command holds /tmp/bench.lock (flock, shared with the other benchmarks) after waiting
(at most ``--quiet-wait`` s) for a quiet machine, and is repeated (at most ``--retries`` times)
when other processes used more than ``--max-foreign`` CPUs during it (CPU accounting: /proc/stat
less the CPU time of the command's whole process tree). Everything runs in ``--workdir`` so
Hydra's outputs stay out of the repository.

    python benchmarks/bench_tuner.py                                   # both models (~15 minutes on 2 cores)
    python benchmarks/bench_tuner.py --models gpt-tiny --batches 4 --confirm 0
    python benchmarks/bench_tuner.py --report docs/tuner_results.json  # tables and plots of a saved run
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from lightning_pipe.bench.launch import CpuClock, foreign_load, machine_description, own_seconds, wait_for_quiet
from lightning_pipe.bench.stats import spearman

REPO = Path(__file__).resolve().parent.parent
RECORD_ENV = "LIGHTNING_PIPE_TUNE_RECORD"  # lightning_pipe.lightning.tune_record.RECORD_ENV
MODELS: dict[str, list[str]] = {
    # 2 pipelines x 2 stages as configured: K = 2; batch 8 per pipeline -> M in 1, 2, 4, 8
    "gpt-tiny": ["recipe=gpt-tiny-avgpipe"],
    # BERT-tiny (masked LM; the attention mask travels) with AvgPipe: 4 devices / 2 pipelines = K = 2;
    # batch 16 per pipeline -> M in 1, 2, 4, 8, 16
    "bert-tiny": ["recipe=bert-tiny-cpu", "pipeline=avgpipe", "trainer.devices=4"],
}
MiB = 2**20


# ---- running one timed command -----------------------------------------------------------------
def _tree_cpu(root: int) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of `root` and its descendants, keyed by (pid, start time)."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the name: state ppid ... utime(14) stime(15) ... starttime(22), counted from field 3
        stats[int(entry)] = (int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / ticks)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[(pid, stats[pid][1])] = stats[pid][2]
        todo += children.get(pid, [])
    return out


class TreeClock:
    """Polls the CPU time of a process tree (Lightning's workers and AvgPipe's reference processes
    are not always waited for by their parents, so getrusage alone can miss them)."""

    def __init__(self, root: int, interval: float = 0.2):
        self.root, self.interval, self.seen = root, interval, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            for key, cpu in _tree_cpu(self.root).items():
                self.seen[key] = max(cpu, self.seen.get(key, 0.0))
            if self._stop.wait(self.interval):
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return sum(self.seen.values())


class Runner:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.spent = 0.0  # seconds holding the lock (waiting for it does not count against the budget)

    @property
    def patient(self) -> bool:
        return self.spent < self.args.budget

    def run(self, cmd: list[str], folder: Path, label: str, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
        """`cmd` in a fresh `folder` (its cwd), holding the lock; repeated if disturbed. Returns the
        kept attempt's wall seconds, foreign load and the attempts made."""
        attempts = []
        for attempt in range(self.args.retries + 1):
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            with open(self.args.lock, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the same lock as `flock /tmp/bench.lock ...`
                held = time.monotonic()
                try:
                    if self.patient:
                        wait_for_quiet(self.args.quiet_wait, self.args.max_foreign, poll=2.0, log=lambda msg: print(msg, flush=True))
                    start, mine = CpuClock.now(children=True), own_seconds()
                    t0 = time.perf_counter()
                    proc = subprocess.Popen(
                        cmd,
                        cwd=folder,
                        env={**os.environ, **(env or {})},
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                    clock = TreeClock(proc.pid)
                    try:
                        output, _ = proc.communicate(timeout=self.args.timeout)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        output, _ = proc.communicate()
                        clock.stop()
                        raise RuntimeError(f"{label}: no end after {self.args.timeout:.0f} s; log in {folder}") from None
                    wall = time.perf_counter() - t0
                    end = CpuClock.now(children=True)
                    polled = clock.stop()
                finally:
                    self.spent += time.monotonic() - held
                    fcntl.flock(lock, fcntl.LOCK_UN)
            (folder / "command.log").write_text(" ".join(cmd) + "\n\n" + output)
            if proc.returncode != 0:
                said = [line for line in output.splitlines() if line.startswith("error:")]
                raise RuntimeError(f"{label}: exit code {proc.returncode}: {(said or output.splitlines() or ['?'])[-1]} (log: {folder})")
            own = max(end.own - start.own, polled + own_seconds() - mine)  # the tree polled, plus this process
            foreign = foreign_load(start, end, own=own)
            attempts.append({"wall": wall, "foreign": foreign, "cpu": own})
            if foreign <= self.args.max_foreign or not self.patient:
                break
            print(
                f"  {label} disturbed: other processes used {foreign:.2f} CPUs{'; repeating' if attempt < self.args.retries else '; keeping it'}"
            )
        return {"wall": attempts[-1]["wall"], "foreign": attempts[-1]["foreign"], "cpu": attempts[-1]["cpu"], "attempts": attempts}


# ---- one model --------------------------------------------------------------------------------
def setting_overrides(m: int, n: int, k: int, steps: int, folder: Path) -> list[str]:
    """The tuner's profile-run command line (lightning_pipe.cli.tune.run_profile) at (M, N)."""
    return [
        "pipeline.tune=false",
        f"pipeline.pipelines={n}",
        f"pipeline.microbatches={m}",
        "pipeline.trace=false",
        f"trainer.devices={n * k}",
        "trainer.num_nodes=1",
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0",
        "logger=none",
        "callbacks=none",
        "ckpt_path=null",
        "test_after_fit=false",
        f"hydra.run.dir={folder}",
    ]


def measure(folder: Path, m: int, n: int, k: int, batch: int) -> dict[str, Any]:
    """What one setting's rank records say (see the module's docstring)."""
    ranks = {}
    for f in (folder / "ranks").glob("rank*.json"):
        ranks[int(f.stem[4:])] = _drop_curve(json.loads(f.read_text()))
    if len(ranks) != n * k:
        raise RuntimeError(f"M={m} N={n}: {len(ranks)} of {n * k} rank records in {folder / 'ranks'}")
    for r, rec in ranks.items():
        if rec["stage"] != r % k:
            raise RuntimeError(f"rank {r} recorded stage {rec['stage']}, expected {r % k}")
    per_pipeline = [[ranks[p * k + s] for s in range(k)] for p in range(n)]
    period = [statistics.fmean(rec["period"] for rec in pipe) for pipe in per_pipeline]
    wall = [statistics.fmean(rec["wall"] for rec in pipe) for pipe in per_pipeline]
    samples = sum(batch / p for p in period)
    schedule_samples = sum(batch / w for w in wall)
    memory = [sum(ranks[p * k + s]["model_bytes"] + ranks[p * k + s]["data_bytes"] for p in range(n)) for s in range(k)]
    data = [sum(ranks[p * k + s]["data_bytes"] for p in range(n)) for s in range(k)]
    plan = folder / "plan.json"  # logger=none: the partition planner writes into the cwd
    bounds = json.loads(plan.read_text()).get("bounds") if plan.exists() else None
    return {
        "samples_per_s": samples,
        "seconds_per_batch": batch / samples,
        "schedule_seconds_per_batch": batch / schedule_samples,
        "period": period,
        "memory_per_device": memory,
        "data_per_device": data,
        "bounds": bounds,
        "ranks": [ranks[r] for r in sorted(ranks)],
    }


def _drop_curve(rec: dict[str, Any]) -> dict[str, Any]:
    curve = rec.pop("utilisation", [])
    busy = sum(d for d, _ in curve)
    rec["mean_utilisation"] = sum(d * phi for d, phi in curve) / busy if busy > 0 else None
    return rec


def profile_partition(folder: Path) -> Optional[list[list[int]]]:
    """The bounds the tuner's profile run planned (its plan.json: in the cwd of the `plan` command while
    logger=none leaves the Trainer without a log folder, else in the profile run's folder)."""
    for plan in (folder / "plan.json", folder / "tune_profile" / "plan.json"):
        if plan.exists():
            return json.loads(plan.read_text()).get("bounds")
    return None


def run_model(name: str, runner: Runner, args: argparse.Namespace) -> dict[str, Any]:
    base = MODELS[name] + args.set
    work = Path(args.workdir).resolve() / name
    py = [sys.executable, "-m"]
    print(f"\n## {name}: {' '.join(base)}", flush=True)

    folder = work / "tune"
    cmd = py + ["lightning_pipe.plan", *base, "pipeline.tune=true", f"pipeline.tune_batches={args.tune_batches}", f"hydra.run.dir={folder}"]
    tuner = runner.run(cmd, folder, f"{name} tuner")
    tuned = json.loads((folder / "tune.json").read_text())
    ranks = sorted((folder / "tune_profile" / "ranks").glob("rank*.json"))
    tuner.update(command=" ".join(cmd[2:]), tune=tuned, profile_ranks=[_drop_curve(json.loads(f.read_text())) for f in ranks])
    k, batch = len(tuned["profile"]["stages"]), tuned["profile"]["batch_size"]
    chosen = (tuned["chosen"]["microbatches"], tuned["chosen"]["pipelines"])
    print(
        f"tuner: {tuner['wall']:.1f} s (profile run {tuned['seconds']['profile_run']:.1f} s, foreign load {tuner['foreign']:.2f}); "
        f"K = {k}, B = {batch}; chose M={chosen[0]} N={chosen[1]}",
        flush=True,
    )

    # the partition: the profile run's (the paper partitions once, then tunes M and N), or each run's own plan
    fixed: list[str] = []
    profile_bounds = profile_partition(work / "tune")
    if args.partition == "profile" and profile_bounds is not None:
        fixed = [f"pipeline.partition=[{','.join(str(b - a) for a, b in profile_bounds)}]"]
    print(f"profile run's partition {profile_bounds}; traversal: {fixed[0] if fixed else 'each run plans its own'}", flush=True)
    tuner["bounds"] = profile_bounds

    settings = {}
    for rep in range(args.repeats):  # passes over the grid; the traversal's wall clock is the first pass's
        for c in sorted(tuned["candidates"], key=lambda c: (c["pipelines"], c["microbatches"])):
            m, n = c["microbatches"], c["pipelines"]
            folder = work / (f"M{m}_N{n}" + (f"_pass{rep + 1}" if rep else ""))
            cmd = py + ["lightning_pipe.train", *base, *fixed, *setting_overrides(m, n, k, args.batches + 1, folder)]
            run = runner.run(cmd, folder, f"{name} M={m} N={n}", env={RECORD_ENV: str(folder / "ranks")})
            got = measure(folder, m, n, k, batch)
            entry = settings.setdefault((m, n), {"microbatches": m, "pipelines": n, "predicted": c, "passes": [], "runs": []})
            entry["passes"].append(got)
            entry["runs"].append(run)
            print(
                f"  M={m:>2} N={n}: {run['wall']:5.1f} s, {got['samples_per_s']:6.1f} samples/s measured, "
                f"{c['predicted_samples_per_s']:6.1f} predicted (foreign load {run['foreign']:.2f})",
                flush=True,
            )
    for entry in settings.values():  # the median over the passes; memory and records from the first
        entry["run"] = entry["runs"][0]
        entry["measured"] = dict(entry["passes"][0])
        entry["measured"]["samples_per_s_passes"] = [g["samples_per_s"] for g in entry["passes"]]
        for key in ("samples_per_s", "seconds_per_batch", "schedule_seconds_per_batch"):
            entry["measured"][key] = statistics.median(g[key] for g in entry["passes"])
        del entry["passes"][0]  # kept as "measured"
    settings = list(settings.values())

    confirm = []
    best = max(settings, key=lambda s: s["measured"]["samples_per_s"])
    pick = next(s for s in settings if (s["microbatches"], s["pipelines"]) == chosen)
    for rep in range(args.confirm):
        for s in {id(x): x for x in (pick, best)}.values():
            m, n = s["microbatches"], s["pipelines"]
            folder = work / f"confirm{rep}_M{m}_N{n}"
            cmd = py + ["lightning_pipe.train", *base, *fixed, *setting_overrides(m, n, k, args.batches + 1, folder)]
            run = runner.run(cmd, folder, f"{name} confirm M={m} N={n}", env={RECORD_ENV: str(folder / "ranks")})
            got = measure(folder, m, n, k, batch)
            confirm.append({"microbatches": m, "pipelines": n, "samples_per_s": got["samples_per_s"], "run": run})
    return {
        "model": name,
        "overrides": base,
        "batches": args.batches,
        "tune_batches": args.tune_batches,
        "partition": fixed,
        "stages": k,
        "batch_size": batch,
        "tuner": tuner,
        "settings": settings,
        "confirm": confirm,
    }


# ---- the report -------------------------------------------------------------------------------
def summarize(res: dict[str, Any]) -> dict[str, Any]:
    settings, tuner = res["settings"], res["tuner"]
    chosen = (tuner["tune"]["chosen"]["microbatches"], tuner["tune"]["chosen"]["pipelines"])
    key = lambda s: (s["microbatches"], s["pipelines"])  # noqa: E731
    best = max(settings, key=lambda s: s["measured"]["samples_per_s"])
    pick = next(s for s in settings if key(s) == chosen)
    predicted = [s["predicted"]["predicted_seconds_per_batch"] for s in settings]
    measured = [s["measured"]["seconds_per_batch"] for s in settings]
    schedule = [s["measured"]["schedule_seconds_per_batch"] for s in settings]
    mem_err = [
        (p - q) / q for s in settings for p, q in zip(s["predicted"]["memory_per_device"], s["measured"]["memory_per_device"]) if q > 0
    ]
    prof = tuner["tune"]["profile"]  # Eq. 8's data part alone: (m / m*) (n* / n) F_dat of the profile
    data_err = [
        ((prof["microbatches"] / s["microbatches"]) * (s["pipelines"] / prof["pipelines"]) * st["data_bytes"] - q) / q
        for s in settings
        for st, q in zip(prof["stages"], s["measured"]["data_per_device"])
        if q > 0
    ]
    traversal = sum(s["run"]["wall"] for s in settings)
    # the training steps alone (no process start): steps x measured period, first pass / the profile run
    steps_traversal = sum((res["batches"] + 1) * statistics.fmean(s["measured"]["period"]) for s in settings)
    profile_period = statistics.fmean(r["period"] for r in tuner["profile_ranks"]) if tuner.get("profile_ranks") else None
    out = {
        "chosen": list(chosen),
        "best": list(key(best)),
        "pick_over_best": pick["measured"]["samples_per_s"] / best["measured"]["samples_per_s"],
        "tuner_wall": tuner["wall"],
        "traversal_wall": traversal,
        "wall_ratio": tuner["wall"] / traversal,
        "traversal_steps_seconds": steps_traversal,
        "tuner_steps_seconds": (res["tune_batches"] + 1) * profile_period if profile_period else None,
        "spearman_time": spearman(predicted, measured),
        "spearman_schedule_time": spearman(predicted, schedule),
        "time_error_median": statistics.median(abs(p - q) / q for p, q in zip(predicted, measured)),
        "memory_error_mean_abs": statistics.fmean(abs(e) for e in mem_err),
        "memory_error_max_abs": max(abs(e) for e in mem_err),
        "memory_data_error_mean_abs": statistics.fmean(abs(e) for e in data_err),
        "memory_data_error_max_abs": max(abs(e) for e in data_err),
        "memory_error_signed": [min(mem_err), max(mem_err)],
        "max_foreign": max([tuner["foreign"]] + [s["run"]["foreign"] for s in settings]),
    }
    # the paper's guidelines (§7.3): max-num = M at its largest, then N at its largest; max-size = M = 1, N = 2
    ms = sorted({s["microbatches"] for s in settings})
    ns = sorted({s["pipelines"] for s in settings})
    for label, want in (("max_num", (ms[-1], ns[-1])), ("max_size", (ms[0], 2 if 2 in ns else ns[-1]))):
        s = next(s for s in settings if key(s) == want)
        out[label] = {"setting": list(want), "over_best": s["measured"]["samples_per_s"] / best["measured"]["samples_per_s"]}
    if res.get("confirm"):
        per = {}
        for c in res["confirm"]:
            per.setdefault((c["microbatches"], c["pipelines"]), []).append(c["samples_per_s"])
        pick_all = per.get(chosen, []) + [pick["measured"]["samples_per_s"]]
        best_all = per.get(key(best), []) + [best["measured"]["samples_per_s"]]
        out["confirm_pick_over_best"] = statistics.median(pick_all) / statistics.median(best_all)
        out["confirm_samples_per_s"] = {f"M={m} N={n}": v for (m, n), v in per.items()}
    return out


def report(res: dict[str, Any]) -> str:
    s = summarize(res)
    k = res["stages"]
    lines = [
        f"### {res['model']} ({' '.join(res['overrides'])}; K = {k} stages, B = {res['batch_size']} per pipeline)",
        "",
        f"tuner: `{res['tuner']['command']}`: {s['tuner_wall']:.1f} s "
        f"(of which the profile run {res['tuner']['tune']['seconds']['profile_run']:.1f} s); traversal of "
        f"{len(res['settings'])} settings: {s['traversal_wall']:.1f} s",
        "",
        "| M | N | predicted ms/batch | measured ms/batch | schedule only | predicted samples/s | measured samples/s | "
        + " | ".join(f"device {d} memory MiB pred / meas" for d in range(k))
        + " | mean phi | run s | foreign load |",
        "|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * k + "---:|---:|---:|",
    ]
    chosen, best = tuple(s["chosen"]), tuple(s["best"])
    for x in sorted(res["settings"], key=lambda x: (x["microbatches"], x["pipelines"])):
        p, q = x["predicted"], x["measured"]
        tags = ("**pick**" if (x["microbatches"], x["pipelines"]) == chosen else "") + (
            " **best**" if (x["microbatches"], x["pipelines"]) == best else ""
        )
        passes = q.get("samples_per_s_passes", [])
        passes = f" ({' / '.join(f'{v:.1f}' for v in passes)})" if len(passes) > 1 else ""
        phi = statistics.fmean(r["mean_utilisation"] or 0.0 for r in q["ranks"])
        mem = " | ".join(f"{a / MiB:.1f} / {b / MiB:.1f}" for a, b in zip(p["memory_per_device"], q["memory_per_device"]))
        lines.append(
            f"| {x['microbatches']} | {x['pipelines']} {tags} | {p['predicted_seconds_per_batch'] * 1e3:.1f} | "
            f"{q['seconds_per_batch'] * 1e3:.1f} | {q['schedule_seconds_per_batch'] * 1e3:.1f} | "
            f"{p['predicted_samples_per_s']:.1f} | {q['samples_per_s']:.1f}{passes} | {mem} | {phi:.2f} | {x['run']['wall']:.1f} | {x['run']['foreign']:.2f} |"
        )
    ok = lambda good: "met" if good else "NOT met"  # noqa: E731
    lines += [
        "",
        f"- tuner's pick M={chosen[0]} N={chosen[1]}, traversal's best M={best[0]} N={best[1]}: pick's measured "
        f"throughput / best = **{s['pick_over_best']:.3f}** (target >= 0.90: {ok(s['pick_over_best'] >= 0.9)})"
        + (f"; median over the re-runs (--confirm): {s['confirm_pick_over_best']:.3f}" if "confirm_pick_over_best" in s else ""),
        f"- tuner wall / traversal wall = {s['tuner_wall']:.1f} / {s['traversal_wall']:.1f} s = **{s['wall_ratio']:.3f}** "
        f"(target <= 0.10: {ok(s['wall_ratio'] <= 0.1)}); the training steps alone (steps x measured period, no process "
        f"start): traversal {s['traversal_steps_seconds']:.1f} s"
        + (f", tuner's profile {s['tuner_steps_seconds']:.1f} s" if s["tuner_steps_seconds"] else ""),
        f"- Spearman rank correlation, predicted vs measured seconds per batch over the {len(res['settings'])} settings: "
        f"**{s['spearman_time']:.2f}** (vs the schedule's time alone, without optimizer and update: {s['spearman_schedule_time']:.2f}); "
        f"median |error| of the predicted time {100 * s['time_error_median']:.0f}%",
        f"- memory per device, predicted vs measured: mean |error| {100 * s['memory_error_mean_abs']:.1f}%, "
        f"max {100 * s['memory_error_max_abs']:.1f}% (range {100 * s['memory_error_signed'][0]:+.1f}% .. "
        f"{100 * s['memory_error_signed'][1]:+.1f}%); the data part alone (activations, inputs): mean |error| "
        f"{100 * s['memory_data_error_mean_abs']:.1f}%, max {100 * s['memory_data_error_max_abs']:.1f}%",
        f"- the paper's guidelines, measured / best: max-num M={s['max_num']['setting'][0]} N={s['max_num']['setting'][1]} "
        f"{s['max_num']['over_best']:.2f}, max-size M={s['max_size']['setting'][0]} N={s['max_size']['setting'][1]} "
        f"{s['max_size']['over_best']:.2f}",
        f"- largest foreign load during a kept run: {s['max_foreign']:.2f} CPUs",
    ]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(res)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for x in res["settings"]:
        m, n = x["microbatches"], x["pipelines"]
        p, q = x["predicted"]["predicted_samples_per_s"], x["measured"]["samples_per_s"]
        mark = "*" if [m, n] == s["chosen"] else ("s" if [m, n] == s["best"] else "o")
        a.scatter(q, p, marker=mark, s=120 if mark != "o" else 40, c=f"C{[1, 2, 4].index(n) if n in (1, 2, 4) else 3}")
        a.annotate(f"{m},{n}", (q, p), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for d, (pm, qm) in enumerate(zip(x["predicted"]["memory_per_device"], x["measured"]["memory_per_device"])):
            b.scatter(qm / MiB, pm / MiB, marker="o^"[d % 2], c=f"C{d}", s=30)
    lim = max(a.get_xlim()[1], a.get_ylim()[1]) * 1.05
    a.plot([0, lim], [0, lim], "k:", lw=0.8)
    a.set_xlim(0, lim)
    a.set_ylim(0, lim)
    for i, n in enumerate((1, 2, 4)):
        a.scatter([], [], c=f"C{i}", s=40, label=f"N={n}")
    a.legend(loc="lower right", fontsize=8)
    a.set_title(
        f"{res['model']}: samples/s, labels M,N; * pick, square best; dotted: equal; Spearman(T) {s['spearman_time']:.2f}", fontsize=9
    )
    a.set_xlabel("measured samples/s")
    a.set_ylabel("predicted samples/s (Eq. 1-7)")
    lim = max(b.get_xlim()[1], b.get_ylim()[1])
    b.plot([0, lim], [0, lim], "k:", lw=0.8)
    b.set_title("memory per device (MiB): o device 0, ^ device 1; dotted: equal", fontsize=9)
    b.set_xlabel("measured (recorder's accounting)")
    b.set_ylabel("predicted (Eq. 8)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--set", nargs="*", default=[], help="extra Hydra overrides for every run (e.g. pipeline.tune_pipelines=[1,2])")
    p.add_argument("--tune-batches", type=int, default=20, help="pipeline.tune_batches of the tuner (the paper's twenty)")
    p.add_argument("--batches", type=int, default=8, help="recorded steps per traversal setting (one warm-up step more)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the grid (measured = median; traversal wall = first pass)")
    p.add_argument("--confirm", type=int, default=1, help="re-runs of the pick and the best (not counted in the traversal)")
    p.add_argument("--workdir", default="/tmp/bench_tuner", help="scratch folder: every run's Hydra folder and cwd")
    p.add_argument("--out", default=str(REPO / "docs" / "tuner_results.json"), help="raw results (JSON)")
    p.add_argument("--img", default=str(REPO / "docs" / "img"), help="folder for tuner_<model>.png ('' for none)")
    p.add_argument("--report", default=None, help="print the tables (and plots) of a saved results file; run nothing")
    p.add_argument(
        "--partition",
        choices=["profile", "planned"],
        default="profile",
        help="traversal's partition: the tuner's profile run's (fixed, as the paper) or each run's own autopipe plan",
    )
    p.add_argument("--lock", default="/tmp/bench.lock")
    p.add_argument("--retries", type=int, default=1, help="repeats of a run other processes disturbed")
    p.add_argument("--max-foreign", type=float, default=0.15, help="CPUs other processes may use during a kept run")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait for a quiet machine before each run")
    p.add_argument(
        "--budget", type=float, default=1500.0, help="seconds (holding the lock) after which nobody is waited for and nothing repeated"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one command may take")
    args = p.parse_args()

    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(f"# bench_tuner, {saved['date']}; {saved['machine']}\n")
        for res in saved["models"]:
            res.setdefault("batches", saved["args"]["batches"])
            res.setdefault("tune_batches", saved["args"]["tune_batches"])
            print(report(res) + "\n")
            if args.img:
                plot(res, Path(args.img) / f"tuner_{res['model']}.png")
        return

    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; known: {list(MODELS)}")
    date = datetime.datetime.now().isoformat(timespec="seconds")
    machine = f"{machine_description()}; {os.cpu_count()} cores"
    print(f"# bench_tuner, {date}; {machine}", flush=True)
    runner = Runner(args)
    t0 = time.perf_counter()
    results = [run_model(name, runner, args) for name in names]
    total = time.perf_counter() - t0
    saved = {"date": date, "machine": machine, "args": vars(args), "seconds": total, "models": results}
    for res in results:
        res["summary"] = summarize(res)
    Path(args.out).write_text(json.dumps(saved, indent=1))
    print(f"\n(benchmark: {total:.0f} s; raw results: {args.out})\n")
    for res in results:
        print(report(res) + "\n")
        if args.img:
            plot(res, Path(args.img) / f"tuner_{res['model']}.png")


if __name__ == "__main__":
    main()
