"""Soak: long CLI runs, checking that memory, file descriptors and step time stay flat.

Runs ``python -m lightning_pipe.train`` (GPT-tiny on synthetic tokens, validation and a checkpoint
every 250 steps) for `--steps` steps per configuration, with `lightning_pipe.bench.soak.SoakMonitor`
recording every rank's RSS, open file descriptors and mean step time every 50 steps, then prints
per configuration and rank: first / last / max RSS, the RSS growth over the second half (after
warm-up: allocator caches fill in the first hundred steps), fds first / last, and the step time of
the first and last quarter.

    python benchmarks/soak.py                        # 1F1B on 4 ranks and 2BW on 2 ranks, 1000 steps each
    python benchmarks/soak.py --steps 200 --configs 1f1b-4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import date

CONFIGS = {
    "1f1b-4": ["trainer.devices=4", "pipeline.schedule=1f1b", "pipeline.microbatches=4"],
    "2bw-2": ["trainer.devices=2", "pipeline.schedule=2bw", "pipeline.microbatches=2"],
}


def run(name: str, steps: int, folder: str) -> list[dict]:
    log = os.path.join(folder, f"{name}.jsonl")
    command = [
        sys.executable,
        "-m",
        "lightning_pipe.train",
        "recipe=gpt-tiny-cpu",
        "data=synthetic",
        "data.synthetic_samples=4096",
        "data.batch_size=8",
        "data.seq_len=64",
        "partition=uniform",
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=250",
        "trainer.limit_val_batches=4",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={os.path.join(folder, name)}",
        "+callbacks.soak._target_=lightning_pipe.bench.soak.SoakMonitor",
        f"+callbacks.soak.path={log}",
        *CONFIGS[name],
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(log) as lines:
        return [json.loads(line) for line in lines]


def summary(name: str, rows: list[dict]) -> list[str]:
    out = []
    for rank in sorted({r["rank"] for r in rows}):
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])
        rss = [r["rss_mb"] for r in mine]
        half = len(mine) // 2
        quarter = max(1, len(mine) // 4)
        times = [r["step_ms"] for r in mine[1:]]  # the first line includes setup
        out.append(
            f"{name:7s} rank {rank}: RSS {rss[0]:.1f} -> {rss[-1]:.1f} MB (max {max(rss):.1f}; second half "
            f"{rss[-1] - rss[half]:+.1f} MB), fds {mine[0]['fds']} -> {mine[-1]['fds']} (max {max(r['fds'] for r in mine)}), "
            f"step {statistics.mean(times[:quarter]):.1f} ms first quarter, {statistics.mean(times[-quarter:]):.1f} ms last"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--keep", help="a folder to keep the runs and their per-rank series (<config>.jsonl) in")
    args = parser.parse_args()
    from lightning_pipe.bench.launch import machine_description

    print(f"soak, {date.today()}, {machine_description()}, {args.steps} steps per configuration")
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or scratch
        os.makedirs(folder, exist_ok=True)
        for name in args.configs:
            rows = run(name, args.steps, folder)
            for line in summary(name, rows):
                print(line, flush=True)
            series = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])[1:]
            print(f"{name:7s} rank 0 step ms every {series[1]['step'] - series[0]['step']} steps: {[r['step_ms'] for r in series]}")


if __name__ == "__main__":
    main()
