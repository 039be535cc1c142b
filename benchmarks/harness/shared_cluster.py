"""The emulated shared cluster of bench_adaptive.py (one job; --changing): 2 pinned gloo
processes training a GPT-tiny-like CausalLM through the Trainer while competing CPU-bound jobs come
and go on a core (`SharedCluster`), one run of it (`run`), and its throughput (`samples_per_s`)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.models import CausalLM, ModelConfig

from .bench import pin_to_core, pyplot, save_figure
from .injected_load import busy_job

CFG = dict(vocab_size=260, n_layer=4, n_head=4, d_model=128, max_seq_len=64)
BATCH, SEQ, M = 16, 64, 4


class SharedCluster(Callback):
    """Pins the ranks, starts / stops the competing jobs (rank 0 owns them; `jobs`: (start, stop, core)
    iterations), records rank 0's iteration times and partitions, applies a scripted partition plan
    {iteration: bounds}."""

    def __init__(self, jobs: list, plan: dict, out: str):
        self.jobs, self.plan, self.out = jobs, plan, out
        self.procs: dict = {}
        self.times, self.bounds, self.last = [], [], None
        self.slowdown, self.predicted = [], []  # the adaptive run's monitor: per-rank factors, scorer's time of the current partition

    def setup(self, trainer, pl_module, stage):
        pin_to_core(trainer.global_rank % os.cpu_count())

    def _job(self, k: int, on: bool) -> None:
        if on and k not in self.procs:
            self.procs[k] = busy_job(self.jobs[k][2])
        elif not on and k in self.procs:
            proc = self.procs.pop(k)
            proc.kill()
            proc.wait()

    def _stop_all(self) -> None:
        for k in list(self.procs):
            self._job(k, False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        i = trainer.fit_loop.total_batch_idx
        for k, (start, stop, _) in enumerate(self.jobs):
            if trainer.global_rank == 0 and i == start:
                self._job(k, True)
            if trainer.global_rank == 0 and i == stop:
                self._job(k, False)
        if i in self.plan:
            trainer.strategy.repartition(self.plan[i])
        if self.last is None:
            self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now
        self.bounds.append([list(b) for b in trainer.strategy.cut.bounds])
        adaptive = trainer.strategy.adaptive
        latest = adaptive.monitor.latest if adaptive is not None and adaptive.monitor is not None else None
        if latest is not None and latest.microbatches == M:
            window = list(adaptive.monitor.history) or [latest]
            schedule = trainer.strategy.layers.runner.executor("train", M).schedule
            self.slowdown.append(list(latest.slowdown(adaptive.monitor.static)))
            self.predicted.append(adaptive.scorer(window, schedule, latest.bounds))
        else:
            self.slowdown.append(None)
            self.predicted.append(None)

    def on_train_end(self, trainer, pl_module):
        self._stop_all()
        if trainer.global_rank != 0:
            return
        adaptive = trainer.strategy.adaptive
        report = {
            "times": self.times,
            "bounds": self.bounds,
            "slowdown": self.slowdown,
            "predicted": self.predicted,
            "switches": [],
            "monitor_s": None,
            "decision_s": None,
        }
        if adaptive is not None:
            report["switches"] = [
                {"iteration": s.iteration, "old": s.old, "new": s.new, "gain": s.predicted_gain, "seconds": s.seconds}
                for s in adaptive.switches
            ]
            report["evaluations"] = adaptive.evaluations
            report["decision_total_s"] = adaptive.decision_seconds
            if adaptive.decider is not None:
                report["adapted_steps"] = adaptive.decider.online_steps
                report["rewards"] = getattr(adaptive.decider, "rewards", None)  # adaptive=paper: the arbiter's measured rewards
            if adaptive.monitor is not None:
                report["monitor_s"] = adaptive.monitor.seconds / max(1, adaptive.monitor.iterations)
                report["decision_s"] = adaptive.decision_seconds / max(1, adaptive.monitor.iterations)
        Path(self.out).write_text(json.dumps(report))

    def on_exception(self, trainer, pl_module, exception):
        self._stop_all()


def data(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (steps * BATCH, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=BATCH)


def run(name: str, args, plan: dict, adaptive, partition, jobs=None) -> dict:
    torch.manual_seed(0)
    model = CausalLM(model=ModelConfig(**CFG), lr=1e-3, warmup_steps=10, max_steps=args.steps)
    out = Path(args.work) / f"{name}.json"
    callback = SharedCluster(jobs if jobs is not None else [(args.start, args.stop, 1)], plan, str(out))
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=M, partition=partition, adaptive=adaptive, start_method="spawn")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(Path(args.work) / name),
    )
    started = time.perf_counter()
    trainer.fit(model, data(args.steps))
    report = json.loads(out.read_text())
    report["wall_s"] = time.perf_counter() - started
    print(f"{name}: {report['wall_s']:.0f} s, switches {[(s['iteration'], s['new']) for s in report['switches']]}", flush=True)
    return report


def samples_per_s(times: list[float], lo: int, hi: int) -> float:
    return BATCH * (hi - lo) / sum(times[lo:hi])


def rolling_samples_per_s(times: list[float], k: int = 5) -> list[float]:
    """Samples/s over the last k iterations (fewer at the start), for the pictures."""
    return [BATCH * len(times[max(0, i - k + 1) : i + 1]) / sum(times[max(0, i - k + 1) : i + 1]) for i in range(len(times))]


def dwell_medians(times: list[float], first: int, dwell: int, cuts: list[int], settle: int = 3) -> dict[int, float]:
    """A sweep's median iteration per cut: cut k ran from ``first + k * dwell`` for ``dwell``
    iterations, of which the first ``settle`` are skipped."""
    return {x: statistics.median(times[first + k * dwell + settle : first + (k + 1) * dwell]) for k, x in enumerate(cuts)}


def plot_runs(results: dict, widths: dict[str, float], spans: list[tuple[int, int, str]], title: str, xlabel: str, path: Path) -> None:
    """Samples/s (5-iteration mean) and blocks on rank 0 over the iterations of the runs ``widths``
    names (drawn with those line widths, over each other where equal); ``spans``: shaded
    (first, end, colour) iterations."""
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, width in widths.items():
        times = results[name]["times"]
        top.plot(range(len(times)), rolling_samples_per_s(times), label=name, linewidth=1.2)
        bottom.plot(range(len(times)), [b[0][1] for b in results[name]["bounds"]], label=name, drawstyle="steps-post", linewidth=width)
    for ax in (top, bottom):
        for lo, hi, colour in spans:
            ax.axvspan(lo, hi, color=colour)
    top.set_ylabel("samples/s (5-iteration mean)")
    bottom.set_ylabel("blocks on rank 0 (of 10)")
    bottom.set_xlabel(xlabel)
    top.legend(loc="lower left", fontsize=8, ncol=len(widths))
    top.set_title(title)
    fig.tight_layout()
    save_figure(fig, path)


def add_options(parser, work: str, **iterations: int) -> None:
    """The options of both experiments: their iteration counts (``steps=300, dwell=12, ...``), the work
    folder, the pictures' folder and the raw results' file."""
    for name, default in iterations.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--work", default=work)
    parser.add_argument("--out", default=None, help="folder for the pictures")
    parser.add_argument("--save", default=None, help="write every run's iteration times, partitions (and evaluations) here")
    parser.add_argument("--load", default=None, help="skip the runs: analyse a --save file")


def results_of(args, measure) -> dict:
    """``measure(args)``'s results (written to ``--save``), or those ``--load`` names."""
    if args.load:
        return json.loads(Path(args.load).read_text())
    Path(args.work).mkdir(parents=True, exist_ok=True)
    results = measure(args)
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1))
    return results
