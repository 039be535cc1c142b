"""Pieces the benchmarks under ``benchmarks/`` share (not part of the library's API).

- `lightning_pipe.bench.mlp`: the balanced residual MLP of bench_runtime.py and bench_waves.py
  (model, data, stage cut, loss, the one-process run, weight comparison, samples/s summary);
- `lightning_pipe.bench.gpt`: the small GPT of bench_simulator.py (and its --speedup)
  (model, batch, loss, block kinds, the profile of all blocks with the loss, common CLI options);
- `lightning_pipe.bench.simulator_report`: bench_simulator.py's analysis, tables and pictures,
  from the measurements it saved (``--raw``).

The launcher and the timing helpers (quiet machine, foreign load, timed steps, ping-pong) are
`lightning_pipe.bench.launch`. `provenance` here: the machine and the library's git state in one line.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .launch import machine_description

REPO = Path(__file__).resolve().parent.parent.parent  # the checkout (the package is installed editable)


def provenance() -> str:
    """Date, machine, and the library's git state (commit, uncommitted changes under lightning_pipe/)."""

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = run("git", "status", "--short", "--", "lightning_pipe").replace("\n", ", ")
    return (
        f"{time.strftime('%a %b %d %H:%M:%S %Z %Y')}; {machine_description()}; commit "
        f"{run('git', 'rev-parse', '--short', 'HEAD') or '?'}" + (f" with uncommitted library changes: {dirty}" if dirty else "")
    )
