"""A checkpoint resumes at another depth and on another partition, exactly (issue 10).

Checkpoints key optimizer states by parameter name, so a run checkpointed on P stages continues on
Q. What "exactly" is compared against:

- Bit for bit: the uninterrupted run. The pipeline's arithmetic does not depend on the depth or
  the partition (a block computes the same micro-batches in the same order on any stage, and a
  stage's gradients are the sum of the same micro-batch gradients; the tied weight's gradient is
  the same two-term sum), which `test_depth_and_partition_do_not_change_the_arithmetic` checks
  first. So 4 steps on P stages + 4 resumed on Q stages must equal 8 uninterrupted steps on Q, in
  the weights and in every optimizer state tensor (torch.equal).
- Independently of the strategy's loading code: one plain process resumes from the checkpoint,
  with the optimizer state mapped from names onto a plain optimizer's indices by this file's own
  code, and continues with Lightning's single-device loop. It computes each batch at once instead
  of summing micro-batch gradients, so it agrees to rounding (<= 1e-12 relative), not bit for bit.

Two optimizers whose state matters: AdamW with two param groups (matrices decay, vectors do not;
the tied embedding / LM head in the first and last stage) and SGD with momentum and weight decay,
both with a StepLR schedule (restored by Lightning). Workers are forked: a forked worker starts in
about half a second, a spawned one re-imports torch and Lightning (about 5 s), and this file runs
20 short fits.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import LitSeq, loader, max_rel_diff, trainer_kwargs

import lightning_pipe  # noqa: F401  (registers "autopipe")
from lightning_pipe import AutoPipeStrategy
from lightning_pipe.config import PipelineConfig
from lightning_pipe.errors import SettingError
from lightning_pipe.lightning.checkpoint import consolidate

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiprocess]

START = "forkserver"  # as tests/models.py START: no fork of pytest's threaded process


class GroupedAdamW(LitSeq):
    """AdamW with a no-weight-decay group (the usual split by dimension)."""

    def configure_optimizers(self):
        params = list(self.parameters())
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}}


class MomentumSGD(LitSeq):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}}


# (module class, its arguments, blocks): the tied model is embedding, 3 mixes, the tied head
VARIANTS = {"adamw-tied": (GroupedAdamW, {"tied": True}, 5), "sgd-momentum": (MomentumSGD, {}, 6)}


@dataclass
class Run:
    weights: dict
    ckpts: dict  # step -> the checkpoint written there


def fit(variant, devices, partition, folder, resume=None, checkpoint="full", steps=8):
    """Train to `steps` (4 batches an epoch; a checkpoint every 4 steps), resuming from `resume`."""
    cls, kwargs, _ = VARIANTS[variant]
    model = cls(**kwargs)
    strategy = AutoPipeStrategy(partition=partition, microbatches=3, checkpoint=checkpoint, start_method=START)
    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(devices=devices, strategy=strategy, callbacks=[saver], **trainer_kwargs(max_steps=steps, enable_checkpointing=True))
    trainer.fit(model, loader(n=40, tied=kwargs.get("tied", False)), ckpt_path=resume)
    return Run(model.state_dict(), {4: Path(folder) / "epoch=0-step=4.ckpt", 8: Path(folder) / "epoch=1-step=8.ckpt"})


_RUNS: dict = {}


def uninterrupted(variant, depth, root):
    """8 steps on `depth` stages, partition="uniform" (each run once per module)."""
    if (variant, depth) not in _RUNS:
        _RUNS[variant, depth] = fit(variant, depth, "uniform", root / f"{variant}-p{depth}")
    return _RUNS[variant, depth]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("uninterrupted")


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_checkpoint(path_a, path_b):
    """Weights, every optimizer state tensor, param groups, LR schedulers and position: identical.
    (Lightning's loop counters of a resumed run differ: its "current" counts restart.)"""
    a, b = torch.load(path_a, weights_only=False), torch.load(path_b, weights_only=False)
    assert_same_weights(a["state_dict"], b["state_dict"])
    (oa,), (ob,) = a["optimizer_states"], b["optimizer_states"]
    assert oa["param_groups"] == ob["param_groups"] and oa["autopipe_aliases"] == ob["autopipe_aliases"]
    assert oa["state"].keys() == ob["state"].keys()
    for name, state in oa["state"].items():
        assert state.keys() == ob["state"][name].keys(), name
        for k, v in state.items():
            assert torch.equal(v, ob["state"][name][k]), (name, k)
    assert a["lr_schedulers"] == b["lr_schedulers"] and (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_depth_and_partition_do_not_change_the_arithmetic(variant, root):
    # the premise of the bit-for-bit comparisons below
    assert_same_checkpoint(uninterrupted(variant, 2, root).ckpts[8], uninterrupted(variant, 4, root).ckpts[8])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("source,target,partition", [(2, 4, "uniform"), (4, 2, "uniform"), (2, 2, "first-alone")])
def test_resume_at_another_depth_or_partition_is_bit_exact(variant, source, target, partition, root, tmp_path):
    blocks = VARIANTS[variant][2]
    listed = [1, blocks - 1] if partition == "first-alone" else partition  # P=2 "uniform" cuts 2 | 3 or 3 | 3
    start = uninterrupted(variant, source, root).ckpts[4]
    resumed = fit(variant, target, listed, tmp_path, resume=str(start))
    reference = uninterrupted(variant, target, root)
    assert_same_weights(resumed.weights, reference.weights)
    assert_same_checkpoint(resumed.ckpts[8], reference.ckpts[8])
    state = torch.load(resumed.ckpts[8], weights_only=False)["optimizer_states"][0]
    assert state["autopipe_depth"] == target  # the resumed run planned its own layout ...
    if partition == "first-alone":
        assert state["autopipe_bounds"] == [[0, 1], [1, blocks]]  # ... and took the listed partition over the checkpoint's


def plain_checkpoint(path, variant, out):
    """The pipeline's checkpoint as a single-device one: the name-keyed optimizer state mapped onto
    the indices of a plain optimizer over the whole model (this test's own mapping)."""
    cls, kwargs, _ = VARIANTS[variant]
    ckpt = torch.load(path, weights_only=False)
    model = cls(**kwargs)
    optimizer = model.configure_optimizers()["optimizer"]
    name_of = {id(p): n for n, p in model.named_parameters()}  # a tied weight: its first name
    named = ckpt["optimizer_states"][0]
    state, groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, named["param_groups"], strict=True):
        names = [name_of[id(p)] for p in group["params"]]
        assert names == saved["params"]  # the same parameters, stored in model order
        state.update({index + i: named["state"][n] for i, n in enumerate(names) if n in named["state"]})
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(index, index + len(names)))})
        index += len(names)
    ckpt["optimizer_states"] = [{"state": state, "param_groups": groups}]
    torch.save(ckpt, out)
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_process_continues_from_the_checkpoint_alike(variant, root, tmp_path):
    cls, kwargs, _ = VARIANTS[variant]
    start = plain_checkpoint(uninterrupted(variant, 2, root).ckpts[4], variant, tmp_path / "plain.ckpt")
    model = cls(**kwargs, seed=7)  # other initial weights: everything comes from the checkpoint
    trainer = L.Trainer(devices=1, **trainer_kwargs(max_steps=8))
    trainer.fit(model, loader(n=40, tied=kwargs.get("tied", False)), ckpt_path=start)
    # the pipeline sums micro-batch gradients, one process takes each batch at once: rounding only
    assert max_rel_diff(model.state_dict(), uninterrupted(variant, 4, root).weights) <= 1e-12


def test_sharded_checkpoint_resumes_at_another_depth_and_consolidates(root, tmp_path):
    variant = "adamw-tied"
    first = fit(variant, 2, "uniform", tmp_path / "p2", checkpoint="sharded")
    assert len(glob.glob(str(first.ckpts[4] / "*.distcp"))) == 2  # every rank wrote its own stage
    resumed = fit(variant, 4, "uniform", tmp_path / "q4", resume=str(first.ckpts[4]), checkpoint="sharded")
    assert len(glob.glob(str(resumed.ckpts[8] / "*.distcp"))) == 4
    assert_same_weights(resumed.weights, first.weights)
    assert_same_weights(first.weights, uninterrupted(variant, 2, root).weights)  # sharded or not: one computation
    # consolidated: the layout of checkpoint="full", the same bits as the full run's own file
    for run, out in ((first, "first.ckpt"), (resumed, "resumed.ckpt")):
        consolidate(run.ckpts[8], tmp_path / out)
    assert_same_checkpoint(tmp_path / "first.ckpt", uninterrupted(variant, 2, root).ckpts[8])
    assert_same_checkpoint(tmp_path / "resumed.ckpt", uninterrupted(variant, 2, root).ckpts[8])
    cls, kwargs, _ = VARIANTS[variant]
    loaded = cls.load_from_checkpoint(tmp_path / "resumed.ckpt")  # a plain process, no process group
    assert_same_weights(loaded.state_dict(), first.weights)
    # the tied weight's optimizer state was written once, under its first name
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(first.ckpts[8])).read_metadata().state_dict_metadata
    assert "optimizer_0/seq.0.emb.weight/exp_avg" in keys and not any(k.startswith("optimizer_0/seq.4.") for k in keys)


def test_checkpoints_of_the_index_layout_resume_at_their_depth(root, tmp_path):
    # a checkpoint written before names (each stage's optimizer.state_dict(), by its indices)
    variant = "sgd-momentum"
    ckpt = torch.load(uninterrupted(variant, 2, root).ckpts[4], weights_only=False)
    named = ckpt["optimizer_states"][0]
    (group,) = named["param_groups"]
    hyper = {k: v for k, v in group.items() if k != "params"}
    stages = []
    for start, stop in named["autopipe_bounds"]:
        names = [n for n in group["params"] if start <= int(n.split(".")[1]) < stop]
        stages.append(
            {"state": {i: named["state"][n] for i, n in enumerate(names)}, "param_groups": [{**hyper, "params": list(range(len(names)))}]}
        )
    ckpt["optimizer_states"] = [
        {"autopipe_stage_states": stages, **{k: v for k, v in named.items() if k.startswith("autopipe_") and k != "autopipe_aliases"}}
    ]
    torch.save(ckpt, tmp_path / "old.ckpt")
    resumed = fit(variant, 2, "uniform", tmp_path / "same", resume=str(tmp_path / "old.ckpt"))
    assert_same_weights(resumed.weights, uninterrupted(variant, 2, root).weights)
    with pytest.raises(Exception, match="resume it with that depth and partition"):
        fit(variant, 4, "uniform", tmp_path / "deeper", resume=str(tmp_path / "old.ckpt"))


def test_checkpoint_setting_is_checked():
    assert PipelineConfig(checkpoint="Sharded").checkpoint == "sharded"
    with pytest.raises(SettingError, match=r"checkpoint='gathered'; allowed values: \['full', 'sharded'\]"):
        PipelineConfig(checkpoint="gathered")
    assert AutoPipeStrategy(checkpoint="sharded").config.checkpoint == "sharded"
