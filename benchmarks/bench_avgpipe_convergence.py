"""Statistical efficiency of AvgPipe (elastic averaging) against plain 1F1B on GPT-tiny.

Trains GPT-tiny (2 pipeline stages, CPU, gloo) four times on the same data and seed, with the same
total batch per optimizer step, B = 16 samples, and the same number of steps:

- ``1f1b``:  ``recipe=gpt-tiny-cpu``: one pipeline, 2 processes, batch 16 in 4 micro-batches of 4;
- ``avg1``:  AvgPipe N = 1: one pipeline (2 processes + 2 reference processes), batch 16 in 4
  micro-batches. alpha = 1/N = 1, so W_1(t + 1) = W_ref(t) + delta_1(t) = W_ref(t + 1): plain
  training with a reference kept alongside (a check of the machinery, not of the method);
- ``avg2``:  AvgPipe N = 2 (``recipe=gpt-tiny-avgpipe``): 2 pipelines x 2 stages = 4 processes + 2
  references, batch 8 per pipeline in 2 micro-batches, alpha = 1/2;
- ``avg4``:  AvgPipe N = 4: 4 x 2 = 8 processes + 2 references, batch 4 per pipeline in 2
  micro-batches, alpha = 1/4.

Each run goes through the CLI (``python -m lightning_pipe.train``) with ``hydra.run.dir`` in a fresh
temporary folder and ``trainer.log_every_n_steps=1``; the script reads ``logs/version_0/metrics.csv``.

What the CSV holds (Lightning's CSVLogger writes on global rank 0 only, and the CLI's models log
without ``sync_dist``): ``train_loss`` is pipeline 0's own loss on its own 16/N-sample batch, before
its step (not an average over the N pipelines, so it is noisier for larger N); ``val_loss`` is the
reference model W_ref (for AvgPipe) evaluated by pipeline 0. By default Lightning would shard the
validation loader over the N pipelines (a DistributedSampler over the replicas), so pipeline 0
would validate on every N-th sample only; this script passes ``+trainer.use_distributed_sampler=false``
(the training data is sharded by the data module's own sampler, not by Lightning, so training is
unchanged) and sets ``trainer.limit_val_batches`` to ``--val-samples`` / (per-pipeline batch), so every
run validates on the same first ``--val-samples`` (320) validation windows.

After the runs, the final model of each (``checkpoints/last.ckpt``: the reference for AvgPipe) is
also evaluated in this process on the whole validation split (``--no-full-val`` skips it).

The figure (``docs/img/avgpipe_convergence.png``) shows train loss (moving average over ``--smooth``
steps) and validation loss against samples seen (steps x 16); the table gives each validation loss
and its difference relative to 1F1B.

    python benchmarks/bench_avgpipe_convergence.py                    # default steps, see --help
    python benchmarks/bench_avgpipe_convergence.py --steps 20 --val-every 10 --out /tmp/avg.png
    python benchmarks/bench_avgpipe_convergence.py --runs 1f1b avg2
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date

TOTAL_BATCH = 16
# name -> (pipelines N, Hydra overrides); every run: total batch 16 per step.
RUNS = {
    "1f1b": (1, ["recipe=gpt-tiny-cpu", "pipeline.microbatches=4"]),
    "avg1": (1, ["recipe=gpt-tiny-avgpipe", "pipeline.pipelines=1", "trainer.devices=2", "data.batch_size=16", "pipeline.microbatches=4"]),
    "avg2": (2, ["recipe=gpt-tiny-avgpipe", "pipeline.pipelines=2", "trainer.devices=4", "data.batch_size=8", "pipeline.microbatches=2"]),
    "avg4": (4, ["recipe=gpt-tiny-avgpipe", "pipeline.pipelines=4", "trainer.devices=8", "data.batch_size=4", "pipeline.microbatches=2"]),
}
COLORS = {"1f1b": "black", "avg1": "tab:blue", "avg2": "tab:orange", "avg4": "tab:red"}
LABELS = {
    "1f1b": "plain 1F1B (1 pipeline, batch 16)",
    "avg1": "AvgPipe N=1 (alpha=1, batch 16)",
    "avg2": "AvgPipe N=2 (alpha=1/2, 2 x batch 8)",
    "avg4": "AvgPipe N=4 (alpha=1/4, 4 x batch 4)",
}
TEARDOWN_FAILURES: list[tuple[str, int, str]] = []  # runs that finished training, then exited non-zero
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(name: str, steps: int, val_every: int, val_samples: int, run_dir: str, extra: list[str]) -> list[str]:
    pipelines, overrides = RUNS[name]
    per_pipeline = TOTAL_BATCH // pipelines
    if val_samples % per_pipeline:
        sys.exit(f"--val-samples {val_samples} is not a multiple of {name}'s per-pipeline batch {per_pipeline}")
    return [
        sys.executable,
        "-m",
        "lightning_pipe.train",
        *overrides,
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={val_every}",
        f"trainer.limit_val_batches={val_samples // per_pipeline}",
        "+trainer.use_distributed_sampler=false",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def train(name: str, cmd: list[str], run_dir: str, timeout: float) -> tuple[str, float]:
    """Run one configuration; returns the path of its metrics.csv and the wall time in seconds."""
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    log_path = run_dir + ".log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=tempfile.gettempdir())
        except subprocess.TimeoutExpired:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            sys.exit(f"[{name}] did not finish within {timeout:.0f} s (hung?); its output ({log_path}) ends with:\n{tail}")
    wall = time.perf_counter() - start
    with open(log_path) as log:
        text = log.read()
    found = glob.glob(os.path.join(run_dir, "logs", "version_*", "metrics.csv"))
    if done.returncode != 0:
        # Seen with AvgPipe: training finished (Lightning's "max_steps reached", the CLI's summary,
        # last.ckpt written), then a rank's heartbeat found rank 0's store closed while it was
        # still tearing down and SIGKILLed rank 0 ("rank 0 is gone or frozen"). The results are
        # complete, so they are used; the exit code is reported.
        finished = "`Trainer.fit` stopped: `max_steps=" in text and "[lightning-pipe]" in text
        if not (finished and len(found) == 1 and os.path.exists(os.path.join(run_dir, "checkpoints", "last.ckpt"))):
            sys.exit(f"[{name}] exited with code {done.returncode}; its output ({log_path}) ends with:\n{text[-3000:]}")
        errors = [line.strip() for line in text.splitlines() if line.startswith("error:")]
        print(
            f"[{name}] WARNING: exit code {done.returncode} after training finished ({errors[-1] if errors else 'no error line'}); results used",
            flush=True,
        )
        TEARDOWN_FAILURES.append((name, done.returncode, errors[-1] if errors else ""))
    if len(found) != 1:
        sys.exit(f"[{name}] expected one logs/version_*/metrics.csv in {run_dir}, found {found}")
    summary = [line.strip() for line in text.splitlines() if line.startswith("[lightning-pipe]")]
    print(f"[{name}] {wall:.0f} s; {summary[-1] if summary else '(no summary line)'}", flush=True)
    return found[0], wall


def read_metrics(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(steps completed, train_loss) and (steps completed, val_loss): Lightning's ``step`` column is
    the 0-based batch index, so the validation after 200 steps is logged under 199."""
    train_loss, val_loss = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"]) + 1
            if row.get("train_loss"):
                train_loss.append((step, float(row["train_loss"])))
            if row.get("val_loss"):
                val_loss.append((step, float(row["val_loss"])))
    return sorted(train_loss), sorted(val_loss)


def moving_average(points: list[tuple[int, float]], window: int) -> tuple[list[int], list[float]]:
    """Trailing mean over `window` consecutive logged values (the first window-1 points are dropped)."""
    steps = [s for s, _ in points]
    values = [v for _, v in points]
    if window <= 1 or len(values) < window:
        return steps, values
    out, total = [], sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return steps[window - 1 :], out


def full_validation(run_dir: str) -> tuple[float, int]:
    """Mean cross-entropy of the run's last.ckpt (AvgPipe: the reference model) over the whole
    validation split, on this one process; returns (loss, samples)."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    torch.set_num_threads(1)
    cfg = OmegaConf.load(os.path.join(run_dir, "config_resolved.yaml"))
    module = instantiate(cfg.model)
    state = torch.load(os.path.join(run_dir, "checkpoints", "last.ckpt"), map_location="cpu", weights_only=False)["state_dict"]
    module.load_state_dict(state)
    module.eval()
    data = instantiate(cfg.data)
    data.batch_size = 64
    data.setup("validate")
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            n = batch[0].shape[0]
            total += float(module._loss(batch)) * n
            count += n
    return total / count, count


def plot(curves: dict, smooth: int, steps: int, val_samples: int, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=False)
    for name, (train_loss, val_loss) in curves.items():
        x, y = moving_average(train_loss, smooth)
        style = {"ls": "--", "lw": 2.2, "zorder": 1} if name == "1f1b" else {"lw": 1.2, "zorder": 2}  # avg1 lies on it
        left.plot([s * TOTAL_BATCH for s in x], y, color=COLORS[name], alpha=0.85, label=LABELS[name], **style)
        right.plot(
            [s * TOTAL_BATCH for s, _ in val_loss],
            [v for _, v in val_loss],
            color=COLORS[name],
            marker="o",
            ms=7 if name == "1f1b" else 4,
            label=LABELS[name],
            **style,
        )
    left.set_title(f"train loss (pipeline 0's own batch; moving avg over {smooth} steps)", fontsize=10)
    right.set_title(f"validation loss (reference model; same {val_samples} val samples)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel(f"samples seen (steps x {TOTAL_BATCH})")
        ax.set_ylabel("cross-entropy (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"GPT-tiny, 2 stages, CPU: AvgPipe N = 1, 2, 4 vs plain 1F1B, total batch {TOTAL_BATCH}/step, {steps} steps", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps per run (default 800)")
    parser.add_argument("--val-every", type=int, default=100, help="trainer.val_check_interval (default 100)")
    parser.add_argument("--val-samples", type=int, default=320, help="validation windows per validation, same for all runs (320)")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window of the train loss (default 20)")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs (default all; 1f1b is the baseline)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "img", "avgpipe_convergence.png"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take before it counts as hung")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folders (printed)")
    parser.add_argument("--no-full-val", action="store_true", help="skip evaluating each final model on the whole val split")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for every run (repeatable)")
    parser.add_argument("--reuse", help="analyse the run folders kept by an earlier --keep (no training; --steps as then)")
    args = parser.parse_args()
    from lightning_pipe.bench.launch import machine_description

    print(f"AvgPipe convergence, {date.today()}, {machine_description()}", flush=True)
    folder = args.reuse or tempfile.mkdtemp(prefix="bench_avgpipe_convergence_")
    curves, walls, full = {}, {}, {}
    try:
        for name in args.runs:
            run_dir = os.path.join(folder, name)
            cmd = command(name, args.steps, args.val_every, args.val_samples, run_dir, args.override)
            if args.reuse:  # the runs of an earlier --keep: only the analysis
                metrics, walls[name] = glob.glob(os.path.join(run_dir, "logs", "version_*", "metrics.csv"))[0], math.nan
            else:
                metrics, walls[name] = train(name, cmd, run_dir, args.timeout)
            curves[name] = read_metrics(metrics)
        plot(curves, args.smooth, args.steps, args.val_samples, args.out)
        if not args.no_full_val:
            for name in args.runs:
                full[name] = full_validation(os.path.join(folder, name))
    finally:
        if args.keep or args.reuse:
            print(f"run folders kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"figure: {args.out}")

    names = list(curves)
    base = "1f1b" if "1f1b" in curves else None
    val = {name: dict(curves[name][1]) for name in names}
    print(f"\nval_loss (same {args.val_samples} val windows) by step; in brackets: relative to 1f1b")
    print(f"{'step':>6} {'samples':>8} " + " ".join(f"{n:>18}" for n in names))
    for step in sorted(set().union(*(set(v) for v in val.values()))):
        cells = []
        for n in names:
            v = val[n].get(step, math.nan)
            rel = v / val[base].get(step, math.nan) - 1 if base else math.nan
            cells.append(f"{v:>8.4f} ({rel:+7.2%})" if base and n != base else f"{v:>18.4f}")
        print(f"{step:>6} {step * TOTAL_BATCH:>8} " + " ".join(cells))
    if full:
        samples = next(iter(full.values()))[1]
        cells = []
        for n in names:
            v = full[n][0]
            cells.append(f"{v:>8.4f} ({v / full[base][0] - 1:+7.2%})" if base and n != base else f"{v:>18.4f}")
        print(f"{'final, whole val split (' + str(samples) + ' windows)':>15} " + " ".join(cells))
    print()
    for name in names:
        last = [v for _, v in curves[name][0][-args.smooth :]]
        print(f"{name}: mean train_loss (pipeline 0) over the last {len(last)} steps {sum(last) / len(last):.4f}, wall {walls[name]:.0f} s")
    for name, code, line in TEARDOWN_FAILURES:
        print(f"note: {name} exited with code {code} after training had finished: {line}")


if __name__ == "__main__":
    main()
