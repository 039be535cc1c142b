"""What a live switch stalls the pipeline (benchmarks/bench_switch.py): AutoPipe-RL §4.4's fine-grained
switch against the stop-and-move switch.

2 CPU processes x 1 thread (each pinned to a core) train 8 equal blocks of 1024 x 1024 weights through
the Trainer with AdamW; at iteration `first` two blocks move from rank 0 to rank 1, at `second` they
move back. The stall of a switch is its iteration's period less what that iteration would take
without a switch (`stalls`), on rank 0's clock. ``emulated``: the blocks also
sleep their device time (EMULATED: a GPU leaves its host idle, so transfers do not take compute
from the cores), on 2-row micro-batches.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .emulated import EmulatedBlock
from .trainer_runs import fit_timed, quiet_lightning

WIDTH, BLOCKS, M = 1024, 8, 4
EMULATED_S = (0.005, 0.010)  # an emulated block's forward and backward per micro-batch


class SwitchingMLP(L.LightningModule):
    """Equal blocks; `plan`: {iteration: (bounds, early)} switches requested on every rank."""

    def __init__(self, plan: dict[int, tuple[list[list[int]], Optional[int]]], emulated: bool):
        super().__init__()
        torch.manual_seed(0)
        make = (lambda: EmulatedBlock(WIDTH, *EMULATED_S)) if emulated else (lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()))
        self.blocks = nn.Sequential(*[make() for _ in range(BLOCKS)])
        self.plan = plan

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.blocks(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.fit_loop.total_batch_idx
        if step in self.plan:
            bounds, early = self.plan[step]
            self.trainer.strategy.repartition(bounds, early=early)

    def on_train_end(self) -> None:
        if self.trainer.global_rank == 0:  # each switch as logged: the slowest rank's stop, the new worker's wait
            records = [
                {"stopped_ms": r.seconds * 1e3, "waited_ms": r.waited * 1e3, "early": r.early}
                for r in self.trainer.strategy.adaptive.switches
            ]
            (Path(self.trainer.default_root_dir) / "switches.json").write_text(json.dumps(records))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def data(steps: int, batch: int) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch * steps, WIDTH, generator=g)
    return {"train_dataloaders": DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=batch)}


def stalls(periods: list[float], switches: list[int], shares: list[float], around: int) -> list[float]:
    """Each switch's period less what its iteration would take without a switch: the medians of the
    `around` periods before (old partition) and after (new), weighted by the share of the iteration's
    micro-batches that ran on the old partition (k / M; 0 for the stop switch)."""
    out = []
    for i, share in zip(switches, shares):
        before = statistics.median(periods[i - around : i])
        after = statistics.median(periods[i + 1 : i + 1 + around])
        out.append(periods[i] - (share * before + (1 - share) * after))
    return out


def run_mode(mode: str, early: Optional[int], emulated: bool, steps: int, first: int, second: int, out: Path) -> dict:
    """One fit; `periods_ms[i]` is iteration i's (iteration 0, the warm-up, has none: 0)."""
    from lightning_pipe import AutoPipeStrategy

    quiet_lightning()
    half = BLOCKS // 2
    plan = {first: ([[0, half - 2], [half - 2, BLOCKS]], early), second: ([[0, half], [half, BLOCKS]], early)}
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=M, partition=[half, half], adaptive_switch=mode, start_method="fork")
    result = fit_timed(SwitchingMLP(plan, emulated), data(steps + 1, 2 * M if emulated else 64), strategy, 1, steps, out)
    result["periods_ms"] = [0.0, *result["periods_ms"]]
    result["switches"] = json.loads((out / "switches.json").read_text())
    share = 0.0 if mode == "stop" else min(early if early is not None else 1, M) / M  # requested, unmonitored: k = 1
    result["stall_ms"] = stalls(result["periods_ms"], [first, second], [share, share], around=4)
    return result


MODES = (("stop", None), ("fine-grained", 1), ("fine-grained", 2), ("fine-grained", 3))


def main(doc: str) -> None:
    from .bench import Bench, Table, interleave, spread

    bench = Bench(doc, rounds=5, steps=24, threads=1)
    bench.options(out=("/tmp/bench_switch", "run folders"), emulated=(False, "blocks that sleep their device time (EMULATED)"))
    args = bench.parse()
    first, second = 8, 16
    if args.quick:
        args.rounds, args.steps = 1, 22
    folder = lambda mode, r: Path(args.out) / f"{mode[0]}-{mode[1]}-{r}"  # noqa: E731
    runs = interleave(MODES, args.rounds, lambda mode, r: run_mode(*mode, args.emulated, args.steps, first, second, folder(mode, r)))
    table = Table(
        "switch",
        "k (early micro-batches)",
        "stall, to 2:6 (ms)",
        "stall, back to 4:4 (ms)",
        "pipeline stopped (ms)",
        "new worker waited (ms)",
        "iteration at 4:4 (ms)",
        "foreign CPUs",
    )
    for (mode, early), results in zip(MODES, runs):
        steady = [statistics.median(r["periods_ms"][1:first]) for r in results]
        k = "-" if mode == "stop" else str(early)
        cells = [spread(r["stall_ms"][i] for r in results).fmt() for i in (0, 1)]
        cells += [spread(s[key] for r in results for s in r["switches"]).fmt() for key in ("stopped_ms", "waited_ms")]
        table.add(mode, k, *cells, spread(steady).fmt(), f"{max(r['foreign_cpus'] for r in results):.2f}")
    what = "EMULATED blocks (sleeping 5 / 10 ms per micro-batch)" if args.emulated else "real blocks"
    bench.table(
        table,
        f"Stall of a live switch, 2 CPU processes x 1 thread, {what}, 8 x 1024^2 weights, AdamW, M = {M}; medians (min..max) of {args.rounds} rounds",
    )
    bench.keep("runs", {f"{m}-{e}": rs for (m, e), rs in zip(MODES, runs)})
    bench.finish()
