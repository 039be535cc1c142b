"""Where the Trainer's step goes beyond our raw runtime's: the first stage's time between two steps.

On the first stage of a flush schedule everything between the end of one step's action list and the
start of the next is on the critical path: the raw runtime spends it in its optimizer step; through the
Trainer, Lightning's loop also runs its hooks, its optimizer closure, the logging of the step's loss
and, in a distributed run, a check for SIGTERM every step (Lightning's blocking broadcast of rank 0's
flag, replaced by the strategy's non-blocking all-reduce: lightning/signals.py). Blocks are
`bench_emulated_torch`'s with zero sleeps (a step is nothing but the runtime's and Lightning's own CPU),
P processes, 1F1B, M micro-batches; the raw runtime's steps run first in the same processes. Per rank:
the median gap between two executor runs, the thread CPU of a step, and what two of Lightning's
per-step calls take (timed around them in these processes only). Results: docs/results/emulated_torch.md.

    python -m benchmarks.bench_trainer_path --ranks 2,4 --steps 60 --sigterm lightning,ours
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks import bench_emulated_torch as emulated
from benchmarks.harness.bench import Bench, column_table
from benchmarks.harness.launch import run_distributed


class _Stamps:
    """Start and end of every `Executor.run` in this process, and time spent in the wrapped callables."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, float]] = []
        self.spent: dict[str, float] = {}

    def wrap_run(self, cls: type) -> None:
        real = cls.run

        def run(executor, *args, **kwargs):
            start = time.perf_counter()
            try:
                return real(executor, *args, **kwargs)
            finally:
                self.runs.append((start, time.perf_counter()))

        cls.run = run

    def wrap(self, owner: type, name: str, key: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def gap(self) -> float:
        """Median time from the end of one run to the start of the next."""
        return statistics.median(b[0] - a[1] for a, b in zip(self.runs, self.runs[1:]))

    def reset(self) -> None:
        self.runs, self.spent = [], {}


def job(rank: int, world: int, cfg: dict) -> dict:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from benchmarks.harness.trainer_runs import quiet_lightning
    from lightning_pipe import AutoPipeStrategy
    from lightning_pipe.runtime.executor import Executor

    quiet_lightning()
    stamps, steps, warmup = _Stamps(), cfg["steps"], cfg["warmup"]
    stamps.wrap_run(Executor)
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_pipe.lightning.signals import StepSignals

    if cfg["sigterm"] == "lightning":  # Lightning's blocking broadcast of rank 0's flag, for comparison
        StepSignals.install = classmethod(lambda cls, trainer, device: None)
        stamps.wrap(_TrainingEpochLoop, "_broadcast_sigterm_tensor", "sigterm check")
    else:
        stamps.wrap(StepSignals, "per_step", "sigterm check")
    stamps.wrap(L.LightningModule, "log", "self.log")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.seq = emulated.make_model(cfg, world)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = emulated.loss_fn(self.seq(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg["lr"])

    class Measure(Callback):
        def on_train_start(self, trainer, pl_module):  # the raw runtime first, in these processes
            step = emulated.configurations(rank, world, dict(cfg, schedules=["1f1b"], no_torch=True))["ours/1f1b"]
            for _ in range(warmup):
                step()
            stamps.reset()
            dist.barrier()
            cpu = time.thread_time()
            for _ in range(steps):
                step()
            self.raw = dict(gap=stamps.gap(), cpu=(time.thread_time() - cpu) / steps)
            dist.barrier()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                stamps.reset()
                self.cpu = time.thread_time()

        def on_train_end(self, trainer, pl_module):
            spent = {k: v / steps for k, v in stamps.spent.items()}
            self.trainer_side = dict(gap=stamps.gap(), cpu=(time.thread_time() - self.cpu) / steps, **spent)

    measure = Measure()
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=cfg["m"], partition="uniform", message_costs=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=warmup + steps, callbacks=[measure],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)  # fmt: skip
    x, y = emulated.make_data(cfg)
    trainer.fit(Module(), torch.utils.data.DataLoader([(x, y)] * (warmup + steps), batch_size=None))
    return dict(raw=measure.raw, trainer=measure.trainer_side)


COLUMNS = (
    ("P", "P", ""), ("SIGTERM check", "sigterm", ""), ("rank", "rank", ""),
    ("gap, raw ms", lambda r: f"{r['raw']['gap'] * 1e3:.2f}"), ("gap, Trainer ms", lambda r: f"{r['trainer']['gap'] * 1e3:.2f}"),
    ("step CPU, raw ms", lambda r: f"{r['raw']['cpu'] * 1e3:.2f}"), ("step CPU, Trainer ms", lambda r: f"{r['trainer']['cpu'] * 1e3:.2f}"),
    ("SIGTERM check ms / step", lambda r: f"{r['trainer'].get('sigterm check', 0.0) * 1e3:.2f}"),
    ("self.log ms / step", lambda r: f"{r['trainer'].get('self.log', 0.0) * 1e3:.2f}"),
)  # fmt: skip


def main() -> None:
    bench = Bench(__doc__, dict(ranks=[2], steps=10), threads=1, rounds=1, steps=60, warmup=10, timeout=900.0)
    bench.options(ranks=([2, 4], "processes (P)"), m=(8, "micro-batches (M)"), width=16, rows=(4, "rows per micro-batch"))
    bench.options(sigterm=(["lightning", "ours"], "the per-step SIGTERM check: Lightning's broadcast, ours (signals.py)"))
    args = bench.parse()
    if unknown := set(args.sigterm) - {"lightning", "ours"}:
        bench.parser.error(f"--sigterm {','.join(sorted(unknown))}: allowed values are lightning, ours")
    cfg = dict(m=args.m, width=args.width, rows=args.rows, steps=args.steps, warmup=args.warmup, lr=0.01, seed=3)
    cfg.update(f_ms=0.0, bi_ms=0.0, w_ms=0.0, rounds=1, schedules=["1f1b"], no_torch=True, trace=None)
    rows = []
    for p in args.ranks:
        for check in args.sigterm:
            outs = run_distributed(job, p, dict(cfg, sigterm=check), timeout=args.timeout, threads=1, backend=None)
            rows.extend(dict(P=p, sigterm=check, rank=rank, **out) for rank, out in enumerate(outs))
    bench.table(
        column_table(COLUMNS, rows, "lll" + "r" * 6), "The first stage's time between steps, raw runtime vs Trainer (zero-sleep blocks)"
    )
    bench.say("gap: median from the end of one step's action list to the start of the next (rank 0's is on the critical path)")
    bench.keep("rows", rows)
    bench.finish()


if __name__ == "__main__":
    main()
