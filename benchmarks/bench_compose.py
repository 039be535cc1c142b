"""AvgPipe(2BW) + advance vs AvgPipe(1F1B) vs 2BW vs 1F1B, through the Trainer (issue 28).

``emulated``: K = 4 stages, N = 2 pipelines (the paper's setting, §7), EMULATED devices: each block
sleeps for its time, and the N processes of a stage position share one device (a lock held while a
block runs: one at a time, as kernels of several processes on one GPU). The real runtime (p2p,
schedules, 2BW's versions, elastic averaging with its reference processes, Lightning) runs around
them. ``real``: 2 processes x 1 thread, the residual MLP: 1F1B and 2BW over 2 stages, AvgPipe N = 2
of one stage each. Every pipeline takes the same batch (AvgPipe: N x the samples per step).
Predicted: the simulator's step of one pipeline (2BW: a steady step) on the blocks' times (real:
profiled here, one process, compute only); N pipelines sharing devices (ours): the larger of that
and N x a device's busy time, i.e. the bubbles filled at best. Results: docs/results/benchmarks_avgpipe.md.

    python -m benchmarks.bench_compose emulated --rounds 3
    python -m benchmarks.bench_compose real --rounds 3
    python -m benchmarks.bench_compose emulated --quick     # smoke: 1 round, 2 steps
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness.bench import Bench, Table, interleave, spread
from benchmarks.harness.emulated import emulated_model, share_device
from benchmarks.harness.mlp import loss_fn, make_model
from benchmarks.harness.trainer_runs import fit_timed, quiet_lightning
from lightning_pipe import AutoPipeStrategy
from lightning_pipe.profiling.blocks import profile_blocks
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.two_bw import pipedream_2bw
from lightning_pipe.simulation import CostModel, simulate

EMULATED = dict(stages=4, blocks=8, forward_s=0.004, backward_s=0.008, microbatches=8, rows=2)
REAL = dict(stages=2, hidden=256, mlp_ratio=4, blocks=8, microbatches=4, rows=16, lr=0.01)
# name: (strategy settings, pipelines N); AvgPipe(2BW)'s advance_num is K: one forward more than 2BW's 1F1B lead
MODES = {
    "1F1B": (dict(schedule="1f1b"), 1),
    "2BW": (dict(schedule="2bw"), 1),
    "AvgPipe(1F1B)": (dict(schedule="1f1b"), 2),
    "AvgPipe(2BW)+advance": (dict(schedule="2bw", advance="K"), 2),
}


class Module(L.LightningModule):
    """The blocks with an MSE loss and SGD; `devices`: the lock files of the emulated devices, one
    per stage position (None: real compute)."""

    def __init__(self, seq: torch.nn.Sequential, stages: int, devices: str | None):
        super().__init__()
        self.seq, self.stages, self.devices = seq, stages, devices

    def setup(self, stage: str) -> None:
        if self.devices is not None:
            share_device(os.path.join(self.devices, f"device{self.trainer.global_rank % self.stages}"))

    def training_step(self, batch, batch_idx):
        return loss_fn(self.seq(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def steady(schedule: str, stages: int, m: int, costs: CostModel, bounds: list, advance: int = 0) -> float:
    """The simulator's seconds per step of one pipeline (2BW: one steady step of the unrolled run)."""
    if schedule != "2bw":
        return simulate(build_schedule(schedule, stages, m), costs, bounds).iteration_time
    run = lambda b: simulate(pipedream_2bw(stages, m, batches=b, advance_num=advance), costs, bounds).iteration_time  # noqa: E731
    return run(6) - run(5)


def main() -> None:
    bench = Bench(__doc__, rounds=3, steps=12, warmup=4, quick={"steps": 2, "warmup": 2}, threads=1)
    bench.parser.add_argument("part", choices=["emulated", "real"])
    args = bench.parse()
    quiet_lightning()
    cfg = EMULATED if args.part == "emulated" else REAL
    k, m = cfg["stages"], cfg["microbatches"]
    batch = m * cfg["rows"]
    if args.part == "emulated":
        seq = lambda: emulated_model(cfg["blocks"], 8, cfg["forward_s"], cfg["backward_s"])  # noqa: E731
        costs = CostModel.uniform(cfg["blocks"], cfg["forward_s"], cfg["backward_s"])
        width, dtype = 8, torch.float64
    else:
        seq = lambda: make_model(cfg)  # noqa: E731
        sample = torch.randn(cfg["rows"], cfg["hidden"])
        times = profile_blocks(list(seq()), sample, torch.device("cpu"), repeats=5)
        costs = CostModel(tuple(t["forward"] for t in times.values()), tuple(t["backward"] for t in times.values()))
        width, dtype = cfg["hidden"], torch.float32
    devices = tempfile.mkdtemp(prefix="bench_compose_") if args.part == "emulated" else None
    rows = (args.warmup + args.steps + 2) * batch * 2
    data = TensorDataset(torch.randn(rows, width, dtype=dtype), torch.randn(rows, width, dtype=dtype))

    def run(name: str, r: int) -> dict:
        settings, n = MODES[name]
        depth = k if n == 1 or args.part == "emulated" else 1  # real: N pipelines of one stage on the 2 processes
        settings = dict(settings)
        if settings.pop("advance", None):
            settings["advance_num"] = depth if depth > 1 else 1
        strategy = AutoPipeStrategy(microbatches=m, partition="uniform", start_method="fork", pipelines=n if n > 1 else None, **settings)
        module = Module(seq(), depth, devices)
        out = Path(tempfile.mkdtemp(prefix="bench_compose_run_"))
        timed = fit_timed(
            module, {"train_dataloaders": DataLoader(data, batch_size=batch)}, strategy, args.warmup, args.steps, out, devices=depth
        )
        return {"samples_per_s": n * batch * 1e3 / timed["step_ms"], "depth": depth, "n": n, "advance": settings.get("advance_num", 0)}

    names = list(MODES)
    results = interleave(names, args.rounds, run)
    table = Table("mode", "processes", "samples/s measured (min..max)", "predicted", "measured / predicted", "vs 1F1B")
    base = statistics.median(x["samples_per_s"] for x in results[0])
    for name, runs in zip(names, results):
        settings, n = MODES[name]
        depth, advance = runs[0]["depth"], runs[0]["advance"]
        bounds = [(i * cfg["blocks"] // depth, (i + 1) * cfg["blocks"] // depth) for i in range(depth)]
        one = steady(settings["schedule"], depth, m, costs, bounds, advance)
        busy = m * max(sum(costs.forward[a:b]) + sum(costs.backward[a:b]) for a, b in bounds)
        shared = n > 1 and args.part == "emulated"
        predicted = n * batch / (max(one, n * busy) if shared else one)
        measured = spread(x["samples_per_s"] for x in runs)
        table.add(
            name,
            n * depth,
            measured.fmt(digits=0),
            f"{predicted:.0f}",
            f"{measured.median / predicted:.2f}",
            f"{measured.median / base:.2f}",
        )
    what = "EMULATED devices (the N pipelines of a stage position share one)" if args.part == "emulated" else "2 real processes x 1 thread"
    bench.table(table, f"## {args.part}: K = {k}, M = {m}, {batch} samples per pipeline and step, {what}")
    bench.keep("results", dict(zip(names, results)))
    bench.finish()


if __name__ == "__main__":
    sys.exit(main())
