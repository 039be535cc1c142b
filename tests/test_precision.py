"""The pipeline precision plugin: fp16 overflows agreed by every stage, as one process's GradScaler
sees them, and the plugin's class survives the trip to spawned workers."""

from __future__ import annotations

import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from models import START, max_rel_diff, trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import AutoPipeStrategy
from lightning_pipe.lightning.precision import PipelinePrecisionMixin, pipeline_precision

pytestmark = pytest.mark.timeout(240)


class Scale(nn.Module):
    """x * w * c elementwise (c a constant): stays float32 under autocast, so only the GradScaler
    can overflow."""

    def __init__(self, value: float, c: float = 1.0):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), value))
        self.c = c

    def forward(self, x):
        return x * self.w * self.c


class Lopsided(L.LightningModule):
    """The second stage's gradient (S * c * w1 * x / 4) overflows at loss scales S where the first
    stage's (S * c * w2 * x / 4, c * w2 = 1) does not: only the second stage sees the overflow."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(Scale(1.0), Scale(1e-6, c=1e6))

    def training_step(self, batch, batch_idx):
        return self.seq(batch[0]).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)  # steps of ~lr whatever the gradient's size


def data():
    x = torch.rand(32, 4, generator=torch.Generator().manual_seed(0)) + 0.5
    return DataLoader(TensorDataset(x), batch_size=8)


def fp16(scale: float) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000))


SCALE, STEPS = 2e33, 6  # the first steps overflow on the second stage only; later ones train


@pytest.mark.multiprocess
def test_fp16_overflow_is_agreed_by_every_stage():
    ref = Lopsided()
    plugin = fp16(SCALE)
    L.Trainer(devices=1, plugins=[plugin], **trainer_kwargs(max_steps=STEPS)).fit(ref, data())
    assert plugin.scaler.get_scale() < SCALE  # one process skipped steps and backed off
    untrained, model = Lopsided(), Lopsided()
    assert max_rel_diff(untrained.state_dict(), ref.state_dict()) > 1e-3  # and it trained after that
    strategy = AutoPipeStrategy(microbatches=2, partition=[1, 1], start_method=START)
    L.Trainer(devices=2, strategy=strategy, plugins=[fp16(SCALE)], **trainer_kwargs(max_steps=STEPS)).fit(model, data())
    # the first stage skipped exactly the steps one process skipped (alone, it would have taken them)
    assert max_rel_diff(ref.state_dict(), model.state_dict()) < 1e-5


def test_plugin_becomes_pipeline_aware_and_pickles_with_its_state():
    plugin = fp16(2.0**10)
    converted = pipeline_precision(plugin)
    assert isinstance(converted, PipelinePrecisionMixin) and isinstance(converted, MixedPrecision)
    assert converted.scaler is plugin.scaler and converted.precision == "16-mixed"
    again = pickle.loads(pickle.dumps(converted))
    assert type(again) is type(converted) and again.scaler.get_scale() == 2.0**10
    assert pipeline_precision(converted) is converted
    assert isinstance(AutoPipeStrategy().precision_plugin, PipelinePrecisionMixin)
    assert isinstance(pipeline_precision(Precision()), Precision)


def test_the_profile_runs_in_the_runs_precision_and_leaves_the_values_as_the_run_converts_them():
    from lightning.pytorch.plugins.precision import HalfPrecision

    from lightning_pipe.lightning.profile_precision import run_precision

    torch.manual_seed(0)
    pipeline = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    plugin = HalfPrecision("bf16-true")
    direct = {k: v.to(torch.bfloat16) for k, v in pipeline.state_dict().items()}  # what the run's conversion gives
    with run_precision(plugin, pipeline) as convert_input:
        assert {p.dtype for p in pipeline.parameters()} == {torch.bfloat16}
        assert convert_input(torch.ones(2, 4)).dtype == torch.bfloat16 and torch.get_default_dtype() == torch.bfloat16
    assert {p.dtype for p in pipeline.parameters()} == {torch.float32} and torch.get_default_dtype() == torch.float32
    after = plugin.convert_module(pipeline).state_dict()
    assert all(torch.equal(after[k], direct[k]) for k in direct)  # bit for bit


@pytest.mark.multiprocess
def test_a_bf16_true_run_is_planned_on_bf16_costs(tmp_path):
    import json

    from models import LitSeq, loader

    model = LitSeq(dtype="float32")
    strategy = AutoPipeStrategy(microbatches=2, partition="autopipe", message_costs=False, start_method=START)
    trainer = L.Trainer(devices=2, strategy=strategy, default_root_dir=tmp_path, **trainer_kwargs(max_steps=2, precision="bf16-true"))
    trainer.fit(model, loader(dtype=torch.float32))
    profile = json.loads((tmp_path / "profile.json").read_text())
    fp32_bytes = sum(p.numel() * 4 for p in LitSeq(dtype="float32").seq.parameters())
    assert profile["dtype"] == "bfloat16" and sum(profile["param_bytes"]) == fp32_bytes / 2
