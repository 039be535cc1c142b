"""Statistical efficiency on GPT-tiny through the CLI: the same data, seed and steps, only the update rule differs.

``2bw``: PipeDream-2BW against 1F1B (PipeDream-Flush) on 2 CPU processes; with --reference also both
rules written out on one process (docs/results/two_bw_convergence.md). ``avgpipe``: AvgPipe N = 1, 2, 4
against plain 1F1B at 16 samples per step, every validation over the same first --val-samples
windows, then each final model (last.ckpt: the reference for AvgPipe) on the whole validation split
(docs/results/avgpipe_convergence.md).

    python -m benchmarks.bench_convergence 2bw --reference
    python -m benchmarks.bench_convergence avgpipe
    python -m benchmarks.bench_convergence avgpipe --quick   # smoke: 4 steps per run
    flock /tmp/bench.lock python -m benchmarks.bench_convergence ttt --json docs/results/time_to_loss.json --plot docs/img/time_to_loss.png
    python -m benchmarks.bench_convergence efficiency --json docs/results/stat_efficiency.json   # long runs, the papers' settings
"""

from __future__ import annotations

import copy
import math
import os
import sys
import tempfile
import time

from benchmarks.harness import REPO, stat_efficiency, time_to_loss
from benchmarks.harness import cli_runs as cli
from benchmarks.harness.bench import Bench, Table, pyplot, save_figure

TOTAL_BATCH = 16  # avgpipe: samples per step in every run
AVG = ["recipe=gpt-tiny-avgpipe", "schedule=1f1b"]  # 1F1B inside each pipeline, as measured (the recipe runs advance)
RUNS = {  # experiment -> name -> (pipelines N, Hydra overrides, label, colour)
    "2bw": {
        "2bw": (1, ["recipe=gpt-tiny-2bw"], "PipeDream-2BW (1-stale)", "tab:red"),
        "1f1b": (1, ["recipe=gpt-tiny-cpu", "pipeline.schedule=1f1b", "pipeline.microbatches=2"], "1F1B / PipeDream-Flush", "tab:blue"),
    },
    "avgpipe": {
        "1f1b": (1, ["recipe=gpt-tiny-cpu", "pipeline.microbatches=4"], "plain 1F1B (1 pipeline, batch 16)", "black"),
        "avg1": (1, AVG + ["pipeline.pipelines=1", "trainer.devices=2", "data.batch_size=16", "pipeline.microbatches=4"],
                 "AvgPipe N=1 (alpha=1, batch 16)", "tab:blue"),
        "avg2": (2, AVG + ["pipeline.pipelines=2", "trainer.devices=2", "data.batch_size=8", "pipeline.microbatches=2"],
                 "AvgPipe N=2 (alpha=1/2, 2 x batch 8)", "tab:orange"),
        "avg4": (4, AVG + ["pipeline.pipelines=4", "trainer.devices=2", "data.batch_size=4", "pipeline.microbatches=2"],
                 "AvgPipe N=4 (alpha=1/4, 4 x batch 4)", "tab:red"),
    },
}  # fmt: skip
# experiment -> its defaults of --steps, --val-every, --smooth (given on the command line: those); its figure and title
DEFAULTS = {"2bw": dict(steps=300, val_every=50, smooth=10), "avgpipe": dict(steps=800, val_every=100, smooth=20)}
FIGURES = {"2bw": "2bw_vs_1f1b_loss.png", "avgpipe": "avgpipe_convergence.png"}
TITLES = {
    "2bw": "PipeDream-2BW vs 1F1B, 2 micro-batches/step",
    "avgpipe": f"AvgPipe N = 1, 2, 4 vs plain 1F1B, total batch {TOTAL_BATCH}/step",
}


def reference(config_path: str, stale: bool, val_every: int) -> list[tuple[int, float]]:
    """The update rule on one process, from a pipelined run's resolved config: (steps, val_loss).
    The CLI's own construction and Lightning's step (clipping, optimizer, scheduler); ``stale``:
    batch t's gradient is taken on a copy holding W(max(t-1, 0)) and applied to W(t)."""
    import torch

    cfg, module, data = cli.instantiate_run(config_path, seed=True)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    live, shadow = list(module.model.parameters()), copy.deepcopy(module.model)  # shadow: W(t-1) for the stale rule
    previous, val_loader, limit = copy.deepcopy(module.model.state_dict()), data.val_dataloader(), cfg.trainer.limit_val_batches
    val_batches = limit if isinstance(limit, int) else max(1, int(limit * len(val_loader)))
    batches, out = iter(data.train_dataloader()), []
    for step in range(cfg.trainer.max_steps):
        (ids, targets) = batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        if stale:
            shadow.load_state_dict(previous)
            shadow.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(shadow(ids).flatten(0, 1), targets.flatten()).backward()
            for p, q in zip(live, shadow.parameters()):
                p.grad = q.grad.clone()
            previous = copy.deepcopy(module.model.state_dict())  # W(t), read by batch t + 1
        else:
            module._loss(batch).backward()
        torch.nn.utils.clip_grad_norm_(live, cfg.trainer.gradient_clip_val)
        optimizer.step()
        scheduler.step()
        if (step + 1) % val_every == 0 or step + 1 == cfg.trainer.max_steps:
            module.model.eval()
            with torch.no_grad():
                losses = [float(module._loss(b)) for _, b in zip(range(val_batches), val_loader)]
            module.model.train()
            out.append((step + 1, sum(losses) / len(losses)))
    return out


def full_validation(run_dir: str) -> tuple[float, int]:
    """Mean cross-entropy of the run's last.ckpt over the whole validation split, in this process."""
    import torch

    _, module, data = cli.instantiate_run(os.path.join(run_dir, "config_resolved.yaml"))
    checkpoint = torch.load(os.path.join(run_dir, "checkpoints", "last.ckpt"), map_location="cpu", weights_only=False)
    module.load_state_dict(checkpoint["state_dict"])
    module.eval()
    data.batch_size = 64
    data.setup("validate")
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            total += float(module._loss(batch)) * batch[0].shape[0]
            count += batch[0].shape[0]
    return total / count, count


def plot(experiment: str, curves: dict, args) -> None:
    """Train loss (moving average) and validation loss side by side, against samples seen (avgpipe) or steps (2bw)."""
    avg = experiment == "avgpipe"  # pipeline 0 logs its own batch's loss; the reference is validated
    per_step = TOTAL_BATCH if avg else 1
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.8))
    for name, (train_loss, val_loss) in curves.items():
        _, _, label, color = RUNS[experiment][name]
        x, y = cli.moving_average(train_loss, args.smooth)
        style = {"ls": "--", "lw": 2.2, "zorder": 1} if name == "1f1b" else {"lw": 1.2, "zorder": 2}  # the baseline under the others
        left.plot([s * per_step for s in x], y, color=color, alpha=0.85, label=label, **style)
        right.plot([s * per_step for s, _ in val_loss], [v for _, v in val_loss], color=color, marker="o", ms=4, label=label, **style)
    whose, which = ("pipeline 0's own batch; ", f" (reference model; same {args.val_samples} val samples)") if avg else ("", "")
    left.set_title(f"train loss ({whose}moving avg over {args.smooth} steps)", fontsize=10)
    right.set_title(f"validation loss{which}", fontsize=10)
    for ax in (left, right):
        ax.set(xlabel=f"samples seen (steps x {TOTAL_BATCH})" if avg else "optimizer step", ylabel="cross-entropy (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"GPT-tiny, 2 stages, CPU: {TITLES[experiment]}, {args.steps} steps", fontsize=11)
    fig.tight_layout()
    save_figure(fig, args.out)


def two_bw(bench: Bench, args, curves: dict, folder: str) -> list[str]:
    """The table (with --reference the one-process rules); the lines to say after the tails."""
    refs = {}
    for name, stale in (("2bw", True), ("1f1b", False)) if args.reference else ():
        start = time.perf_counter()
        refs[name] = dict(reference(os.path.join(folder, "2bw", "config_resolved.yaml"), stale, args.val_every))
        bench.log(f"[one-process {name} rule] {time.perf_counter() - start:.0f} s")
    cols = ["step", "val 2BW (pipeline)", "val 1F1B (pipeline)", "2BW / 1F1B − 1", "val 2BW rule (1 process)", "val sync rule (1 process)"]
    t = Table(*cols[: 6 if refs else 4], align="r" * (6 if refs else 4))
    val = {name: dict(v) for name, (_, v) in curves.items()}
    for step in sorted(set(val["2bw"]) | set(val["1f1b"])):
        a, b = val["2bw"].get(step, math.nan), val["1f1b"].get(step, math.nan)
        t.add(step, f"{a:.4f}", f"{b:.4f}", f"{a / b - 1:+.1%}", *(f"{ref.get(step, math.nan):.4f}" for ref in refs.values()))
    bench.table(t)
    final = {name: v[max(v)] for name, v in val.items()}
    rel = final["2bw"] / final["1f1b"] - 1
    return [
        f"final val_loss: 2bw {final['2bw']:.4f}, 1f1b {final['1f1b']:.4f}; relative difference {rel:+.2%}",
        f"criterion |difference| <= {args.tolerance:.0%}: {'PASS' if abs(rel) <= args.tolerance else 'FAIL'}",
    ]


def avgpipe(bench: Bench, args, curves: dict, folder: str) -> list[str]:
    full = {} if args.no_full_val else {name: full_validation(os.path.join(folder, name)) for name in curves}
    base = "1f1b" if "1f1b" in curves else None
    val = {name: dict(curves[name][1]) for name in curves}
    rel = lambda v, b: f"{v:.4f} ({v / b - 1:+.2%})" if b else f"{v:.4f}"  # noqa: E731
    heads = ("plain 1F1B" if n == "1f1b" else f"AvgPipe N = {RUNS['avgpipe'][n][0]}" for n in curves)
    t = Table("step", "samples", *heads, align="r" * (2 + len(curves)))
    for step in sorted(set().union(*val.values())):
        t.add(step, step * TOTAL_BATCH, *(rel(val[n].get(step, math.nan), base and n != base and val[base].get(step)) for n in curves))
    if full:
        samples = next(iter(full.values()))[1]
        t.add("final", f"whole val split ({samples})", *(rel(full[n][0], base and n != base and full[base][0]) for n in curves))
    bench.table(t, f"val_loss (the same {args.val_samples} val windows) by step; in brackets: relative to 1f1b")
    bench.keep("full_validation", full)
    return []


def main() -> None:
    own = {"ttt": time_to_loss, "efficiency": stat_efficiency}  # experiments with modules of their own
    if sys.argv[1:2] and sys.argv[1] in own:
        return own[sys.argv[1]].main()  # which parses sys.argv[2:]
    bench = Bench(__doc__, dict(steps=4, val_every=2, val_samples=16, smooth=2), steps=None, timeout=1800.0)
    p = bench.parser
    bench.experiment(DEFAULTS)
    cli.add_options(p, val_every=None, smooth=None, out=None)  # None: the experiment's
    p.add_argument("--reuse", help="analyse the run folders kept by an earlier --keep (no training)")
    p.add_argument("--runs", nargs="+", default=None, help="which runs (default all; 1f1b is the baseline)")
    p.add_argument("--tolerance", type=float, default=0.03, help="2bw: criterion on |val 2bw / val 1f1b - 1|")
    p.add_argument("--reference", action="store_true", help="2bw: also run both rules on one process")
    p.add_argument("--val-samples", type=int, default=320, help="avgpipe: validation windows per validation, the same for every run")
    p.add_argument("--no-full-val", action="store_true", help="avgpipe: skip evaluating each final model on the whole val split")
    args = bench.parse()
    exp, runs = args.experiment, RUNS[args.experiment]
    folder = tempfile.gettempdir() if args.quick else os.path.join(REPO, "docs", "img")
    args.out = args.out or os.path.join(folder, f"bench_{exp}_convergence_quick.png" if args.quick else FIGURES[exp])
    overrides = {name: runs[name][1] for name in args.runs or runs}
    if set(overrides) - set(runs) or (exp == "2bw" and len(overrides) < 2):
        bench.error(f"--runs: of {list(runs)}" + (" (2bw: both)" if exp == "2bw" else ""))
    for name in overrides if exp == "avgpipe" else ():  # every run validates on the same windows
        per_pipeline = TOTAL_BATCH // runs[name][0]
        if args.val_samples % per_pipeline:
            bench.error(f"--val-samples {args.val_samples} is not a multiple of {name}'s per-pipeline batch {per_pipeline}")
        overrides[name] = [*overrides[name], f"trainer.limit_val_batches={args.val_samples // per_pipeline}"]
        overrides[name].append("+trainer.use_distributed_sampler=false")
    with cli.run_folder(f"bench_{exp}_convergence_", args.keep, args.reuse) as folder:
        curves, walls, notes = cli.train_runs(overrides, args, folder, reuse=bool(args.reuse))
        plot(exp, curves, args)
        bench.log(f"figure: {args.out}" + (f"; run folders in {folder}" if args.keep or args.reuse else ""))
        after = (two_bw if exp == "2bw" else avgpipe)(bench, args, curves, folder)
    cli.say_tails(bench, curves, walls, args.smooth, " (pipeline 0)" if exp == "avgpipe" else "")
    for line in after + [f"note: {note}" for note in notes]:
        bench.say(line)
    bench.keep("curves", curves)
    bench.finish()


if __name__ == "__main__":
    main()
