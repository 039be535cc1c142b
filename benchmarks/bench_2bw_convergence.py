"""Statistical efficiency of PipeDream-2BW against 1F1B (PipeDream-Flush) on GPT-tiny.

Trains GPT-tiny on 2 CPU processes twice, on the same data and seed, with the same number of
micro-batches per step, so that only the update rule differs:

- ``2bw``:  ``recipe=gpt-tiny-2bw`` (m = 2, 1-stale updates W(t+1) = W(t) - lr * grad f(W(t-1)));
- ``1f1b``: ``recipe=gpt-tiny-cpu pipeline.schedule=1f1b pipeline.microbatches=2`` (synchronous).

Each run goes through the CLI (``python -m lightning_pipe.train``, which starts its own processes)
with ``hydra.run.dir`` set to a fresh temporary folder, validates every ``--val-every`` steps
(``limit_val_batches`` stays as the recipe sets it) and logs ``train_loss`` every step. The script
then reads both runs' ``logs/version_0/metrics.csv``, draws the train-loss curves (moving average
over ``--smooth`` steps) and the val-loss curves into one figure, and prints the final validation
losses and their relative difference, against the criterion: 2BW's validation loss after the
last step within ``--tolerance`` (3%) of 1F1B's.

With ``--reference`` it also trains the same model, data, optimizer, LR schedule and gradient
clipping in this one process, without a pipeline, under both rules written out directly
(synchronous: the gradient at W(t); 2BW: the gradient at W(max(t-1, 0)) applied to W(t)), and prints
their validation losses next to the pipelined runs': if the pipelined 2BW run matches the
one-process 2BW rule, a gap between 2BW and 1F1B comes from the rule, not from the pipeline.

    python benchmarks/bench_2bw_convergence.py                       # 300 steps each, ~5-6 minutes
    python benchmarks/bench_2bw_convergence.py --reference           # + the one-process rules, ~5 more
    python benchmarks/bench_2bw_convergence.py --steps 100 --out /tmp/loss.png
    python benchmarks/bench_2bw_convergence.py --override model.lr=3e-4 --out /tmp/loss.png
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

RUNS = {
    "2bw": ["recipe=gpt-tiny-2bw"],
    "1f1b": ["recipe=gpt-tiny-cpu", "pipeline.schedule=1f1b", "pipeline.microbatches=2"],
}
COLORS = {"2bw": "tab:red", "1f1b": "tab:blue"}
LABELS = {"2bw": "PipeDream-2BW (1-stale)", "1f1b": "1F1B / PipeDream-Flush"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(name: str, steps: int, val_every: int, run_dir: str, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lightning_pipe.train",
        *RUNS[name],
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={val_every}",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def train(name: str, steps: int, val_every: int, run_dir: str, timeout: float, extra: list[str]) -> tuple[str, float]:
    """Run one configuration; returns the path of its metrics.csv and the wall time in seconds."""
    cmd = command(name, steps, val_every, run_dir, extra)
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    log_path = run_dir + ".log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=tempfile.gettempdir())
        except subprocess.TimeoutExpired:
            sys.exit(f"[{name}] did not finish within {timeout:.0f} s (hung?); its output: {log_path}")
    wall = time.perf_counter() - start
    if done.returncode != 0:
        with open(log_path) as log:
            tail = log.read()[-3000:]
        sys.exit(f"[{name}] exited with code {done.returncode}; its output ({log_path}) ends with:\n{tail}")
    found = glob.glob(os.path.join(run_dir, "logs", "version_*", "metrics.csv"))
    if len(found) != 1:
        sys.exit(f"[{name}] expected one logs/version_*/metrics.csv in {run_dir}, found {found}")
    with open(log_path) as log:
        summary = [line.strip() for line in log if line.startswith("[lightning-pipe]")]
    print(f"[{name}] {wall:.0f} s; {summary[-1] if summary else '(no summary line)'}", flush=True)
    return found[0], wall


def read_metrics(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, train_loss) and (step, val_loss) pairs, with step = optimizer steps completed.

    Lightning's CSV ``step`` column is the 0-based batch index: ``train_loss`` of batch b (its
    loss before b's update) and the ``val_loss`` run after batch b are both logged under b, so
    ``b + 1`` is the number of batches trained on (the validation after 300 steps is logged at 299).
    """
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


def reference(config_path: str, stale: bool, val_every: int) -> list[tuple[int, float]]:
    """The update rule on one process, from a pipelined run's resolved config: (steps, val_loss) pairs.

    The CLI's own construction (seed, model, data module, ``configure_optimizers``) and Lightning's
    step (global-norm clipping at ``trainer.gradient_clip_val``, optimizer step, scheduler step), so
    the synchronous rule reproduces the 1F1B run up to float32 summation order. ``stale``: batch t's
    gradient is taken on a copy holding W(max(t-1, 0)) and applied to W(t).
    """
    import copy

    import lightning as L
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config_path)
    torch.set_num_threads(1)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = instantiate(cfg.model)
    data = instantiate(cfg.data)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    live = list(module.model.parameters())
    shadow = copy.deepcopy(module.model)  # holds W(t-1) for the stale rule
    previous = copy.deepcopy(module.model.state_dict())
    val_loader = data.val_dataloader()
    limit = cfg.trainer.limit_val_batches
    val_batches = limit if isinstance(limit, int) else max(1, int(limit * len(val_loader)))
    batches = iter(data.train_dataloader())
    out = []
    for step in range(cfg.trainer.max_steps):
        batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        if stale:
            shadow.load_state_dict(previous)
            shadow.zero_grad(set_to_none=True)
            ids, targets = batch
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


def plot(curves: dict, smooth: int, steps: int, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, (train_loss, val_loss) in curves.items():
        x, y = moving_average(train_loss, smooth)
        ax.plot(x, y, color=COLORS[name], lw=1.3, alpha=0.8, label=f"{LABELS[name]}: train (moving avg {smooth})")
        ax.plot(
            [s for s, _ in val_loss],
            [v for _, v in val_loss],
            color=COLORS[name],
            ls="--",
            marker="o",
            ms=4,
            label=f"{LABELS[name]}: val",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats / byte)")
    ax.set_title(f"GPT-tiny, 2 stages on 2 CPU processes, 2 micro-batches/step, {steps} steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--val-every", type=int, default=50, help="trainer.val_check_interval (default 50)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window of the train loss (default 10)")
    parser.add_argument("--tolerance", type=float, default=0.03, help="criterion on |val 2bw / val 1f1b - 1| (0.03)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "img", "2bw_vs_1f1b_loss.png"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take before it counts as hung")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folders (printed)")
    parser.add_argument("--reference", action="store_true", help="also run both rules on one process (see above)")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for both runs, e.g. model.lr=3e-4 (repeatable)")
    args = parser.parse_args()
    from lightning_pipe.bench.launch import machine_description

    print(f"2BW vs 1F1B convergence, {date.today()}, {machine_description()}", flush=True)
    folder = tempfile.mkdtemp(prefix="bench_2bw_convergence_")
    curves, walls = {}, {}
    try:
        for name in RUNS:
            metrics, walls[name] = train(name, args.steps, args.val_every, os.path.join(folder, name), args.timeout, args.override)
            curves[name] = read_metrics(metrics)
        plot(curves, args.smooth, args.steps, args.out)
        references = {}
        if args.reference:
            config = os.path.join(folder, "2bw", "config_resolved.yaml")
            for name, stale in (("1f1b", False), ("2bw", True)):
                start = time.perf_counter()
                references[name] = dict(reference(config, stale, args.val_every))
                print(f"[one-process {name} rule] {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        if args.keep:
            print(f"run folders kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"figure: {args.out}")

    print("\nval_loss by step (pipelined runs" + (", then the one-process rules)" if references else ")"))
    header = f"{'step':>6} {'2bw':>8} {'1f1b':>8}  2bw/1f1b - 1"
    if references:
        header += f"  {'rule 2bw':>9} {'rule sync':>9}  rule 2bw/sync - 1"
    print(header)
    val = {name: dict(v) for name, (_, v) in curves.items()}
    for step in sorted(set(val["2bw"]) | set(val["1f1b"])):
        a, b = val["2bw"].get(step, math.nan), val["1f1b"].get(step, math.nan)
        line = f"{step:>6} {a:>8.4f} {b:>8.4f}  {a / b - 1:+12.2%}"
        if references:
            c, d = references["2bw"].get(step, math.nan), references["1f1b"].get(step, math.nan)
            line += f"  {c:>9.4f} {d:>9.4f}  {c / d - 1:+17.2%}"
        print(line)
    for name, (train_loss, _) in curves.items():
        last = [v for _, v in train_loss[-args.smooth :]]
        print(f"{name}: mean train_loss over the last {len(last)} steps {sum(last) / len(last):.4f}, wall {walls[name]:.0f} s")

    final = {name: max(v)[1] if v else math.nan for name, v in ((n, c[1]) for n, c in curves.items())}
    final_steps = {name: max(c[1])[0] if c[1] else None for name, c in curves.items()}
    rel = final["2bw"] / final["1f1b"] - 1
    verdict = "PASS" if abs(rel) <= args.tolerance else "FAIL"
    print(
        f"\nfinal val_loss (step {final_steps['2bw']} / {final_steps['1f1b']}): 2bw {final['2bw']:.4f}, "
        f"1f1b {final['1f1b']:.4f}; relative difference (2bw - 1f1b) / 1f1b = {rel:+.2%}"
    )
    print(f"criterion |difference| <= {args.tolerance:.0%}: {verdict}")


if __name__ == "__main__":
    main()
