"""Training runs through the CLI (``python -m lightning_pipe.train``): their logged losses (what
bench_convergence.py's experiments share) and one command run on a quiet machine with its process
tree's CPU accounted (`run_command`: bench_tuner.py, bench_advance.py)."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import child_env
from .launch import CpuClock, foreign_load, own_seconds, proc_stat, wait_for_quiet
from .rss import tree

Points = list[tuple[int, float]]


def cli_command(overrides: list[str], steps: int, val_every: int, run_dir: str, extra: list[str] = ()) -> list[str]:
    """The CLI with ``overrides``, ``steps`` optimizer steps, validation every ``val_every``, a loss
    logged every step, into ``run_dir``."""
    return [
        *(sys.executable, "-m", "lightning_pipe.train", *overrides),
        *(f"trainer.max_steps={steps}", f"trainer.val_check_interval={val_every}", "trainer.log_every_n_steps=1"),
        *("trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}", *extra),
    ]


def train(name: str, cmd: list[str], run_dir: str, timeout: float) -> tuple[str, float, str]:
    """Run one configuration; its metrics.csv, wall seconds, and "" or the error line of a run that
    exited non-zero after training had finished (seen with AvgPipe: a rank's heartbeat killing rank 0
    while it tore down; the results are complete and used)."""
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    log_path = run_dir + ".log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=tempfile.gettempdir(), env=child_env())
        except subprocess.TimeoutExpired:
            sys.exit(f"[{name}] did not finish within {timeout:.0f} s (hung?); its output: {log_path}")
    wall = time.perf_counter() - start
    text = open(log_path).read()
    found = glob.glob(os.path.join(run_dir, "logs", "version_*", "metrics.csv"))
    note = ""
    if done.returncode != 0:
        finished = "`Trainer.fit` stopped: `max_steps=" in text and os.path.exists(os.path.join(run_dir, "checkpoints", "last.ckpt"))
        if not (finished and len(found) == 1):
            sys.exit(f"[{name}] exited with code {done.returncode}; its output ({log_path}) ends with:\n{text[-3000:]}")
        errors = [line.strip() for line in text.splitlines() if line.startswith("error:")]
        note = f"exit code {done.returncode} after training finished: {errors[-1] if errors else 'no error line'}"
        print(f"[{name}] WARNING: {note}; results used", flush=True)
    if len(found) != 1:
        sys.exit(f"[{name}] expected one logs/version_*/metrics.csv in {run_dir}, found {found}")
    summary = [line.strip() for line in text.splitlines() if line.startswith("[lightning-pipe]")]
    print(f"[{name}] {wall:.0f} s; {summary[-1] if summary else '(no summary line)'}", flush=True)
    return found[0], wall, note


def read_columns(path: str, *keys: str) -> list[Points]:
    """(steps completed, value) of each column in `keys`, where logged: Lightning's ``step`` column is
    the 0-based batch index, so the validation after 300 steps is logged under 299."""
    out: list[Points] = [[] for _ in keys]
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"]) + 1
            for points, key in zip(out, keys):
                if row.get(key):
                    points.append((step, float(row[key])))
    return [sorted(points) for points in out]


def read_metrics(path: str) -> tuple[Points, Points]:
    """(steps completed, train_loss) and (steps completed, val_loss)."""
    train_loss, val_loss = read_columns(path, "train_loss", "val_loss")
    return train_loss, val_loss


def moving_average(points: Points, window: int) -> tuple[list[int], list[float]]:
    """Trailing mean over ``window`` consecutive logged values (the first window-1 points dropped)."""
    steps, values = [s for s, _ in points], [v for _, v in points]
    if window <= 1 or len(values) < window:
        return steps, values
    means = [sum(values[i - window + 1 : i + 1]) / window for i in range(window - 1, len(values))]
    return steps[window - 1 :], means


def add_options(parser, val_every: int, smooth: int, out: str) -> None:
    """The options of the convergence runs."""
    parser.add_argument("--val-every", type=int, default=val_every, help="trainer.val_check_interval")
    parser.add_argument("--smooth", type=int, default=smooth, help="moving-average window of the train loss")
    parser.add_argument("--out", default=out, help="the figure")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folders (printed)")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for every run (repeatable)")


def say_tails(bench, curves: dict, walls: dict, smooth: int, whose: str = "") -> None:
    """Each run's mean train loss over its last ``smooth`` logged steps, and its wall time."""
    for name, (train_loss, _) in curves.items():
        last = [v for _, v in train_loss[-smooth:]]
        bench.say(f"{name}: mean train_loss{whose} over the last {len(last)} steps {sum(last) / len(last):.4f}, wall {walls[name]:.0f} s")


def instantiate_run(config_path: str, seed: bool = False):
    """A CLI run's config_resolved.yaml, and its model and data module built as the CLI builds them
    (``seed``: after seeding everything with the config's seed), in this process (1 thread)."""
    import lightning as L
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    torch.set_num_threads(1)
    cfg = OmegaConf.load(config_path)
    if seed:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    return cfg, instantiate(cfg.model), instantiate(cfg.data)


def train_runs(runs: dict[str, list[str]], args, folder: str, reuse: bool = False) -> tuple[dict, dict, list[str]]:
    """Every run (name -> its overrides; then ``args.override``) through the CLI into folder/name, or
    with ``reuse`` the metrics an earlier run left there: the curves, wall seconds and notes by name."""
    curves, walls, notes = {}, {}, []
    for name, overrides in runs.items():
        run_dir = os.path.join(folder, name)
        if reuse:
            metrics, walls[name], note = glob.glob(os.path.join(run_dir, "logs", "version_*", "metrics.csv"))[0], float("nan"), ""
        else:
            cmd = cli_command(overrides, args.steps, args.val_every, run_dir, args.override)
            metrics, walls[name], note = train(name, cmd, run_dir, args.timeout)
        notes += [f"{name}: {note}"] if note else []
        curves[name] = read_metrics(metrics)
    return curves, walls, notes


@contextlib.contextmanager
def run_folder(prefix: str, keep: bool, reuse: str | None = None) -> Iterator[str]:
    """A temporary folder for the runs (``reuse``: that one), removed at the end unless ``keep`` or ``reuse``."""
    folder = reuse or tempfile.mkdtemp(prefix=prefix)
    try:
        yield folder
    finally:
        if not (keep or reuse):
            shutil.rmtree(folder, ignore_errors=True)


def run_command(
    cmd: list[str],
    folder: Path,
    timeout: float,
    label: str = "command",
    retries: int = 0,
    max_foreign: float = 0.1,
    quiet_wait: float = 0.0,
    patient: bool = True,
    lock: str | None = None,
    env: dict | None = None,
    check: bool = True,
    poll: float = 2.0,
    patterns: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``cmd`` in a fresh ``folder`` (its working directory; the output in folder/command.log) after
    waiting for a quiet machine (`wait_for_quiet`), holding ``lock`` (a file, locked as `flock` does)
    if given; killed after ``timeout`` s; repeated (at most ``retries`` times) while other processes
    used more than ``max_foreign`` CPUs, as `run_undisturbed`. The process tree's CPU is polled
    (Lightning's workers are not always waited for, so getrusage alone can miss them). ``check``: a
    non-zero exit raises with its last ``error:`` line. Returns the last attempt's wall, foreign load,
    CPU seconds, returncode and output, and every attempt's figures."""
    attempts = []
    for _ in range(retries + 1):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        with open(lock or os.devnull, "a") as held, open(folder / "command.log", "w") as out:
            if lock:
                fcntl.flock(held, fcntl.LOCK_EX)  # released when closed
            if patient:
                wait_for_quiet(quiet_wait, max_foreign, poll=poll, patterns=patterns, log=log)
            out.write(" ".join(cmd) + "\n\n")
            out.flush()
            start, mine, t0, seen = CpuClock.now(children=True), own_seconds(), time.perf_counter(), {}
            proc = subprocess.Popen(cmd, cwd=folder, env=child_env(env), stdout=out, stderr=subprocess.STDOUT)
            try:  # the tree's CPU every 0.2 s, keyed by (pid, start time), until it exits
                while proc.poll() is None and time.perf_counter() - t0 < timeout:
                    tree_cpu = {(pid, st[1]): st[2] for pid in tree(proc.pid) if (st := proc_stat(pid)) is not None}
                    seen |= {key: max(cpu, seen.get(key, 0.0)) for key, cpu in tree_cpu.items()}
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=0.2)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            wall, end = time.perf_counter() - t0, CpuClock.now(children=True)
        output = (folder / "command.log").read_text()
        if check and proc.returncode != 0:
            said = [line for line in output.splitlines() if line.startswith("error:")] or output.splitlines() or ["?"]
            raise RuntimeError(f"{label}: exit code {proc.returncode}: {said[-1]} (log: {folder})")
        own = max(end.own - start.own, sum(seen.values()) + own_seconds() - mine)
        attempts.append({"wall": wall, "foreign": foreign_load(start, end, own=own), "cpu": own})
        if attempts[-1]["foreign"] <= max_foreign or not patient:
            break
        log(f"  {label} disturbed: other processes used {attempts[-1]['foreign']:.2f} CPUs")
    return {**attempts[-1], "attempts": attempts, "returncode": proc.returncode, "output": output}
