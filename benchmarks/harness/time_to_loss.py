"""Time to a target loss for every mode (benchmarks/bench_convergence.py ttt): what a user picks a mode for.

Each mode trains the model's CPU recipe through the CLI on 2 CPU devices (batch 16 samples per
optimizer step in every mode; AvgPipe: 2 pipelines of 8 on the same 2 devices, the paper's layout)
for the same steps, with validation every `val_every` steps on the same first validation batches.
The targets are the validation losses plain 1F1B reaches at 1/3, 2/3 and all of the steps (median
over seeds); a mode's time to a target is its training wall clock (`train/time`, validation
included as for every mode) at its first validation at or below it. Checkpoints are off: writing
them is not what a mode costs. The `-load` modes inject a slowdown (injected_load.py: ranks pinned to
their cores, a busy job on rank 1's core from step 50 to 250): static 1F1B against adaptive
re-partitioning (AutoPipe-RL's rule) under the same load, measured against 1F1B's unloaded targets.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import statistics
import sys
from typing import Any, Optional

from . import cli_runs as cli

VAL_SAMPLES = 160  # every validation: the same first samples of the validation split, in every mode
FLUSH = ["pipeline.microbatches=4", f"trainer.limit_val_batches={VAL_SAMPLES // 16}"]
AVGPIPE = [  # the reference is validated; each pipeline's sampler would split the windows: off
    *("pipeline=avgpipe", "pipeline.pipelines=2", "data.batch_size=8", "pipeline.microbatches=2"),
    *(f"trainer.limit_val_batches={VAL_SAMPLES // 8}", "+trainer.use_distributed_sampler=false"),
]
LOAD = [  # ranks pinned to their cores; a busy job shares rank 1's core from step 50 to 250 (injected_load.py)
    "+callbacks.load._target_=benchmarks.harness.injected_load.InjectedLoad",
    *("+callbacks.load.core=1", "+callbacks.load.start=50", "+callbacks.load.stop=250"),
]
MODES: dict[str, tuple[list[str], str]] = {  # name -> (Hydra overrides after the recipe, label)
    "1f1b": (["schedule=1f1b", *FLUSH], "1F1B"),
    "hanayo": (["schedule=hanayo", *FLUSH], "Hanayo (W = 1)"),
    "zb-h1": (["schedule=zb-h1", *FLUSH], "zero bubble ZB-H1"),
    "2bw": (["schedule=2bw", *FLUSH], "PipeDream-2BW"),
    "avgpipe": (["schedule=1f1b", *AVGPIPE], "AvgPipe N = 2 (1F1B)"),
    "avgpipe-2bw": (["schedule=2bw", "pipeline.advance_num=2", *AVGPIPE], "AvgPipe(2BW) N = 2, advance 2"),
    "1f1b-load": (["schedule=1f1b", *FLUSH, *LOAD], "1F1B, load on rank 1 (steps 50-250)"),
    "adaptive-load": (["schedule=1f1b", *FLUSH, *LOAD, "pipeline.adaptive=true"], "adaptive 1F1B, load on rank 1 (steps 50-250)"),
    "hysteresis-load": (  # ours: the rule with a switch back to the partition just left needing 10%, not 5%
        ["schedule=1f1b", *FLUSH, *LOAD, "pipeline.adaptive=true", "pipeline.adaptive_hysteresis=0.05"],
        "adaptive 1F1B + hysteresis 0.05 (ours), load on rank 1",
    ),
}
SWITCH = re.compile(r"adaptive: iteration (\d+): partition (\[[^]]*\]) -> (\[[^]]*\])")
RECIPES = {"gpt": "recipe=gpt-tiny-cpu", "bert": "recipe=bert-tiny-cpu"}
QUIET = ["callbacks.checkpoint=null", "callbacks.last=null"]


def read_timed(path: str) -> tuple[list[tuple[int, float]], dict[int, float]]:
    """(steps completed, val_loss) and steps completed -> train/time (seconds since training started)."""
    val, times = cli.read_columns(path, "val_loss", "train/time")
    return val, dict(times)


def time_at(step: int, times: dict[int, float]) -> float:
    """train/time at `step` (the nearest logged step at or before it)."""
    known = [s for s in times if s <= step]
    return times[max(known)] if known else float("nan")


def run_one(model: str, mode: str, seed: int, steps: int, val_every: int, folder: str, timeout: float) -> dict[str, Any]:
    overrides, _ = MODES[mode]
    run_dir = os.path.join(folder, f"{model}-{mode}-{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = cli.cli_command([RECIPES[model], *overrides, f"seed={seed}", *QUIET], steps, val_every, run_dir)
    try:
        _, wall, note = cli.train(f"{model} {mode} seed {seed}", cmd, run_dir, timeout)
    except SystemExit as failed:  # one mode's failure is a row of the table, not the end of the benchmark
        return {"val": [], "times": {}, "wall_s": float("nan"), "note": str(failed)[:400]}
    found = glob.glob(os.path.join(run_dir, "logs", "version_*", "metrics.csv"))
    val, times = read_timed(found[0])
    switches = [f"{it}: {a} -> {b}" for it, a, b in SWITCH.findall(open(run_dir + ".log").read())]
    return {"val": val, "times": {str(k): v for k, v in times.items()}, "wall_s": wall, "note": note, "switches": switches}


def switch_count(mode: str, runs: list[dict]) -> str:
    """Switches per run (adaptive modes): median (min..max); runs saved before they were counted: n/a."""
    if "pipeline.adaptive=true" not in MODES[mode][0]:
        return "-"
    counts = [len(r["switches"]) for r in runs if "switches" in r]
    return f"{statistics.median(counts):g} ({min(counts)}..{max(counts)})" if len(counts) == len(runs) else "n/a"


def targets(runs: list[dict], steps: int) -> list[float]:
    """The losses the baseline reaches at 1/3, 2/3 and all of the steps, median over its seeds."""
    out = []
    for fraction in (1 / 3, 2 / 3, 1.0):
        at = round(steps * fraction)
        losses = [min((abs(s - at), v) for s, v in r["val"])[1] for r in runs]
        out.append(statistics.median(losses))
    return out


def time_to(run: dict, target: float) -> Optional[float]:
    times = {int(k): v for k, v in run["times"].items()}
    for step, loss in run["val"]:
        if loss <= target:
            return time_at(step, times)
    return None


def main(doc: str = __doc__) -> None:
    import json
    import tempfile

    from .bench import Bench, Table, pyplot, save_figure, spread

    bench = Bench(doc, dict(steps=6, val_every=3), steps=300, timeout=1800.0)
    bench.options(
        models=(["gpt", "bert"], "of gpt, bert"),
        modes=(list(MODES), f"of {', '.join(MODES)} (1f1b first: it sets the targets)"),
        seeds=([0, 1, 2], "seeds"),
        val_every=(25, "steps between validations"),
        folder=(os.path.join(tempfile.gettempdir(), "bench_time_to_loss"), "run folders"),
        plot=(None, "write the validation loss against wall time here (PNG)"),
        reuse=(None, "a JSON of an earlier run: report it, training only the modes it lacks"),
    )
    args = bench.parse(sys.argv[2:])  # after bench_convergence.py's experiment name
    if args.quick:
        args.seeds, args.modes = [0], ["1f1b", "2bw"]
    if args.modes[0] != "1f1b" or set(args.modes) - set(MODES):
        bench.error(f"--modes: 1f1b first, then any of {list(MODES)}")
    runs = json.loads(open(args.reuse).read())["raw"]["runs"] if args.reuse else {}
    saved = set(runs)
    os.makedirs(args.folder, exist_ok=True)
    for model in args.models:  # seeds outermost: a drift of the machine falls on every mode alike
        missing = [mode for mode in args.modes if f"{model}/{mode}" not in saved]
        for seed in args.seeds:
            for mode in missing:
                runs.setdefault(f"{model}/{mode}", []).append(
                    run_one(model, mode, seed, args.steps, args.val_every, args.folder, args.timeout)
                )
    for model in args.models:
        goal = targets(runs[f"{model}/1f1b"], args.steps)
        t = Table("mode", *(f"to {g:.3f} (s)" for g in goal), f"val loss at step {args.steps}", "wall per run (s)", "switches")
        for mode in args.modes:
            rs = runs[f"{model}/{mode}"]
            failed = [r["note"] for r in rs if not r["val"]]
            if failed:
                bench.say(f"{model} {mode}: {len(failed)} run(s) failed: {failed[0]}")
            rs = [r for r in rs if r["val"]]
            if not rs:
                continue
            cells = []
            for g in goal:
                reached = [time_to(r, g) for r in rs]
                got = [x for x in reached if x is not None]
                cells.append(
                    spread(got).fmt() + ("" if len(got) == len(rs) else f" ({len(rs) - len(got)} of {len(rs)} never)") if got else "never"
                )
            final = spread(r["val"][-1][1] for r in rs).fmt(digits=4)
            t.add(MODES[mode][1], *cells, final, spread(r["wall_s"] for r in rs).fmt(digits=0), switch_count(mode, rs))
        title = (
            f"{model}: time to the validation loss 1F1B reaches at steps {round(args.steps / 3)}, {round(2 * args.steps / 3)}, "
            f"{args.steps}; medians (min..max) over seeds {args.seeds}; 16 samples per step"
        )
        bench.table(t, title)
    if args.plot:
        fig, axes = pyplot().subplots(1, len(args.models), figsize=(6 * len(args.models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], args.models):
            for mode in args.modes:
                r = runs[f"{model}/{mode}"][0]
                if not r["val"]:
                    continue
                times = {int(k): v for k, v in r["times"].items()}
                ax.plot([time_at(s, times) for s, _ in r["val"]], [v for _, v in r["val"]], marker="o", ms=3, label=MODES[mode][1])
            ax.set(title=f"{model}-tiny, 2 CPU devices, seed {args.seeds[0]}", xlabel="training wall clock (s)", ylabel="validation loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        save_figure(fig, args.plot)
    bench.keep("runs", runs)
    bench.finish()
