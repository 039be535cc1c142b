"""A model created empty (meta device): each rank creates only its stage, with one process's weights."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from models import max_rel_diff, trainer_kwargs
from test_lm_pipeline import bert_data, gpt_data

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.models import CausalLM, MaskedLM, ModelConfig, build_bert, build_gpt
from lightning_pipe.models.build import init_block
from lightning_pipe.models.init import Transient, is_meta, materialize, stand_in

CFG = dict(vocab_size=260, n_layer=2, n_head=2, d_model=32, max_seq_len=16)


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(build=st.sampled_from([build_gpt, build_bert]), held=st.sets(st.integers(0, 5), min_size=1), seed=st.integers(0, 2**40))
def test_any_set_of_blocks_created_from_meta_has_the_one_process_values(build, held, seed):
    """Block i's values depend on (seed, i) alone: whichever blocks a rank creates, they equal the
    blocks of the model built whole on the CPU; a weight two held blocks share stays one tensor. (The
    head's tied weight without the embedding's block has no values yet: the pipeline copies it from
    the first stage holding it, see gradients.StageGradients._tie.)"""
    cfg = ModelConfig(**CFG)
    whole = build(cfg, seed=seed)
    with torch.device("meta"):
        empty = build(cfg, seed=seed)
    assert is_meta(empty)
    materialize({i: empty[i] for i in held}, lambda i, b: init_block(b, i, seed, cfg.n_layer), within=empty)
    for i in held:
        assert not is_meta(empty[i])
        for (name, a), (_, b) in zip(whole[i].state_dict().items(), empty[i].state_dict().items()):
            if i == 5 and name == "weight" and 0 not in held:
                continue
            assert torch.equal(a, b), (i, name)
    assert empty[5].weight is empty[0].token.weight, "the tie is still one object, created or not"
    for i in set(range(1, 5)) - held:
        assert is_meta(empty[i])


def test_building_draws_one_number_on_cpu_and_on_meta_alike():
    """Dropout and data order after the model is built see the same generator either way."""
    torch.manual_seed(5)
    build_gpt(ModelConfig(**CFG))
    after_cpu = torch.rand(3)
    torch.manual_seed(5)
    with torch.device("meta"):
        build_gpt(ModelConfig(**CFG))
    assert torch.equal(torch.rand(3), after_cpu)


def test_a_transient_block_runs_without_holding_parameters():
    with torch.device("meta"):
        model = build_gpt(ModelConfig(**CFG), seed=1)
    t = Transient(model[1])
    assert list(t.parameters()) == []
    out = t(torch.randn(2, 4, 32))
    assert out.shape == (2, 4, 32) and not out.is_meta
    assert not is_meta(stand_in(model[2]))


@pytest.mark.parametrize("build", [build_gpt, build_bert])
def test_a_stand_in_gives_every_tensor_a_typical_value(build):
    # the head's tied embedding weight is reset by no layer of the head: left as fresh memory it held
    # garbage (denormals made the head's matmul ~40x slower: a profile charged it 20 ms instead of 1)
    with torch.device("meta"):
        model = build(ModelConfig(**CFG), seed=1)
    head = stand_in(model[len(model) - 1])
    for name, t in [*head.named_parameters(), *head.named_buffers()]:
        assert torch.isfinite(t).all(), name
        if t.is_floating_point() and t.dim() == 2:  # matrices: small normal values, not zeros or garbage
            assert 0.01 < t.std().item() < 0.2 and t.abs().max().item() < 1.0, name


def _train_pipeline(cls, data, tmp_path, **strategy):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer = L.Trainer(
        devices=2,
        strategy=AutoPipeStrategy(microbatches=4, start_method="spawn", **strategy),
        **trainer_kwargs(precision="64-true", enable_checkpointing=True, callbacks=[ckpt], gradient_clip_val=0.5),
    )
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        model = cls(model=ModelConfig(**CFG), lr=1e-2, warmup_steps=1, max_steps=4)
    assert is_meta(model)
    trainer.fit(model, data())
    return torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]


def _train_reference(cls, data):
    trainer = L.Trainer(devices=1, **trainer_kwargs(precision="64-true", gradient_clip_val=0.5))
    torch.manual_seed(0)
    with trainer.init_module():
        ref = cls(model=ModelConfig(**CFG), lr=1e-2, warmup_steps=1, max_steps=4)
    trainer.fit(ref, data())
    return ref.state_dict()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "cls,data,strategy",
    [
        (CausalLM, gpt_data, dict(schedule="1f1b", partition="autopipe")),  # planned from block-by-block profiles
        (CausalLM, gpt_data, dict(schedule="1f1b", partition=[5, 1])),  # the tied head alone on the last stage
        (MaskedLM, bert_data, dict(schedule="gpipe", partition=[2, 4])),
    ],
)
def test_empty_model_trains_to_the_one_process_weights(cls, data, strategy, tmp_path):
    """Created on meta, every rank creates its blocks only; the full checkpoint after 4 steps
    holds the weights one process reaches from the same seed."""
    ref = _train_reference(cls, data)
    got = _train_pipeline(cls, data, tmp_path, **strategy)
    assert max_rel_diff(ref, got) <= 1e-10
