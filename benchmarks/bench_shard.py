"""Step time of pp2 x dp2 with whole replicas, ZeRO-1 and FSDP2 (pipeline.shard none | optimizer | full; full:step is
shard=full with reshard=step: a block's weights gathered once a step, not for every micro-batch), and of the same
4 processes as pp4 (`pp4`) or pp2 x tp2 (`tp2`: tensor=2), on the same global batch; `@2bw` after a setting runs
PipeDream-2BW instead of 1F1B (`full@2bw`: 2BW over FSDP2), `@auto` lets schedule="auto" choose (under shard=full
its candidates priced with FSDP2's gathers, measured at setup): the table then also gives the chosen schedule and
its simulated step (plan.json) beside the measured one.

GPT-tiny (lightning_pipe.models.CausalLM), fp32, 1F1B, 4 gloo processes x 1 thread through the Trainer,
synthetic tokens; each run trains `--warmup` untimed steps, then `--steps` timed ones (rank 0's wall time
per step, from the start of the first timed batch to the end of the last). The settings run interleaved
(none, optimizer, full, none, ...) for `--rounds` rounds; the table gives each one's median, its spread and
its ratio to whole replicas. Feeds docs/results/memory.md (the memory of the same settings is bench_memory's).

    python -m benchmarks.bench_shard
    python -m benchmarks.bench_shard --quick   # smoke: 1 round of 2 steps
"""

from __future__ import annotations

import glob
import json
import statistics
import tempfile
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness.bench import Bench, Table, interleave, spread
from lightning_pipe import AutoPipeStrategy
from lightning_pipe.models import CausalLM

SHARDS = ["none", "optimizer", "full", "full:step"]  # full:step is shard="full" with reshard="step"
MESHES = {"pp4": dict(width=1), "tp2": dict(width=1, tensor=2)}  # the other layouts of the 4 processes


class StepClock(L.Callback):
    """Rank 0's seconds from the first timed batch's start to the last one's end, kept on the module."""

    def __init__(self, warmup: int):
        self.warmup, self.started = warmup, 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup:
            self.started = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            seconds = (time.perf_counter() - self.started) / (trainer.global_step - self.warmup)
            torch.save(seconds, f"{trainer.default_root_dir}/step_seconds.pt")


def tokens(rows: int, seq: int, batch: int) -> DataLoader:
    ids = torch.randint(0, 260, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch)


def step_seconds(setting: str, args: Any) -> tuple[float, Any]:
    """Rank 0's measured seconds a step, and with @auto the choice's (schedule, simulated seconds) from plan.json."""
    layout, _, schedule = setting.partition("@")  # e.g. full@2bw: PipeDream-2BW over FSDP2
    shard, _, reshard = layout.partition(":")
    mesh = MESHES.get(layout, dict(width=2, shard=shard, reshard=reshard or "microbatch"))
    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        strategy = AutoPipeStrategy(
            **mesh,
            schedule=schedule or "1f1b",
            microbatches=4,
            partition="uniform",
            start_method="fork",
            message_costs=False,
            timeout=args.timeout,
        )
        trainer = L.Trainer(
            accelerator="cpu", devices=4, strategy=strategy, max_steps=args.warmup + args.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=0, callbacks=[StepClock(args.warmup)], default_root_dir=out,
        )  # fmt: skip
        rows = 2 * 8 * (args.warmup + args.steps)  # every step a new global batch of 16: 8 per replica at width 2
        trainer.fit(CausalLM("gpt-tiny", lr=1e-3, weight_decay=0.0), tokens(rows, args.seq, 16 // mesh["width"]))
        plans = glob.glob(f"{out}/**/plan.json", recursive=True)
        chosen = json.load(open(plans[0]))["schedule_choice"]["chosen"] if schedule == "auto" and plans else None
        return float(torch.load(f"{out}/step_seconds.pt")), (chosen["schedule"], chosen["iteration_time"]) if chosen else None


def main() -> None:
    bench = Bench(__doc__, {}, threads=1, rounds=3, steps=8, warmup=2, timeout=300.0)
    bench.options(
        seq=(64, "tokens per sequence"),
        shards=(SHARDS, "the settings to time: shard[:reshard] at pp2 x dp2, pp4 or tp2, each [@schedule] (default 1f1b)"),
    )
    args = bench.parse()
    runs = interleave(args.shards, args.rounds, lambda shard, r: step_seconds(shard, args))
    results = [[seconds for seconds, _ in rounds] for rounds in runs]
    choices = [[chosen for _, chosen in rounds] for rounds in runs]
    bench.keep("step_seconds", dict(zip(args.shards, results)))
    bench.keep("auto_chosen", dict(zip(args.shards, choices)))
    base = statistics.median(results[0])
    table = Table("shard", "step ms: median (min..max)", f"median vs {args.shards[0]}", "auto's choice, simulated ms: median")
    for shard, seconds, chosen in zip(args.shards, results, choices):
        picked = [c for c in chosen if c is not None]
        said = f"{'/'.join(sorted({c[0] for c in picked}))}, {statistics.median(c[1] for c in picked) * 1e3:.1f}" if picked else ""
        table.add(shard, spread(seconds).fmt(1e3), f"{statistics.median(seconds) / base:.2f}x", said)
    bench.table(
        table,
        f"4 processes, GPT-tiny fp32, 1F1B (or @schedule), 16 x {args.seq} tokens a step in 4 micro-batches per pipeline, "
        f"{args.rounds} rounds interleaved",
    )
    bench.finish()


if __name__ == "__main__":
    main()
