"""Pieces the benchmarks under ``benchmarks/`` share (not part of the library, nor of its wheel).

- `benchmarks.harness.bench`: the common options, rounds, spreads, tables and outputs (`Bench`);
- `benchmarks.harness.mlp`: the balanced residual MLP of bench_runtime.py and bench_waves.py
  (model, data, stage cut, loss, the one-process run, weight comparison, samples/s summary);
- `benchmarks.harness.gpt`: the small GPT of bench_simulator.py (and its --speedup)
  (model, batch, loss, block kinds, the profile of all blocks with the loss, common CLI options);
- `benchmarks.harness.simulator_report`: bench_simulator.py's analysis, tables and pictures,
  from the measurements it saved (``--raw``).

The launcher and the timing helpers (quiet machine, foreign load, timed steps, ping-pong) are
`benchmarks.harness.launch`. `provenance` here: the machine and the checkout's git state in one line;
`child_env`: the environment of a CLI run that loads one of the harness's callbacks.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from .launch import machine_description

REPO = Path(__file__).resolve().parent.parent.parent  # the checkout: the benchmarks run from it


def provenance() -> str:
    """Date, machine, and the checkout's git state (commit, uncommitted changes of the library and
    the benchmarks)."""

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = run("git", "status", "--short", "--", "lightning_pipe", "benchmarks").replace("\n", ", ")
    return (
        f"{time.strftime('%a %b %d %H:%M:%S %Z %Y')}; {machine_description()}; commit "
        f"{run('git', 'rev-parse', '--short', 'HEAD') or '?'}" + (f" with uncommitted changes: {dirty}" if dirty else "")
    )


def child_env(extra: dict | None = None) -> dict:
    """This process's environment with the checkout first on PYTHONPATH (plus ``extra``): a CLI run
    started in another folder imports the harness's callbacks (``+callbacks.x._target_=benchmarks.harness...``)
    and this checkout's library."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}
