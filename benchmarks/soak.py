"""Soak: long CLI runs, checking that memory, file descriptors and step time stay flat.

``python -m lightning_pipe.train`` (GPT-tiny, synthetic tokens, validation and a checkpoint every
250 steps) for --steps steps per configuration; `benchmarks.harness.soak.SoakMonitor` records every
rank's RSS, open fds and mean step time every 50 steps. Feeds docs/results/soak.md.

    python -m benchmarks.soak                        # 1F1B on 4 ranks and 2BW on 2 ranks, 1000 steps each
    python -m benchmarks.soak --steps 200 --configs 1f1b-4
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.harness import child_env
from benchmarks.harness.bench import Bench, Table

CONFIGS = {
    "1f1b-4": ["trainer.devices=4", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
    "2bw-2": ["trainer.devices=2", "pipeline.schedule=2bw", "pipeline.microbatches=2"],
}
TRAIN = "recipe=gpt-tiny-cpu data=synthetic data.synthetic_samples=4096 data.batch_size=8 data.seq_len=64 partition=uniform"
TRAIN += " trainer.val_check_interval=250 trainer.limit_val_batches=4 trainer.enable_progress_bar=false"


def run(name: str, steps: int, folder: str) -> list[dict]:
    log = os.path.join(folder, f"{name}.jsonl")
    command = [sys.executable, "-m", "lightning_pipe.train", *TRAIN.split(), f"trainer.max_steps={steps}"]
    command += [f"hydra.run.dir={os.path.join(folder, name)}", f"+callbacks.soak.path={log}", *CONFIGS[name]]
    command += ["+callbacks.soak._target_=benchmarks.harness.soak.SoakMonitor"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=child_env({"OMP_NUM_THREADS": "1"}))
    with open(log) as lines:
        return [json.loads(line) for line in lines]


def main() -> None:
    bench = Bench(__doc__, steps=1000, quick={"steps": 100, "configs": ["2bw-2"]})
    bench.parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    bench.parser.add_argument("--keep", help="a folder to keep the runs and their per-rank series (<config>.jsonl) in")
    args = bench.parse()
    table = Table("run", "rank", "RSS start -> end (MB)", "RSS over the second half", "fds start -> end", "step ms, first / last quarter")
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or scratch
        os.makedirs(folder, exist_ok=True)
        for name in args.configs:
            rows = run(name, args.steps, folder)
            bench.keep(name, rows)
            for rank in sorted({r["rank"] for r in rows}):
                mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])
                rss, fds = [r["rss_mb"] for r in mine], [r["fds"] for r in mine]
                half, quarter = len(mine) // 2, max(1, len(mine) // 4)
                times = [r["step_ms"] for r in mine[1:]] or [mine[0]["step_ms"]]  # the first line includes setup
                first, last = statistics.mean(times[:quarter]), statistics.mean(times[-quarter:])
                rss_cells = (f"{rss[0]:.1f} -> {rss[-1]:.1f} (max {max(rss):.1f})", f"{rss[-1] - rss[half]:+.1f} MB")
                fd_cell, step_cell = f"{fds[0]} -> {fds[-1]} (max {max(fds)})", f"{first:.1f} / {last:.1f}"
                table.add(f"{name}, {args.steps} steps" if rank == 0 else "", rank, *rss_cells, fd_cell, step_cell)
            series = [r["step_ms"] for r in sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])[1:]]
            bench.log(f"{name} rank 0 step ms, one value per logged interval: {series}")
    bench.table(table, f"soak, {args.steps} steps per configuration")
    bench.finish()


if __name__ == "__main__":
    main()
