"""One ``Trainer.fit`` on 2 CPU processes (forked by the strategy), timed by a Callback on every rank:
rank r pinned to core r, each step's end stamped, the foreign load over the setup and over the timed
steps; repeated while other processes disturbed it (bench_pick.py); a stage of a
SequentialPipeline (`stage_pipeline`); Lightning's logs and warnings quieted (`quiet_lightning`)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .bench import pin_to_core
from .launch import busy_seconds, own_seconds, wait_for_quiet


def step_clock(out: Path, warmup: int):
    from lightning.pytorch.callbacks import Callback

    class StepClock(Callback):
        """Pins the rank (before the strategy's setup profiles); stamps every step's end, and the rank's
        CPU seconds and the machine's busy seconds at setup, train start, the warm-up's end and the end."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.marks: dict[str, Any] = {}

        def _mark(self, key: str, t: float | None = None) -> None:
            self.marks[key] = (time.perf_counter() if t is None else t, own_seconds(), busy_seconds())

        def setup(self, trainer, pl_module, stage):
            pin_to_core(trainer.global_rank % (os.cpu_count() or 1))
            self._mark("setup")

        def on_train_start(self, trainer, pl_module):  # after the strategy's setup (profile, messages, plan)
            self._mark("ready")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())
            if len(self.ends) == warmup:
                self._mark("start", self.ends[-1])

        def on_train_end(self, trainer, pl_module):
            self._mark("end", self.ends[-1])
            record = {"ends": self.ends, "marks": self.marks, "threads": torch.get_num_threads()}
            (out / f"clock.rank{trainer.global_rank}.json").write_text(json.dumps(record))

    return StepClock()


def _foreign(ranks: list[dict], first: str, last: str) -> float:
    """CPUs' worth of other processes' work between two marks: the machine's busy time less both ranks' own."""
    (t0, _, busy0), (t1, _, busy1) = ranks[0]["marks"][first], ranks[0]["marks"][last]
    if busy0 is None or busy1 is None:
        return 0.0
    own = sum(r["marks"][last][1] - r["marks"][first][1] for r in ranks)
    return max(0.0, (busy1 - busy0) - own) / max(t1 - t0, 1e-9)


def fit_timed(module: Any, data: dict, strategy: Any, warmup: int, steps: int, out: Path, **trainer: Any) -> dict:
    """``Trainer(devices=2, strategy=...).fit(module, **data)`` for warmup + steps steps in a fresh
    ``out``; rank 0's step periods after the warm-up, the foreign load (timed steps; setup)."""
    import lightning as L

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    options = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    options.update(enable_model_summary=False, default_root_dir=str(out), **trainer)
    started = time.perf_counter()
    L.Trainer(strategy=strategy, max_steps=warmup + steps, callbacks=[step_clock(out, warmup)], **options).fit(module, **data)
    wall = time.perf_counter() - started
    ranks = [json.loads((out / f"clock.rank{r}.json").read_text()) for r in range(2)]
    ends = ranks[0]["ends"][warmup - 1 :]
    periods = [b - a for a, b in zip(ends, ends[1:])]
    return {
        "step_ms": statistics.median(periods) * 1e3,
        "periods_ms": [round(p * 1e3, 3) for p in periods],
        "foreign_cpus": _foreign(ranks, "start", "end"),
        "setup_foreign_cpus": _foreign(ranks, "setup", "ready"),
        "threads": [r["threads"] for r in ranks],
        "wall_s": wall,
        "dir": str(out),
    }


def undisturbed(fit: Callable[[int], dict], args: Any, patient: bool, setup_counts: bool = False, log: Callable = print) -> dict:
    """``fit(attempt)`` after waiting for a quiet machine, repeated (at most ``args.retries`` times)
    while other processes used more than ``args.max_foreign`` CPUs (``setup_counts``: over the
    setup too); the least disturbed attempt, with every attempt's load as ``foreign_tries``."""
    tries: list[dict] = []
    for attempt in range(args.retries + 1):
        if patient:
            wait_for_quiet(args.quiet_wait, args.max_foreign, log=log)
        result = fit(attempt)
        result["disturbance"] = max(result["foreign_cpus"], result["setup_foreign_cpus"] if setup_counts else 0.0)
        tries.append(result)
        if result["disturbance"] <= args.max_foreign or not patient:
            break
        log(f"    disturbed ({result['disturbance']:.2f} CPUs of other work)" + ("; again" if attempt < args.retries else ""))
    best = min(tries, key=lambda r: r["disturbance"])
    best["foreign_tries"] = [round(r["disturbance"], 2) for r in tries]
    return best


def stage_pipeline(model: Any, bounds: Any, rank: int, world: int, microbatches: int, loss: Callable, schedule: str = "1f1b"):
    """This rank's stage of ``model`` (an ``nn.Sequential``) cut at ``bounds``, its blocks keyed as in
    the whole model, and a SequentialPipeline over gloo running it (bench_simulator.py
    with and without --speedup, bench_runtime.py)."""
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import build_schedule

    a, b = bounds[rank]
    chunk = model[a:b]
    host = SequentialHost({rank: chunk}, world - 1, loss)
    return chunk, SequentialPipeline(build_schedule(schedule, world, microbatches), rank, host, Transport(lambda r: r, torch.device("cpu")))


def quiet_lightning() -> None:
    """Lightning's advice (num_workers, log sync) and info lines off: not what a benchmark measures."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_pipe"):
        logging.getLogger(name).setLevel(logging.WARNING)


def quiet_distributed(bench: Any, job: Callable, world: int, args: Any) -> list:
    """``run_distributed(job, world, args)`` once other benchmark jobs have stopped (waited for within the bench's budget)."""
    from .launch import OTHER_JOBS, run_distributed

    if bench.patient:
        wait_for_quiet(args.quiet_wait, args.max_foreign, poll=20.0, patterns=OTHER_JOBS, log=bench.log)
    return run_distributed(job, world, args, timeout=args.timeout, group_timeout=3600.0)
