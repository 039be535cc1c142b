"""AutoPipe-RL §4.4's fine-grained switch: blocks move while the transition iteration runs.

Each step the paper defines has a test that fails without it: the early micro-batches run the moved
blocks on the old worker and the later ones on the new (counted forwards per rank); the old worker's
partial gradients join the new one's and the optimizer state moves (the weights after several AdamW
steps equal one process's, fp64); the pipeline does not stop (the switch record says so, with k);
where the switch cannot be fine-grained it stops the pipeline and says why.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from models import START, EpochPerm, max_rel_diff, trainer_kwargs
from test_adaptive import gpt_data, make, single_process
from torch.utils.data import DataLoader

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.adaptive.fine_grained import early_microbatches, fine_grained_move, keeps_running_statistics
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


class SwitchAndCount(Callback):
    """repartition(bounds, early) at the listed iterations; counts each block's forward calls on this
    rank during those iterations, and keeps the switch records; written to fine-<rank>.json."""

    def __init__(self, plan: dict[int, tuple[list[list[int]], int]]):
        self.plan, self.counts, self.records = plan, {}, []
        self._handle, self._index, self._calls, self._step = None, {}, {}, -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.fit_loop.total_batch_idx
        if step in self.plan:
            bounds, early = self.plan[step]
            trainer.strategy.repartition(bounds, early=early)
            self._index = {id(m): i for i, m in trainer.strategy.cut.stage.blocks().items()}  # the old worker's, kept
            self._calls, self._step = {}, step

            def hook(module, args, output):
                self._calls[id(module)] = self._calls.get(id(module), 0) + 1

            self._handle = torch.nn.modules.module.register_module_forward_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._index.update({id(m): i for i, m in trainer.strategy.cut.stage.blocks().items()})  # moved in
            self.counts[self._step] = {self._index[k]: n for k, n in self._calls.items() if k in self._index}
        self.records = [
            {"iteration": r.iteration, "early": r.early, "stopped_because": r.stopped_because, "waited": r.waited, "bytes": r.moved_bytes}
            for r in trainer.strategy.adaptive.switches
        ]

    def on_train_end(self, trainer, pl_module):
        Path(f"fine-{trainer.global_rank}.json").write_text(json.dumps({"counts": self.counts, "records": self.records}))


def run(partition, plan, steps=6, devices=2, width=1, switch="fine-grained", accumulate=1, layers=2, batch_size=6):
    model = make(layers)
    strategy = AutoPipeStrategy(
        schedule="1f1b", microbatches=4, partition=partition, start_method=START, width=width, adaptive_switch=switch
    )
    trainer = L.Trainer(
        devices=devices,
        strategy=strategy,
        callbacks=[SwitchAndCount(plan)],
        **trainer_kwargs(max_steps=steps, accumulate_grad_batches=accumulate),
    )
    data = gpt_data()
    if width > 1:  # Lightning's DistributedSampler deals each replica its share of EpochPerm's global batch
        data = DataLoader(data.dataset, batch_size=batch_size // width)
    trainer.fit(model, data)
    return model, [json.loads(Path(f"fine-{r}.json").read_text()) for r in range(devices)]


# forward calls of a micro-batch through a block: the last stage runs the user's step, which calls
# the pipeline once; no block runs twice per micro-batch, so counts are micro-batch counts
@pytest.mark.parametrize(
    "name, partition, plan",
    [
        # tail of worker 0 to worker 1 (k = 1), then the head of worker 1 back to worker 0 (k = 3)
        ("both-directions", [3, 3], {2: ([[0, 1], [1, 6]], 1), 4: ([[0, 4], [4, 6]], 3)}),
        # k = 0: every micro-batch on the new worker (it waits for each block); k = M: all on the old one
        ("k-0-and-k-M", [3, 3], {1: ([[0, 2], [2, 6]], 0), 3: ([[0, 4], [4, 6]], 4)}),
    ],
)
def test_fine_switch_keeps_single_process_weights(name, partition, plan):
    ref = single_process(2, 6)
    model, seen = run(partition, plan)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    edges = {0: [0, 3, 6]}
    for step, (bounds, early) in sorted(plan.items()):
        old = edges[max(s for s in edges if s <= step)]
        new = [0, bounds[0][1], 6]
        edges[step + 1] = new
        moved = range(min(old[1], new[1]), max(old[1], new[1]))
        src, dst = (0, 1) if new[1] < old[1] else (1, 0)
        for b in moved:  # the early micro-batches on the old worker, the rest on the new one
            assert seen[src]["counts"][str(step)].get(str(b), 0) == early, (step, b, seen)
            assert seen[dst]["counts"][str(step)].get(str(b), 0) == 4 - early, (step, b, seen)
    for rank in (0, 1):
        records = seen[rank]["records"]
        assert [(r["iteration"], r["early"], r["stopped_because"]) for r in records] == [(s, k, "") for s, (_, k) in sorted(plan.items())]
        assert all(r["bytes"] > 0 for r in records)


def test_fine_switch_with_replicas_and_a_short_last_batch():
    # width 2: each replica's old worker reduces without the moved blocks, the new worker adds the
    # partial gradients before its REDUCE; 48 samples in batches of 10: the 5th batch has 8 (4 per
    # replica, micro-batches of 1), and the switch at iteration 4 asks k = 3 of its 4
    torch.manual_seed(0)
    ref = single_process_batches(steps=5, batch_size=10)
    model, seen = run([3, 3], {4: ([[0, 2], [2, 6]], 3)}, steps=5, devices=4, width=2, batch_size=10)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    assert all(s["records"][0]["early"] == 3 and s["records"][0]["stopped_because"] == "" for s in seen)


def single_process_batches(steps: int, batch_size: int):
    ref = make(2)
    data = gpt_data()
    data = DataLoader(data.dataset, batch_size=batch_size, sampler=EpochPerm(len(data.dataset)))
    L.Trainer(devices=1, **trainer_kwargs(max_steps=steps)).fit(ref, data)
    return ref


def test_where_it_cannot_be_fine_grained_the_pipeline_stops_and_says_why():
    ref = single_process(2, 4, accumulate=2)
    model, seen = run([3, 3], {2: ([[0, 2], [2, 6]], None)}, steps=4, accumulate=2)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    record = seen[0]["records"][0]
    assert record["early"] is None and record["stopped_because"] == "gradients accumulate over several batches"
    model, seen = run([3, 3], {2: ([[0, 2], [2, 6]], None)}, steps=4, switch="stop")
    assert max_rel_diff(single_process(2, 4).state_dict(), model.state_dict()) <= 1e-10
    assert seen[1]["records"][0]["early"] is None and seen[1]["records"][0]["stopped_because"] == ""


def test_which_switches_are_fine_grained():
    ties = [[(0, "token.weight"), (5, "weight")]]  # GPT's tied embedding and head
    move, why = fine_grained_move(((0, 3), (3, 6)), ((0, 2), (2, 6)), (0, 1), ties)
    assert (move.src, move.dst, move.blocks, why) == (0, 1, [2], "")
    move, _ = fine_grained_move(((0, 3), (3, 6)), ((0, 4), (4, 6)), (0, 1), ties)
    assert (move.src, move.dst, move.blocks) == (1, 0, [3])
    assert fine_grained_move(((0, 2), (2, 4), (4, 6)), ((0, 1), (1, 5), (5, 6)), (0, 1, 2), [])[1] == (
        "2 pairs of workers change blocks (the paper's switch involves two)"
    )
    assert fine_grained_move(((0, 2), (2, 4), (4, 6), (6, 8)), ((0, 2), (2, 3), (3, 6), (6, 8)), (0, 1, 0, 1), [])[1] == (
        "several chunks per rank"
    )
    assert fine_grained_move(((0, 3), (3, 6)), ((0, 5), (5, 6)), (0, 1), [[(0, "a"), (4, "b")]]) == (
        None,
        "a moved block shares a tied weight",
    )


def test_blocks_with_running_statistics_stop_the_pipeline():
    # BatchNorm's running mean would be updated on two copies, each for part of the micro-batches
    assert keeps_running_statistics(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    assert not keeps_running_statistics(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, track_running_stats=False)))
    assert not keeps_running_statistics(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))


def test_k_is_the_micro_batches_the_new_worker_would_reach_before_the_weights():
    # 8 MB at 1 GB/s = 8 ms; a 3 ms forward per micro-batch: the 3rd micro-batch's forward starts after
    assert early_microbatches(8e6, 1e9, 0.003, 8) == 3
    assert early_microbatches(8e6, 1e9, 0.001, 4) == 4  # never more than the batch's micro-batches
    assert early_microbatches(1e3, 1e9, 0.003, 8) == 1  # at least one: earlier work finishes where it is
    assert early_microbatches(8e6, 0.0, 0.003, 8) == 1  # nothing measured


def test_bad_switch_settings_are_named():
    with pytest.raises(SettingError, match=r"adaptive_switch='pause': one of fine-grained \(AutoPipe-RL §4.4\), stop"):
        PipelineConfig(adaptive_switch="pause")
