"""tensor=T on models users bring: a Hugging Face Llama split by its own `base_model_tp_plan` (pp2 x tp2, and
with FSDP2 over replicas, pp2 x dp2 x tp2 on 8 ranks), and a home-grown model split by the LightningModule's
`parallelize_block(block, tp_mesh)` hook; against one process, float64, 4 AdamW steps."""

from __future__ import annotations

import glob
import os

import lightning as L
import pytest
import torch
from hf_models import UserLM, close, loader, pair, reference_2bw, train_single, trainer_kwargs, two_replica_data
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from lightning_pipe import AutoPipeStrategy

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]
START = "forkserver"
STEPS = 4


def fit(model, devices, data=None, callbacks=(), ckpt_path=None, max_steps=STEPS, enable_checkpointing=False, **settings):
    settings = {"microbatches": 4, "partition": "uniform", "start_method": START, "tensor": 2, **settings}
    strategy = AutoPipeStrategy(**settings)
    kw = trainer_kwargs(max_steps=max_steps, enable_checkpointing=enable_checkpointing)
    trainer = L.Trainer(devices=devices, strategy=strategy, callbacks=list(callbacks), **kw)
    trainer.fit(model, data or loader(), ckpt_path=ckpt_path)
    return trainer


class Splits(L.Callback):
    """Each rank writes the names of its stage's parameters split over "tp" (DTensors) at the end of fit."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        split = sorted(n for n, p in pl_module.named_parameters() if isinstance(p, DTensor))
        torch.save(split, os.path.join(self.folder, f"split-{trainer.global_rank}.pt"))


def split_names(folder, ranks):
    return [torch.load(os.path.join(folder, f"split-{r}.pt")) for r in range(ranks)]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_llama_split_by_its_own_plan_equals_one_process(tmp_path, schedule):
    ref, model = pair("llama")
    train_single(ref, STEPS)
    fit(model, 4, schedule=schedule, callbacks=[Splits(tmp_path)])
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10
    assert not any(isinstance(p, DTensor) for p in model.parameters()), "fit hands back the user's plain model"
    split = {n.replace("/", ".") for n in set().union(*split_names(tmp_path, 4))}  # a stage's names: model.<block>.<path>
    plan = [k.split("*.")[1] for k in model.model.config.base_model_tp_plan]  # q/k/v/o, gate/up/down projections
    for layer in range(6):
        for part in plan:
            assert any(n.endswith(f"model.layers.{layer}.{part}.weight") for n in split), (layer, part)
    assert not any("norm" in n or "embed" in n or "lm_head" in n for n in split), "what the plan does not name stays whole"


def test_2bw_over_split_blocks_follows_its_rule():
    # PipeDream-2BW's two weight versions of every split weight (each rank's shards double-buffered), 1-stale updates
    ref, model = pair("llama")
    reference_2bw(ref, STEPS)
    fit(model, 4, schedule="2bw", microbatches=2)
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v", "2bw"])
def test_llama_in_three_dimensions_equals_one_process(schedule):
    # pp2 x dp2 x tp2 with FSDP2 over the replicas: Lightning's DistributedSampler (shuffle, the run's seed) deals
    # replica r the rows perm[r::2] of each epoch; one process trains on the union of both replicas' k-th batches.
    # Zero bubble: its input- and weight-gradient passes over FSDP2's 2-D (dp x tp) shards; 2BW: its rule, each rank
    # stashing its 2-D shard of the older version
    ref, model = pair("llama")
    if schedule == "2bw":
        reference_2bw(ref, STEPS, data=two_replica_data(STEPS))
    else:
        train_single(ref, STEPS, data=two_replica_data(STEPS))
    fit(model, 8, width=2, shard="full", microbatches=2, schedule=schedule)
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10


def test_2bw_over_2d_shards_resumes_bit_for_bit(tmp_path):
    # pp2 x dp2 x tp2, 2BW over FSDP2: the stash of each rank's 2-D (dp x tp) shards written whole and read back as
    # the rank's shards; a run resumed at step 2 (an epoch's end: 12 rows a replica in batches of 8) reaches what 4
    # steps in one go do
    settings = dict(width=2, shard="full", microbatches=2, schedule="2bw")
    _, whole = pair("llama")
    fit(whole, 8, **settings)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _, first = pair("llama")
    fit(first, 8, callbacks=[saver], max_steps=2, enable_checkpointing=True, **settings)
    (path,) = glob.glob(os.path.join(tmp_path, "*step=2.ckpt"))
    _, resumed = pair("llama")
    with torch.no_grad():  # other initial weights: the checkpoint's must replace them
        for p in resumed.parameters():
            p.add_(0.1)
    fit(resumed, 8, ckpt_path=path, **settings)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k


class HookedLM(UserLM):
    """A home-grown model: the user says how a block splits (its mix layer column-parallel, as a whole-output
    projection: the block's output is gathered back whole)."""

    def parallelize_block(self, block, tp_mesh):
        for name in [n for n, _ in block.named_modules() if n.endswith("mix")]:
            parallelize_module(block, tp_mesh, {name: ColwiseParallel(output_layouts=Replicate())})


def test_parallelize_block_hook_splits_a_home_grown_model(tmp_path):
    torch.manual_seed(0)
    ref = UserLM("looped", 6)
    model = HookedLM("looped", 6)
    model.load_state_dict(ref.state_dict())
    train_single(ref, STEPS)
    fit(model, 4, callbacks=[Splits(tmp_path)])
    assert close(ref.state_dict(), model.state_dict()) <= 1e-10
    split = {n.replace("/", ".").split(".", 2)[2] for n in set().union(*split_names(tmp_path, 4))}  # model.<block>.<path>
    assert split == {f"blocks.{i}.mix.{k}" for i in range(6) for k in ("weight", "bias")}
