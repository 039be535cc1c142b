"""Eager vs torch.compile'd blocks (pipeline.compile=true compiles each block once): forward + backward ms of
every block of GPT-tiny (lightning_pipe.models.CausalLM, its pipeline blocks in order) and of an MLP block
(1024 x 1024 Linear + GELU, the held-out-style MLP's block), one process, 1 thread, fp32, one micro-batch.

Each block runs `--warmup` untimed passes (the compiled one compiles there), then `--steps` timed passes;
eager and compiled run interleaved for `--rounds` rounds; the table gives each one's median ms and the
compiled/eager ratio.

    python -m benchmarks.bench_compile
    python -m benchmarks.bench_compile --quick   # smoke: 1 round of 2 passes
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

from benchmarks.harness.bench import Bench, Table, interleave, spread
from lightning_pipe.models import CausalLM


def gpt_blocks(batch: int, seq: int) -> list[tuple[str, nn.Module, Any]]:
    """(name, block, its input) for every block of GPT-tiny, inputs made by running the blocks in order."""
    torch.manual_seed(0)
    blocks = CausalLM("gpt-tiny").model
    x: Any = torch.randint(0, 260, (batch, seq))
    out = []
    with torch.no_grad():
        for i, block in enumerate(blocks):
            out.append((f"gpt-tiny {i} {type(block).__name__}", block, x))
            x = block(x)
    return out


def mlp_block(batch: int) -> tuple[str, nn.Module, Any]:
    torch.manual_seed(0)
    return ("mlp 1024x1024 Linear+GELU", nn.Sequential(nn.Linear(1024, 1024), nn.GELU()), torch.randn(batch, 1024))


def pass_ms(block: nn.Module, x: Any, warmup: int, steps: int) -> float:
    """Median ms of one forward + backward of `block` on `x` (a float input needs its gradient too)."""
    x = x.detach().requires_grad_() if x.is_floating_point() else x
    times = []
    for i in range(warmup + steps):
        started = time.perf_counter()
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        if i >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    bench = Bench(__doc__, {}, threads=1, rounds=3, steps=20, warmup=3)
    bench.options(batch=(8, "sequences (GPT) or rows (MLP) per micro-batch"), seq=(128, "tokens per sequence"))
    args = bench.parse()
    cases = [*gpt_blocks(args.batch, args.seq), mlp_block(args.batch)]
    table = Table("block", "eager ms", "compiled ms", "compiled / eager")
    kept = {}
    for name, block, x in cases:
        compiled = copy.deepcopy(block)
        compiled.compile()
        modes = {"eager": block, "compiled": compiled}
        results = interleave(list(modes), args.rounds, lambda mode, r: pass_ms(modes[mode], x, args.warmup, args.steps))
        eager, fast = (spread(r) for r in results)
        kept[name] = dict(zip(modes, results))
        table.add(name, eager.fmt(), fast.fmt(), f"{statistics.median(results[1]) / statistics.median(results[0]):.2f}x")
    bench.keep("ms", kept)
    bench.table(
        table, f"forward + backward per block, {args.batch} x {args.seq} tokens (MLP: {args.batch} rows), medians of {args.rounds} rounds"
    )
    bench.finish()


if __name__ == "__main__":
    main()
