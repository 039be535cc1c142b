"""The layers compose: schedule x weight versions x replicas x forced switch x micro-batches x depth.

Each legal combination trains on real processes and must end where a one-process reference
composed from the per-layer rules ends (fp64, <= 1e-10); the rules are written here from the papers,
not from the code:

- weight versions: a flush takes batch t's gradient at W(t); PipeDream-2BW at W(max(t - 1, 0));
- replicas: none; width 2 averages the two shards' gradients (whole replicas, or sharded: ZeRO-1's
  optimizer state, FSDP2's blocks; the update is the same); AvgPipe N = 2 trains one model per
  shard and after each update pulls it: W_n <- (1 - α) W_n(t) + α W_ref(max(t - s, 0)) + Δ_n,
  W_ref(t + 1) = W_ref(t) + mean_n Δ_n;
- the schedule, the micro-batch count and a live switch change when work runs, never the result.

Each illegal combination is refused before any process starts, in one line naming a setting that
clashes. CI runs the listed examples and a few seeded draws; a longer profile by hand:
LIGHTNING_PIPE_PRODUCT_EXAMPLES=40 python -m pytest tests/test_product.py
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import Callback
from models import START, LitSeq, dataset, max_rel_diff, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.errors import SettingError

pytestmark = [pytest.mark.multiprocess]
BLOCKS, SAMPLES, BATCH, STEPS, SWITCH_AT = 6, 40, 10, 5, 2
ALPHA, STALENESS = 0.3, 1
SCHEDULES = ["gpipe", "1f1b", "interleaved", "hanayo", "advance", "2bw"]
REPLICAS = ["none", "width", "zero1", "fsdp", "avgpipe"]
SHARD = {"zero1": "optimizer", "fsdp": "full"}  # width 2 with its replicas sharded
EXAMPLES = int(os.environ.get("LIGHTNING_PIPE_PRODUCT_EXAMPLES", "2"))


def chunks(schedule: str, depth: int) -> int:
    return 2 * depth if schedule in ("interleaved", "hanayo") else depth


def clashes(schedule: str, depth: int, m: int) -> set[str]:
    """The settings a combination breaks, from the schedules' own papers (empty: legal)."""
    out = set()
    if chunks(schedule, depth) > BLOCKS:  # every model chunk needs a block
        out.add("waves" if schedule == "hanayo" else "chunks")
    if schedule == "interleaved" and m % depth:
        out.add("microbatches")  # Narayanan et al. 2021: M a multiple of the stages
    if schedule == "2bw" and m < depth:
        out.add("microbatches")  # PipeDream-2BW: m >= d keeps two versions
    return out


def shard_clashes(schedule: str, replicas: str) -> set[str]:
    """Every schedule runs over both shardings (2BW over FSDP2: each rank stashes its shard of the second
    version). Neither sharding moves blocks live: `combinations` draws no switch for them, a
    repartition() call is refused in the workers."""
    return set()


@st.composite
def combinations(draw):
    replicas = draw(st.sampled_from(REPLICAS))
    depth = 2 if replicas != "none" else draw(st.sampled_from([2, 4]))  # at most 4 worker processes
    switch = draw(st.booleans()) and replicas not in SHARD  # a live switch of sharded replicas fails in the workers
    return draw(st.sampled_from(SCHEDULES)), replicas, switch, draw(st.integers(1, 4)), depth


def sizes(count: int) -> list[int]:
    return [BLOCKS // count + (1 if i < BLOCKS % count else 0) for i in range(count)]


def moved(partition: list[int]) -> list[list[int]]:
    """The partition with its first boundary moved by one block (bounds per chunk)."""
    new = list(partition)
    step = 1 if new[1] > 1 else -1
    new[0], new[1] = new[0] - step, new[1] + step
    edges = [0] + [sum(new[: i + 1]) for i in range(len(new))]
    return [[a, b] for a, b in zip(edges, edges[1:])]


class SwitchOnce(Callback):
    def __init__(self, bounds):
        self.bounds = bounds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == SWITCH_AT:
            trainer.strategy.repartition(self.bounds)

    def on_train_end(self, trainer, pl_module):
        Path(f"product-held-{trainer.global_rank}.json").write_text(json.dumps([list(b) for b in trainer.strategy.cut.bounds]))


# ---- the one-process reference, composed from the per-layer rules ------------------------------
def shard(r: int, shards: int) -> list:
    """Replica r's batches: Lightning's DistributedSampler (shuffled with PL_GLOBAL_SEED, per epoch)."""
    data = dataset(n=SAMPLES)
    if shards == 1:
        batches = list(DataLoader(data, batch_size=BATCH))
        return (batches * STEPS)[:STEPS]
    sampler = DistributedSampler(data, num_replicas=shards, rank=r, shuffle=True, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
    out, epoch = [], 0
    while len(out) < STEPS:
        sampler.set_epoch(epoch)
        out += list(DataLoader(data, batch_size=BATCH, sampler=sampler))
        epoch += 1
    return out[:STEPS]


def gradient(module: nn.Module, batch) -> list[torch.Tensor]:
    module.zero_grad()
    x, y = batch
    nn.functional.cross_entropy(module(x), y).backward()
    return [p.grad.clone() for p in module.parameters()]


def reference(versions: str, replicas: str) -> dict[str, torch.Tensor]:
    """The model a run hands back: the trained model, or AvgPipe's reference model."""
    shards = 1 if replicas == "none" else 2
    models = [LitSeq() for _ in range(2 if replicas == "avgpipe" else 1)]
    confs = [m.configure_optimizers() for m in models]
    data = [shard(r, shards) for r in range(shards)]
    previous = [copy.deepcopy(m.seq) for m in models]  # W(t - 1): what 2BW's batch t reads
    refs = [{k: v.detach().clone() for k, v in models[0].named_parameters()}]
    for t in range(STEPS):
        deltas = []
        for n, (model, conf) in enumerate(zip(models, confs)):
            at = previous[n] if versions == "2bw" and t >= 1 else copy.deepcopy(model.seq)
            mine = [n] if replicas == "avgpipe" else range(shards)
            grads = [gradient(at, data[r][t]) for r in mine]
            previous[n] = copy.deepcopy(model.seq)
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            for i, p in enumerate(model.seq.parameters()):
                p.grad = sum(g[i] for g in grads) / len(grads)
            conf["optimizer"].step()
            conf["lr_scheduler"]["scheduler"].step()
            if replicas == "avgpipe":
                delta = {k: v.detach() - before[k] for k, v in model.named_parameters()}
                with torch.no_grad():
                    for k, p in model.named_parameters():
                        p.copy_((1 - ALPHA) * before[k] + ALPHA * refs[max(t - STALENESS, 0)][k] + delta[k])
                deltas.append(delta)
        if replicas == "avgpipe":
            refs.append({k: refs[t][k] + sum(d[k] for d in deltas) / len(deltas) for k in refs[0]})
    return refs[STEPS] if replicas == "avgpipe" else models[0].state_dict()


# ---- the property -------------------------------------------------------------------------------
@pytest.mark.timeout(900)
@settings(
    max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(combinations())
@example(("2bw", "avgpipe", True, 2, 2))  # AvgPipe(2BW) with a live switch
@example(("hanayo", "width", True, 3, 2))  # Hanayo's waves on replicas, a switch between chunks
@example(("advance", "none", True, 4, 4))  # the advance rule at depth 4, with a switch
@example(("interleaved", "none", False, 2, 4))  # illegal: 8 chunks of 6 blocks
@example(("hanayo", "fsdp", False, 2, 2))  # FSDP2 under Hanayo's waves
@example(("advance", "zero1", False, 3, 2))  # ZeRO-1 under the advance rule
@example(("2bw", "fsdp", False, 3, 2))  # 2BW's two versions over FSDP2's shards
def test_every_combination_is_exact_or_refused(tmp_path_factory, combination):
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("product"))  # the workers write what they held here
    try:
        check(*combination)
    finally:
        os.chdir(here)


def check(schedule: str, replicas: str, switch: bool, m: int, depth: int) -> None:
    width = 2 if replicas in ("width", *SHARD) else 1
    pipelines = 2 if replicas == "avgpipe" else None
    devices = depth * width  # AvgPipe's 2 pipelines share the depth's devices
    world = depth * (2 if replicas != "none" else 1)
    settings_ = dict(schedule=schedule, microbatches=m, width=width, pipelines=pipelines, start_method=START)
    settings_["shard"] = SHARD.get(replicas, "none")
    if pipelines:
        settings_.update(alpha=ALPHA, staleness=STALENESS)
    broken = clashes(schedule, depth, m) or shard_clashes(schedule, replicas)
    if broken:
        started = time.monotonic()
        with pytest.raises(SettingError) as err:
            strategy = AutoPipeStrategy(**settings_)
            L.Trainer(devices=devices, strategy=strategy, **trainer_kwargs(max_steps=1)).fit(LitSeq(), DataLoader(dataset(n=SAMPLES)))
        assert time.monotonic() - started < 15, "refused before any process started"
        assert "\n" not in str(err.value) and err.value.setting in broken and err.value.setting in str(err.value), str(err.value)
        return
    partition = sizes(chunks(schedule, depth))
    callbacks = [SwitchOnce(moved(partition))] if switch else []
    model = LitSeq()
    strategy = AutoPipeStrategy(partition=partition, **settings_)
    trainer = L.Trainer(devices=devices, strategy=strategy, callbacks=callbacks, **trainer_kwargs(max_steps=STEPS))
    trainer.fit(model, DataLoader(dataset(n=SAMPLES), batch_size=BATCH))
    versions = "2bw" if schedule == "2bw" else "flush"
    assert max_rel_diff(reference(versions, replicas), model.state_dict()) <= 1e-10, (schedule, replicas, switch, m, depth)
    if switch:  # every rank ended on the switched partition
        for rank in range(world):
            assert json.loads(Path(f"product-held-{rank}.json").read_text()) == moved(partition)
