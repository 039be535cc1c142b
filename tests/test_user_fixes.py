"""User-reported defects (issue 10), each on the user's own path: the real Trainer on 2 processes.

- A block returning a dict or a list: refused with the same error naming the block under every
  partition (it trained with ``partition=[2, 2]`` and crashed in the profiler with the default
  ``"autopipe"``); a tuple with an integer mask trains under the default too.
- Frozen parameters outside the pipeline train and checkpoint as in one process; trainable ones
  are refused by name.
"""

from __future__ import annotations

import glob

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import START, LitSeq, loader, max_rel_diff, trainer_kwargs
from torch import nn

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.lightning.stage import PipelineSetupError, check_no_outside_parameters


def single(model, steps=4, train=None, **kw):
    trainer = L.Trainer(devices=1, **trainer_kwargs(max_steps=steps, **kw))
    trainer.fit(model, train or loader())
    return trainer


def pipelined(model, partition="autopipe", steps=4, train=None, **kw):
    strategy = AutoPipeStrategy(partition=partition, microbatches=2, start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=steps, **kw))
    trainer.fit(model, train or loader())
    return trainer


# ---- 1. what passes between blocks --------------------------------------------------------------
class Branch(nn.Module):
    """Block 0: (hidden, input) as a dict or a list, as the user's model returned them."""

    def __init__(self, kind: str, width: int = 8):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return {"h": h, "skip": x} if self.kind == "dict" else [h, x] if self.kind == "list" else (h, x)


class Merge(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, inputs):
        h, skip = (inputs["h"], inputs["skip"]) if isinstance(inputs, dict) else inputs
        return self.lin(h) + skip


class BranchingModel(LitSeq):
    """4 blocks; block 0's output goes to block 1, inside stage 0 with partition=[2, 2]."""

    def __init__(self, kind: str = "dict", **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.seq = nn.Sequential(Branch(kind), Merge(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3)).double()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["dict", "list"])
def test_dict_or_list_between_blocks_is_refused_alike_under_every_partition(kind):
    # "autopipe" profiles the blocks at setup; [2, 2] keeps block 0 -> 1 inside stage 0 (it used to
    # train); [1, 3] sends block 0's output to the other stage. One error, naming the block, for all.
    expected = (
        rf"pipeline block 0 \(Branch\) returned a {kind}; an activation passed between pipeline blocks must be "
        r"a tensor or a tuple of tensors \(integer and bool tensors travel without gradients"
    )
    for partition in ("autopipe", [2, 2], [1, 3]):
        with pytest.raises(Exception, match=expected):
            pipelined(BranchingModel(kind), partition, steps=2)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_tuple_activations_train_under_the_default_autopipe_partition():
    # what the runtime passes (a tuple of tensors; an integer mask without a gradient) the profiler
    # takes too: the default partition="autopipe" profiles, plans and trains as one process does
    ref = BranchingModel("tuple")
    single(ref)
    model = BranchingModel("tuple")
    pipelined(model)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    ref = LitSeq(masked=True)
    single(ref, train=loader(masked=True))
    model = LitSeq(masked=True)
    pipelined(model, train=loader(masked=True))
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


# ---- 2. parameters outside the pipeline ---------------------------------------------------------
class FrozenOutside(LitSeq):
    """A frozen input projection and temperature outside the pipeline (and a buffer): the first
    stage runs the projection before the pipeline call, the last stage divides by the temperature."""

    def __init__(self, trainable: bool = False, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(1)
        self.proj = nn.Linear(8, 8).double().requires_grad_(trainable)
        self.temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64), requires_grad=False)
        self.register_buffer("shift", torch.full((8,), 0.1, dtype=torch.float64))

    def logits(self, x):
        return self.seq(self.proj(x) + self.shift) / self.temperature

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.logits(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.logits(x), y))


def test_frozen_parameters_outside_the_pipeline_are_accepted_trainable_ones_refused():
    check_no_outside_parameters(FrozenOutside(), "seq")
    mixed = FrozenOutside()
    mixed.proj.bias.requires_grad_(True)
    with pytest.raises(PipelineSetupError, match=r"has trainable parameters outside its pipeline 'seq': proj.bias\. ") as err:
        check_no_outside_parameters(mixed, "seq")
    assert "proj.weight" not in str(err.value) and "temperature" not in str(err.value)
    # through the Trainer: refused before any process starts
    trainer = L.Trainer(devices=2, strategy=AutoPipeStrategy(start_method=START), **trainer_kwargs())
    with pytest.raises(PipelineSetupError, match=r"trainable parameters outside its pipeline 'seq': proj.weight, proj.bias\. "):
        trainer.fit(FrozenOutside(trainable=True), loader())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_frozen_parameters_outside_the_pipeline_train_checkpoint_and_resume_as_one_process(tmp_path):
    data = dict(n=40)  # 4 batches an epoch: the checkpoint after 4 steps is where a plain DataLoader resumes
    ref = FrozenOutside()
    single(ref, train=loader(**data))
    model = FrozenOutside()
    frozen = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("seq.")}
    assert sorted(frozen) == ["proj.bias", "proj.weight", "shift", "temperature"]
    pipelined(model, train=loader(**data), enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4)])
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    for k, v in frozen.items():
        assert torch.equal(model.state_dict()[k], v), f"{k} must not change"
    # the checkpoint holds the full model, outside parameters and buffer once, and loads in one process
    (path,) = glob.glob(str(tmp_path / "*.ckpt"))
    assert torch.load(path, weights_only=False)["state_dict"].keys() == model.state_dict().keys()
    loaded = FrozenOutside.load_from_checkpoint(path)
    assert max_rel_diff(model.state_dict(), loaded.state_dict()) == 0.0
    assert not loaded.proj.weight.requires_grad and not loaded.temperature.requires_grad
    # and the pipeline resumes from it (optimizer states included) as one process trains on
    ref6 = FrozenOutside()
    single(ref6, steps=6, train=loader(**data))
    resumed = FrozenOutside()
    strategy = AutoPipeStrategy(microbatches=2, start_method=START)
    L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=6)).fit(resumed, loader(**data), ckpt_path=path)
    assert max_rel_diff(ref6.state_dict(), resumed.state_dict()) <= 1e-10
