"""GPT and BERT from sub-layer blocks, tied embedding split over stages, equal single-process training."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from models import START, max_rel_diff, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.models import CausalLM, MaskedLM, ModelConfig
from lightning_pipe.profiling import Profile

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]
CFG = dict(vocab_size=260, n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def gpt_data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (24, 13), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=6)


def bert_data(samples: int = 24, batch_size: int = 6):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (samples, 12), generator=g)
    labels = torch.full_like(ids, -100)
    for i in range(ids.shape[0]):  # the same number of predicted positions in every sample
        pos = torch.randperm(12, generator=g)[:3]
        labels[i, pos] = ids[i, pos]
        ids[i, pos] = 257
    mask = torch.ones_like(ids)
    mask[::3, -2:] = 0  # some padding: the mask travels between stages
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=batch_size)


def make(cls):
    torch.manual_seed(0)
    return cls(model=ModelConfig(**CFG), lr=1e-2, warmup_steps=1, max_steps=4).double()


@pytest.mark.parametrize("cls,data,partition", [(CausalLM, gpt_data, [3, 3]), (MaskedLM, bert_data, [2, 4])])
def test_language_model_with_tied_embedding_equals_single_process(cls, data, partition):
    ref = make(cls)
    assert ref.model[-1].weight is ref.model[0].token.weight
    L.Trainer(devices=1, **trainer_kwargs(gradient_clip_val=0.5)).fit(ref, data())
    model = make(cls)
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=4, partition=partition, start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(gradient_clip_val=0.5))
    trainer.fit(model, data())
    assert model.model[-1].weight is model.model[0].token.weight, "the trained model comes back tied"
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    # the modules' torchmetrics (perplexity; BERT's masked-token accuracy), 4 micro-batches per batch of
    # 6 and 4 batches: the epoch's values are one process's
    (want,) = L.Trainer(devices=1, **trainer_kwargs()).validate(ref, data(), verbose=False)
    (got,) = trainer.validate(model, data(), verbose=False)
    assert set(got) == set(want) >= {"val_loss", "val_ppl"} | ({"val_acc"} if cls is MaskedLM else set())
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9), key


@pytest.mark.parametrize(
    "devices,schedule,options,m,layers",
    [
        (2, "wave", dict(waves=1), 2, 4),
        (2, "wave", dict(waves=2), 4, 4),
        (2, "interleaved", dict(chunks=2), 4, 4),
        (4, "wave", dict(waves=1), 4, 4),
        (4, "wave", dict(waves=2), 4, 7),
        (4, "interleaved", dict(chunks=2), 4, 4),
    ],
)
def test_multichunk_schedules_with_tied_embedding_equal_single_process(devices, schedule, options, m, layers):
    cfg = dict(CFG, n_layer=layers)  # 2 * layers + 2 blocks: room for 2 x ranks x waves chunks
    torch.manual_seed(0)
    ref = CausalLM(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    L.Trainer(devices=1, **trainer_kwargs()).fit(ref, gpt_data())
    torch.manual_seed(0)
    model = CausalLM(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=m, partition="uniform", start_method=START, **options)
    trainer = L.Trainer(devices=devices, strategy=strategy, **trainer_kwargs())
    trainer.fit(model, gpt_data())
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    # the loss comes from the rank holding the last chunk (rank 0 in a wave): evaluation sees it too
    val_ref = L.Trainer(devices=1, **trainer_kwargs()).validate(ref, gpt_data(), verbose=False)
    val = trainer.validate(model, gpt_data(), verbose=False)
    assert val[0]["val_loss"] == pytest.approx(val_ref[0]["val_loss"], rel=1e-9)


@pytest.mark.parametrize("devices,waves", [(2, 2), (4, 1)])
def test_bert_wave_equals_single_process(devices, waves):
    # the attention mask (an integer tensor) travels down and back up the wave, and through local hand-overs
    cfg = dict(CFG, n_layer=4)
    torch.manual_seed(0)
    ref = MaskedLM(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    L.Trainer(devices=1, **trainer_kwargs()).fit(ref, bert_data())
    torch.manual_seed(0)
    model = MaskedLM(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    strategy = AutoPipeStrategy(schedule="wave", waves=waves, microbatches=4, partition="uniform", start_method=START)
    L.Trainer(devices=devices, strategy=strategy, **trainer_kwargs()).fit(model, bert_data())
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


def fit_auto(cls, data, cfg, devices, tmp_path, **kw):
    torch.manual_seed(0)
    ref = cls(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    L.Trainer(devices=1, **trainer_kwargs()).fit(ref, data())
    torch.manual_seed(0)
    model = cls(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    strategy = AutoPipeStrategy(schedule="auto", microbatches=4, start_method=START, **kw)
    L.Trainer(devices=devices, strategy=strategy, default_root_dir=tmp_path, **trainer_kwargs()).fit(model, data())
    summary = json.loads((tmp_path / "plan.json").read_text())
    return ref, model, summary


def check_choice(summary):
    """plan.json names every candidate with its predicted time, and the chosen one is the fastest
    that runs; the run used it."""
    candidates = summary["schedule_choice"]["candidates"]
    runs = [c for c in candidates if c["verdict"] in ("runs", "chosen")]
    chosen = [c for c in candidates if c["verdict"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["iteration_time"] == min(c["iteration_time"] for c in runs)
    assert (summary["schedule"], summary["options"]) == (chosen[0]["schedule"], chosen[0]["options"])
    assert summary["bounds"] == chosen[0]["bounds"]
    return chosen[0]


def test_auto_chooses_by_simulation_and_runs_the_multichunk_choice_exactly(tmp_path):
    # a saved profile with equal blocks: on 2 ranks x 4 micro-batches, with our refined partitions,
    # interleaved v = 2 (4 chunks of 2/3/3/2 blocks) ties v = 4 (8 chunks) at 66 ms and both beat
    # 1F1B's 75 ms; the tie goes to fewer chunks, so "auto" must run interleaved v = 2, exactly
    cfg = dict(CFG, n_layer=4)  # 10 blocks
    path = Profile.synthetic([1e-3] * 10).save(tmp_path / "profile_in.json")
    ref, model, summary = fit_auto(CausalLM, gpt_data, cfg, 2, tmp_path, profile=str(path), partition="autopipe+refine")
    chosen = check_choice(summary)
    assert (chosen["schedule"], chosen["options"]) == ("interleaved", {"chunks": 2})
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    assert model.model[-1].weight is model.model[0].token.weight


def test_auto_profiles_bert_on_4_ranks_and_trains_exactly(tmp_path):
    cfg = dict(CFG, n_layer=4)  # 10 blocks: interleaved v=2 and wave W=1 (8 chunks) are candidates
    ref, model, summary = fit_auto(MaskedLM, bert_data, cfg, 4, tmp_path)
    check_choice(summary)
    names = {(c["schedule"], tuple(sorted(c["options"].items()))): c["verdict"] for c in summary["schedule_choice"]["candidates"]}
    assert names[("wave", (("waves", 2),))].startswith("cannot run")  # 16 chunks > 10 blocks
    # the message costs were measured on the ranks at setup and kept with the profile: 3 links x 40
    # round trips (two hand-offs each) and, the ranks sharing a host, the lockstep's stamped hand-offs
    messages = summary["messages"]
    assert messages["method"] == "bounce+lockstep" and messages["samples"] > 2 * 3 * 40 and messages["send_overhead"] > 0
    assert json.loads((tmp_path / "profile.json").read_text())["messages"] == summary["messages"]
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
