"""Peak resident memory of every rank of a real CLI run, against the planners' memory model.

One training step of a paper-size recipe on CPU (`python -m lightning_pipe.train recipe=...
trainer=cpu`, gloo, uniform partition, 1F1B, synthetic tokens, batch 2 in 2 micro-batches of 128
tokens, the recipe's 4 data-loader workers), its process tree
sampled every 0.2 s (lightning_pipe.bench.rss). Predicted per stage: the planners' model
(planning/auto.peak_memory), weights x 4 (weights, gradients, Adam's two moments) plus the
simulated peak of stashed activations, on the analytic costs (planning/flops) of the partition run.
`anon` is what a process allocated itself; `rss` adds file pages mapped in (the memory-mapped stage
parts of a full checkpoint, which the kernel may drop); `runtime` is a process that imported the
CLI and nothing else (Python, torch, Lightning, Hydra), which the memory model leaves out. Feeds docs/memory.md ("Per-rank memory").

    python benchmarks/bench_rank_memory.py --markdown /tmp/rank_memory.md
    python benchmarks/bench_rank_memory.py --runs gpt2-345m:2:32-true --init empty,full --checkpoint full,sharded
    python benchmarks/bench_rank_memory.py --quick   # gpt-tiny-cpu, 2 ranks: the whole path in seconds
"""

from __future__ import annotations

import sys
import tempfile

from lightning_pipe.bench.harness import Bench, Table, names
from lightning_pipe.bench.rss import run_sampled
from lightning_pipe.planning.auto import ADAM_WEIGHT_COPIES
from lightning_pipe.planning.flops import transformer_costs
from lightning_pipe.planning.partition import partition_blocks
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import simulate

GiB = 2.0**30
BATCH, MICRO, SEQ = 2, 2, 128


def predicted(model: str, ranks: int, dtype_bytes: int) -> list[float]:
    """Bytes per stage: the planners' memory model on the analytic costs of the uniform partition."""
    costs, kinds = transformer_costs(model, BATCH // MICRO, SEQ, dtype_bytes=dtype_bytes)
    bounds = partition_blocks("uniform", len(kinds), ranks).bounds
    timeline = simulate(build_schedule("1f1b", ranks, MICRO), costs, bounds)
    return [w * ADAM_WEIGHT_COPIES + a for w, a in zip(timeline.weight_bytes, timeline.peak_activation_bytes)]


def run(model: str, ranks: int, precision: str, init: str, checkpoint: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "lightning_pipe.train", f"recipe={model}", "trainer=cpu", "partition=uniform",
                   "schedule=1f1b", f"trainer.devices={ranks}", f"trainer.precision={precision}", "trainer.max_steps=1",
                   "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "data.synthetic=true", f"data.batch_size={BATCH}",
                   f"data.seq_len={SEQ}", f"pipeline.microbatches={MICRO}", f"empty_init={init == 'empty'}", f"hydra.run.dir={out}",
                   *(["callbacks=none"] if checkpoint == "none" else [f"pipeline.checkpoint={checkpoint}"])]  # fmt: skip
        rc, peaks, tail = run_sampled(command, timeout=timeout)
    if rc != 0:
        said = [line for line in tail.splitlines() if line.startswith("error:")]
        raise RuntimeError(f"exit {rc}: {said[-1] if said else tail.splitlines()[-1:]}")
    # rank 0 is the command itself; Lightning starts the other ranks as its children; the rest are helpers
    root = peaks[0]
    ranked = {0: root, **{p.rank: p for p in peaks if p.parent == root.pid and p.rank is not None and "lightning_pipe.train" in p.command}}
    helpers = [p for p in peaks if p not in ranked.values()]
    started_by = {p.pid: r for r, p in ranked.items()}
    return {
        "ranks": {r: (p.rss, p.anon) for r, p in sorted(ranked.items())},
        "helpers": [(started_by.get(p.parent, "?"), p.command[:80], p.rss, p.anon) for p in helpers],
    }


def main() -> None:
    bench = Bench(__doc__, timeout=1800.0, quick={"runs": "gpt-tiny-cpu:2:32-true", "init": "empty", "checkpoint": "full"})
    bench.parser.add_argument(
        "--runs",
        default="gpt2-345m:2:32-true,gpt2-345m:2:bf16-true,gpt2-345m:4:32-true,gpt2-345m:4:bf16-true,gpt2-1.3b:4:bf16-true,gpt2-1.3b:4:32-true",
    )
    bench.parser.add_argument(
        "--init", default="empty", help="empty (each rank creates its stage), full (every rank builds the model), or both"
    )
    bench.parser.add_argument("--checkpoint", default="full", help="the checkpoint at the end: full, sharded, none (callbacks=none)")
    args = bench.parse()
    _, idle, _ = run_sampled([sys.executable, "-c", "import time, lightning_pipe.cli.train; time.sleep(1)"])
    runtime = idle[0].anon
    bench.say(f"runtime (a process that imported the CLI): {runtime / GiB:.2f} GiB anonymous memory")
    columns = ("predicted GiB", "peak anon GiB", "peak rss GiB", "anon / predicted", "(anon - runtime) / predicted")
    table = Table("model", "ranks", "precision", "init", "checkpoint", "stage", *columns)
    for spec in names(args.runs):
        model, ranks, precision = spec.split(":")
        ranks = int(ranks)
        model_bytes = predicted(model.removesuffix("-cpu"), ranks, 2 if precision.startswith("bf16") else 4)
        for init in names(args.init):
            for checkpoint in names(args.checkpoint):
                bench.log(f"{model} x{ranks} {precision} init={init} checkpoint={checkpoint} ...")
                try:
                    result = run(model, ranks, precision, init, checkpoint, args.timeout)
                except RuntimeError as err:
                    bench.say(f"- {model} x{ranks} {precision} init={init} checkpoint={checkpoint}: failed: {str(err).splitlines()[0]}")
                    continue
                bench.keep(f"{spec}:{init}:{checkpoint}", result)
                for stage, (rss, anon) in result["ranks"].items():
                    pred = model_bytes[stage]
                    figures = (pred / GiB, anon / GiB, rss / GiB)
                    ratios = (anon / pred, (anon - runtime) / pred)
                    table.add(
                        model, ranks, precision, init, checkpoint, stage, *(f"{v:.2f}" for v in figures), *(f"{v:.2f}x" for v in ratios)
                    )
                if result["helpers"]:  # the data-loader workers, forked from the ranks: their pages are mostly the rank's
                    most = max(anon for *_, anon in result["helpers"])
                    bench.say(
                        f"- {spec} init={init} checkpoint={checkpoint}: {len(result['helpers'])} other processes, at most {most / GiB:.2f} GiB anon"
                    )
    bench.table(table, "Peak memory per rank, one step (CPU)")
    bench.finish()


if __name__ == "__main__":
    main()
