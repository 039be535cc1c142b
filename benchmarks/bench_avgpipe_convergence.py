"""Statistical efficiency of AvgPipe (elastic averaging, N = 1, 2, 4) against plain 1F1B on GPT-tiny.

Four runs through the CLI, same data, seed, steps and total batch (16 samples per step); every
validation over the same first --val-samples windows; then each final model (last.ckpt: the
reference for AvgPipe) on the whole validation split. Feeds docs/avgpipe_convergence.md (settings,
what is logged, results) and its figure docs/img/avgpipe_convergence.png.

    python benchmarks/bench_avgpipe_convergence.py
    python benchmarks/bench_avgpipe_convergence.py --quick   # smoke: 4 steps per run
"""

from __future__ import annotations

import math
import os
import tempfile

from lightning_pipe.bench import REPO
from lightning_pipe.bench import cli_runs as cli
from lightning_pipe.bench.harness import Bench, Table, pyplot, save_figure

TOTAL_BATCH = 16
# name -> (pipelines N, Hydra overrides, label, colour); every run: total batch 16 per step
AVG = ["recipe=gpt-tiny-avgpipe"]
RUNS = {
    "1f1b": (1, ["recipe=gpt-tiny-cpu", "pipeline.microbatches=4"], "plain 1F1B (1 pipeline, batch 16)", "black"),
    "avg1": (1, AVG + ["pipeline.pipelines=1", "trainer.devices=2", "data.batch_size=16", "pipeline.microbatches=4"],
             "AvgPipe N=1 (alpha=1, batch 16)", "tab:blue"),
    "avg2": (2, AVG + ["pipeline.pipelines=2", "trainer.devices=4", "data.batch_size=8", "pipeline.microbatches=2"],
             "AvgPipe N=2 (alpha=1/2, 2 x batch 8)", "tab:orange"),
    "avg4": (4, AVG + ["pipeline.pipelines=4", "trainer.devices=8", "data.batch_size=4", "pipeline.microbatches=2"],
             "AvgPipe N=4 (alpha=1/4, 4 x batch 4)", "tab:red"),
}  # fmt: skip


def full_validation(run_dir: str) -> tuple[float, int]:
    """Mean cross-entropy of the run's last.ckpt over the whole validation split, in this process."""
    import torch

    _, module, data = cli.instantiate_run(os.path.join(run_dir, "config_resolved.yaml"))
    module.load_state_dict(
        torch.load(os.path.join(run_dir, "checkpoints", "last.ckpt"), map_location="cpu", weights_only=False)["state_dict"]
    )
    module.eval()
    data.batch_size = 64
    data.setup("validate")
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            total += float(module._loss(batch)) * batch[0].shape[0]
            count += batch[0].shape[0]
    return total / count, count


def plot(curves: dict, smooth: int, steps: int, val_samples: int, out: str) -> None:
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.8))
    for name, (train_loss, val_loss) in curves.items():
        _, _, label, color = RUNS[name]
        x, y = cli.moving_average(train_loss, smooth)
        style = {"ls": "--", "lw": 2.2, "zorder": 1} if name == "1f1b" else {"lw": 1.2, "zorder": 2}  # avg1 lies on it
        left.plot([s * TOTAL_BATCH for s in x], y, color=color, alpha=0.85, label=label, **style)
        vx, vy = [s * TOTAL_BATCH for s, _ in val_loss], [v for _, v in val_loss]
        right.plot(vx, vy, color=color, marker="o", ms=7 if name == "1f1b" else 4, label=label, **style)
    left.set_title(f"train loss (pipeline 0's own batch; moving avg over {smooth} steps)", fontsize=10)
    right.set_title(f"validation loss (reference model; same {val_samples} val samples)", fontsize=10)
    for ax in (left, right):
        ax.set(xlabel=f"samples seen (steps x {TOTAL_BATCH})", ylabel="cross-entropy (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"GPT-tiny, 2 stages, CPU: AvgPipe N = 1, 2, 4 vs plain 1F1B, total batch {TOTAL_BATCH}/step, {steps} steps", fontsize=11)
    fig.tight_layout()
    save_figure(fig, out)


def main() -> None:
    quick = dict(steps=4, val_every=2, val_samples=16, smooth=2)
    quick["out"] = os.path.join(tempfile.gettempdir(), "bench_avgpipe_convergence_quick.png")
    bench = Bench(__doc__, quick, steps=800, timeout=1800.0)
    p = bench.parser
    cli.add_options(p, 100, 20, os.path.join(REPO, "docs", "img", "avgpipe_convergence.png"))
    p.add_argument("--val-samples", type=int, default=320, help="validation windows per validation, the same for every run")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs (1f1b is the baseline)")
    p.add_argument("--no-full-val", action="store_true", help="skip evaluating each final model on the whole val split")
    p.add_argument("--reuse", help="analyse the run folders kept by an earlier --keep (no training)")
    args = bench.parse()
    full, runs = {}, {}
    for name in args.runs:
        per_pipeline = TOTAL_BATCH // RUNS[name][0]
        if args.val_samples % per_pipeline:
            bench.error(f"--val-samples {args.val_samples} is not a multiple of {name}'s per-pipeline batch {per_pipeline}")
        limit = f"trainer.limit_val_batches={args.val_samples // per_pipeline}"
        runs[name] = [*RUNS[name][1], limit, "+trainer.use_distributed_sampler=false"]
    with cli.run_folder("bench_avgpipe_convergence_", args.keep, args.reuse) as folder:
        curves, walls, notes = cli.train_runs(runs, args, folder, reuse=bool(args.reuse))
        plot(curves, args.smooth, args.steps, args.val_samples, args.out)
        if not args.no_full_val:
            full = {name: full_validation(os.path.join(folder, name)) for name in args.runs}
    bench.log(f"figure: {args.out}" + (f"; run folders in {folder}" if args.keep or args.reuse else ""))
    base = "1f1b" if "1f1b" in curves else None
    val = {name: dict(curves[name][1]) for name in curves}
    rel = lambda v, b: f"{v:.4f} ({v / b - 1:+.2%})" if b else f"{v:.4f}"  # noqa: E731
    heads = ("plain 1F1B" if n == "1f1b" else f"AvgPipe N = {RUNS[n][0]}" for n in curves)
    t = Table("step", "samples", *heads, align="r" * (2 + len(curves)))
    for step in sorted(set().union(*val.values())):
        t.add(step, step * TOTAL_BATCH, *(rel(val[n].get(step, math.nan), base and n != base and val[base].get(step)) for n in curves))
    if full:
        samples = next(iter(full.values()))[1]
        t.add("final", f"whole val split ({samples})", *(rel(full[n][0], base and n != base and full[base][0]) for n in curves))
    bench.table(t, f"val_loss (the same {args.val_samples} val windows) by step; in brackets: relative to 1f1b")
    cli.say_tails(bench, curves, walls, args.smooth, " (pipeline 0)")
    for note in notes:
        bench.say(f"note: {note}")
    bench.keep("curves", curves)
    bench.keep("full_validation", full)
    bench.finish()


if __name__ == "__main__":
    main()
