"""Adaptive re-partitioning (AutoPipe-RL part 1): live switches keep training exact.

A callback asks every rank for a switch at given iterations (`strategy.repartition`); the run must
end with the weights of one process trained on the same batches (fp64, <= 1e-10), whichever blocks
moved, in which direction, while gradients were being accumulated, under 1F1B, GPipe, interleaved
and 2BW. GPT tiny keeps its tied embedding / LM head on the first and last stage.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from models import max_rel_diff, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.models import CausalLM, ModelConfig

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]
CFG = dict(vocab_size=260, n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def gpt_data(n: int = 48):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (n, 13), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=6)


def make(layers: int = 2) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(model=ModelConfig(**dict(CFG, n_layer=layers)), lr=1e-2, warmup_steps=1, max_steps=8).double()


class SwitchAt(Callback):
    """strategy.repartition(bounds) at the start of the listed iterations (on every rank); writes what
    each rank held at every training step to held-<rank>.json (the worker's state does not come back)."""

    def __init__(self, plan: dict[int, list[list[int]]]):
        self.plan, self.seen = plan, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        bounds = self.plan.get(trainer.fit_loop.total_batch_idx)
        if bounds is not None:
            trainer.strategy.repartition(bounds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        self.seen.append([[list(b) for b in strategy.cut.bounds], sorted(strategy.cut.stage.blocks())])

    def on_train_end(self, trainer, pl_module):
        Path(f"held-{trainer.global_rank}.json").write_text(json.dumps(self.seen))


def partitions_over_time(plan: dict, partition: list[int], steps: int, accumulate: int) -> list[list[list[int]]]:
    edges = [0, *itertools.accumulate(partition)]
    current = [[a, b] for a, b in zip(edges, edges[1:])]
    out = []
    for i in range(steps * accumulate):
        current = plan.get(i, current)
        out.append(current)
    return out


def single_process(layers: int, steps: int, accumulate: int = 1) -> CausalLM:
    ref = make(layers)
    L.Trainer(devices=1, **trainer_kwargs(max_steps=steps, accumulate_grad_batches=accumulate)).fit(ref, gpt_data())
    return ref


CASES = {
    # name: (devices, layers, schedule options, start partition, {iteration: bounds}, accumulate)
    "1f1b-2-forth-and-back": (2, 2, dict(schedule="1f1b"), [3, 3], {2: [[0, 1], [1, 6]], 4: [[0, 5], [5, 6]]}, 1),
    "gpipe-2-accumulating": (2, 2, dict(schedule="gpipe"), [2, 4], {3: [[0, 4], [4, 6]], 5: [[0, 3], [3, 6]]}, 2),
    "1f1b-4-two-boundaries": (
        4,
        3,
        dict(schedule="1f1b"),
        [2, 2, 2, 2],
        {2: [[0, 1], [1, 4], [4, 5], [5, 8]], 4: [[0, 3], [3, 4], [4, 7], [7, 8]]},
        1,
    ),
    "interleaved-2": (2, 3, dict(schedule="interleaved", chunks=2), [2, 2, 2, 2], {2: [[0, 1], [1, 4], [4, 5], [5, 8]]}, 1),
    "2bw-2-drain-then-switch": (2, 2, dict(schedule="2bw"), [3, 3], {2: [[0, 2], [2, 6]], 4: [[0, 4], [4, 6]]}, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forced_switches_keep_single_process_weights(name):
    devices, layers, options, partition, plan, accumulate = CASES[name]
    steps = 6
    if options["schedule"] == "2bw":  # 2BW's own trajectory (1-stale updates) is the reference: an unswitched run
        ref = make(layers)
        strategy = AutoPipeStrategy(microbatches=4, partition=partition, start_method="spawn", **options)
        L.Trainer(devices=devices, strategy=strategy, **trainer_kwargs(max_steps=steps)).fit(ref, gpt_data())
    else:
        ref = single_process(layers, steps, accumulate)
    model = make(layers)
    strategy = AutoPipeStrategy(microbatches=4, partition=partition, start_method="spawn", **options)
    trainer = L.Trainer(
        devices=devices,
        strategy=strategy,
        callbacks=[SwitchAt(plan)],
        **trainer_kwargs(max_steps=steps, accumulate_grad_batches=accumulate),
    )
    trainer.fit(model, gpt_data())
    assert model.model[-1].weight is model.model[0].token.weight, "the trained model comes back tied"
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    expected = partitions_over_time(plan, partition, steps, accumulate)
    for rank in range(devices):  # the switches happened where asked, and each rank held its part
        seen = json.loads(Path(f"held-{rank}.json").read_text())
        assert [bounds for bounds, _ in seen] == expected
        chunk_rank = list(range(devices)) * (len(expected[0]) // devices)
        for bounds, held in seen:
            assert held == [b for c, (lo, hi) in enumerate(bounds) if chunk_rank[c] == rank for b in range(lo, hi)]
