"""GPT and BERT from sub-layer blocks, tied embedding split over stages, equal single-process training."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.models import CausalLM, MaskedLM, ModelConfig
from models import max_rel_diff, trainer_kwargs

pytestmark = pytest.mark.timeout(240)
CFG = dict(vocab_size=260, n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def gpt_data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (24, 13), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=6)


def bert_data():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (24, 12), generator=g)
    labels = torch.full_like(ids, -100)
    for i in range(ids.shape[0]):  # the same number of predicted positions in every sample
        pos = torch.randperm(12, generator=g)[:3]
        labels[i, pos] = ids[i, pos]
        ids[i, pos] = 257
    mask = torch.ones_like(ids)
    mask[::3, -2:] = 0  # some padding: the mask travels between stages
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=6)


def make(cls):
    torch.manual_seed(0)
    return cls(model=ModelConfig(**CFG), lr=1e-2, warmup_steps=1, max_steps=4).double()


@pytest.mark.parametrize("cls,data,partition", [(CausalLM, gpt_data, [3, 3]), (MaskedLM, bert_data, [2, 4])])
def test_language_model_with_tied_embedding_equals_single_process(cls, data, partition):
    ref = make(cls)
    assert ref.model[-1].weight is ref.model[0].token.weight
    L.Trainer(devices=1, **trainer_kwargs(gradient_clip_val=0.5)).fit(ref, data())
    model = make(cls)
    strategy = AutoPipeStrategy(schedule="1f1b", microbatches=4, partition=partition, start_method="spawn")
    L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(gradient_clip_val=0.5)).fit(model, data())
    assert model.model[-1].weight is model.model[0].token.weight, "the trained model comes back tied"
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10


@pytest.mark.parametrize("devices,schedule,options,m", [
    (2, "wave", dict(waves=1), 2), (2, "wave", dict(waves=2), 4), (2, "interleaved", dict(chunks=2), 4),
])
def test_multichunk_schedules_with_tied_embedding_equal_single_process(devices, schedule, options, m):
    cfg = dict(CFG, n_layer=4)  # 10 blocks: room for 2 x 2 x waves chunks
    torch.manual_seed(0)
    ref = CausalLM(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    L.Trainer(devices=1, **trainer_kwargs()).fit(ref, gpt_data())
    torch.manual_seed(0)
    model = CausalLM(model=ModelConfig(**cfg), lr=1e-2, warmup_steps=1, max_steps=4).double()
    strategy = AutoPipeStrategy(schedule=schedule, microbatches=m, partition="uniform", start_method="spawn", **options)
    trainer = L.Trainer(devices=devices, strategy=strategy, **trainer_kwargs())
    trainer.fit(model, gpt_data())
    assert max_rel_diff(ref.state_dict(), model.state_dict()) <= 1e-10
    # the loss comes from the rank holding the last chunk (rank 0 in a wave): evaluation sees it too
    val_ref = L.Trainer(devices=1, **trainer_kwargs()).validate(ref, gpt_data(), verbose=False)
    val = trainer.validate(model, gpt_data(), verbose=False)
    assert val[0]["val_loss"] == pytest.approx(val_ref[0]["val_loss"], rel=1e-9)
